#!/usr/bin/env bash
# GPU check for pallas_kernels: the kernel tests natively on the GPU, then the
# kernel benchmark table (Pallas vs XLA vs roofline). Needs one NVIDIA GPU, no
# network; about 6 minutes on an H200. Each step is time-boxed and a failing
# step does not stop the next one; the exit code is non-zero if any failed.
#
#   bash benchmarks/gpu_check.sh [--quick]     # extra args go to kernel_bench.py
set -u
cd "$(dirname "$0")/.."

if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3; fi

# grain and gin-config are not in the GPU image: benchmarks/fetch_gpu_wheels.sh puts them in .whl/.
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi

# tests/conftest.py defaults JAX_PLATFORMS to cpu; the point here is the GPU.
export JAX_PLATFORMS="${GPU_JAX_PLATFORMS:-cuda}"

status=0
echo "== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  || echo "nvidia-smi unavailable"
"$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', \
jaxlib.__version__, jax.devices())" || status=1

echo "== kernel tests (native GPU: Pallas runs as compiled Triton)"
timeout -k 10 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels_*.py \
  2>&1 | tail -n 40
rc=${PIPESTATUS[0]}
[[ $rc -eq 0 ]] || { echo "kernel tests: exit $rc"; status=1; }

echo "== kernel benchmarks"
timeout -k 10 210 "$PY" benchmarks/kernel_bench.py --budget_s 150 "$@"
rc=$?
[[ $rc -eq 0 ]] || { echo "kernel_bench: exit $rc"; status=1; }

echo "== train step: small dense and small MoE model (tokens/s, MFU, memory)"
for cfg in configs/gpu_dense_small.gin configs/gpu_moe_small.gin; do
  timeout -k 10 120 "$PY" -m jaxtrain.bench step --gin_file="$cfg" --steps 10 2>&1 | grep -v "^W[0-9]" | tail -n 6
  rc=${PIPESTATUS[0]}
  [[ $rc -eq 0 ]] || { echo "bench $cfg: exit $rc"; status=1; }
done

echo "== long context on one GPU: Pallas flash vs blockwise vs materialized attention (train step, 8k tokens)"
timeout -k 10 180 "$PY" -m jaxtrain.bench step --gin_file=configs/gpu_dense_small.gin --steps 5 \
  --gin_param=TrainConfig.global_batch=1 --gin_param=TrainConfig.seq_len=8192 \
  --layout attention=pallas --layout attention=blockwise --layout attention=materialized 2>&1 | grep -v "^W[0-9]" | tail -n 8
rc=${PIPESTATUS[0]}
[[ $rc -eq 0 ]] || { echo "bench long context: exit $rc"; status=1; }

exit $status
