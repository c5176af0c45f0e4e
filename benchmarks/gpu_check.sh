#!/usr/bin/env bash
# The GPU check, in one call on one GPU (H200/H100) within 10 minutes:
#   environment -> kernel tests natively (Pallas compiled by Triton, flash attention included)
#   -> each kernel against XLA and its roofline -> train step tokens/s and MFU at sequence 4096,
#   bf16, for a dense and an MoE model -> long-context attention (Pallas flash vs blockwise vs
#   materialized) -> one summary table against the targets.
#
#   bash benchmarks/gpu_check.sh [--results DIR] [kernel_bench args, default --quick]
#   bash benchmarks/gpu_check.sh --dry-run [--results DIR]    # CPU, tiny sizes, every stage
#
# Every stage is time-boxed and writes JSON lines into the results directory (default
# $OUT/gpu_check when $OUT is set, else /tmp/gpu_check); a failing stage does not stop the next;
# benchmarks/gpu_summary.py prints the table last. Exit status: 0 when every stage succeeded and
# left its results, 1 otherwise (targets missed are reported in the table, not in the status).
#
# Time budget on the GPU (seconds, the limit of each stage; all of them end by 575 s):
#   environment 30 | kernel tests 120 | kernel benchmarks 150 | dense train step 80 |
#   MoE train step 90 | long context 60 | summary 15                      = 545 s
# A stage gets at most what is left before the deadline, keeping the summary's share, so a stage
# that overruns (up to 10 s between its signal and KILL) is paid for by the later ones.
set -u
cd "$(dirname "$0")/.."

DRY=0
RESULTS="${GPU_CHECK_RESULTS:-}"
BENCH_ARGS=()
while (($#)); do
  case "$1" in
    --dry-run) DRY=1 ;;
    --results) RESULTS="$2"; shift ;;
    --results=*) RESULTS="${1#--results=}" ;;
    *) BENCH_ARGS+=("$1") ;;
  esac
  shift
done
((${#BENCH_ARGS[@]})) || BENCH_ARGS=(--quick)  # one size per kernel: the 4096 shapes the configs train
[[ -n "$RESULTS" ]] || { if [[ -n "${OUT:-}" ]]; then RESULTS="$OUT/gpu_check"; else RESULTS=/tmp/gpu_check; fi; }
mkdir -p "$RESULTS" || { echo "cannot create results directory $RESULTS"; exit 1; }
RESULTS="$(cd "$RESULTS" && pwd)"
# Only this script's own files are cleared: a --results directory may hold other things.
rm -f "$RESULTS"/{run.json,stages.jsonl,env.json,kernel_tests.jsonl,kernels.jsonl,train_dense.jsonl} \
      "$RESULTS"/{train_moe.jsonl,long_context.jsonl,summary.txt} "$RESULTS"/*.log

if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3; fi

STAGES=(environment kernel_tests kernel_bench train_dense train_moe long_context)
declare -A LIMIT
if ((DRY)); then
  MODE=dry-run; DEADLINE=600
  LIMIT=([environment]=60 [kernel_tests]=120 [kernel_bench]=150 [train_dense]=90 [train_moe]=90
         [long_context]=120 [summary]=30)
  export JAX_PLATFORMS=cpu
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0"  # tiny programs: compile fast
  KB_BUDGET=120
else
  MODE=gpu; DEADLINE=575
  LIMIT=([environment]=30 [kernel_tests]=120 [kernel_bench]=150 [train_dense]=80 [train_moe]=90
         [long_context]=60 [summary]=15)
  # tests/conftest.py defaults JAX_PLATFORMS to cpu; the point here is the GPU.
  export JAX_PLATFORMS="${GPU_JAX_PLATFORMS:-cuda}"
  # One process at a time holds the GPU: let it have nearly all of it (jax's default is 75%).
  export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
  KB_BUDGET=115
fi
DEADLINE="${GPU_CHECK_DEADLINE_S:-$DEADLINE}"  # e.g. less when the GPU is lent for less
START=$(date +%s)
printf '{"mode": "%s", "started": "%s", "deadline_s": %d, "stages": ["%s"]}\n' "$MODE" \
  "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$DEADLINE" "$(IFS=,; echo "${STAGES[*]}" | sed 's/,/", "/g')" \
  > "$RESULTS/run.json"
echo "gpu_check ($MODE): results in $RESULTS"

status=0
# stage NAME SIGNAL TAIL_LINES CMD...: runs CMD under its time limit (SIGNAL first, KILL 10 s
# later), its output in NAME.log, the last TAIL_LINES lines shown, one line in stages.jsonl.
stage() {
  local name=$1 sig=$2 lines=$3; shift 3
  local now left limit rc t0
  now=$(date +%s)
  left=$((DEADLINE - (now - START)))
  [[ $name == summary ]] || left=$((left - LIMIT[summary]))
  limit=${LIMIT[$name]}
  ((left < limit)) && limit=$((left > 0 ? left : 0))
  echo
  echo "== $name (limit ${limit} s)"
  if ((limit < 5)); then
    echo "-- $name: skipped, the check's time is spent"
    rc=125
  else
    t0=$(date +%s)
    timeout -s "$sig" -k 10 "$limit" "$@" > "$RESULTS/$name.log" 2>&1
    rc=$?
    grep -v '^W[0-9]\{4\} ' "$RESULTS/$name.log" | tail -n "$lines"
    now=$(date +%s)
    echo "-- $name: exit $rc in $((now - t0)) s$( ((rc == 124 || rc == 137)) && echo ' (time limit)')"
  fi
  printf '{"stage": "%s", "rc": %d, "seconds": %d, "limit_s": %d, "log": "%s.log"}\n' \
    "$name" "$rc" "$(( $(date +%s) - ${t0:-$now} ))" "$limit" "$name" >> "$RESULTS/stages.jsonl"
  ((rc == 0)) || status=1
}

# grain and gin-config are not in the GPU image: benchmarks/fetch_gpu_wheels.sh puts them in .whl/.
# Installed before the stages (in this shell, so that every stage sees the exported PYTHONPATH).
if ((!DRY)) && compgen -G ".whl/*.whl" > /dev/null; then
  timeout -k 5 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}" || echo "installing .whl/ failed"
fi

# -- environment: the GPU, versions, devices, peak FLOP/s, the imports the stages need.
stage environment TERM 40 "$PY" benchmarks/gpu_env.py --out "$RESULTS/env.json" \
  --expect "$( ((DRY)) && echo cpu || echo gpu)"

# -- kernel tests. On the GPU all of them, natively; dry run: the argument-error tests (one per
# file), which still imports and collects every kernel test file.
TEST_SELECT=()
((DRY)) && TEST_SELECT=(-k bad)
GPU_CHECK_TESTS_JSONL="$RESULTS/kernel_tests.jsonl" PYTHONPATH="benchmarks:${PYTHONPATH:-}" \
  stage kernel_tests INT 25 "$PY" -m pytest -q -p no:cacheprovider -p pytest_jsonl "${TEST_SELECT[@]}" \
  tests/test_kernels_*.py

# -- kernel benchmarks: Pallas vs XLA vs roofline (kernel_bench.py skips sections past its budget).
KB_ARGS=("${BENCH_ARGS[@]}")
((DRY)) && KB_ARGS=(--smoke)
stage kernel_bench TERM 30 "$PY" benchmarks/kernel_bench.py --budget_s "$KB_BUDGET" \
  --json "$RESULTS/kernels.jsonl" "${KB_ARGS[@]}"

# -- train steps at sequence 4096, bf16 (dry run: the same configs and flags at tiny sizes, and
# a nominal peak so the MFU path runs).
DENSE_TINY=() MOE_TINY=() LONG_TINY=() PEAK=()
PALLAS_ATTENTION=pallas LONG_SEQ=8192 STEPS=10 LONG_STEPS=5
if ((DRY)); then
  PEAK=(--gin_param=ObserveConfig.peak_flops_per_device=1e11)
  DENSE_TINY=(--gin_param=LlamaConfig.layers=2 --gin_param=LlamaConfig.embed=64 --gin_param=LlamaConfig.heads=4
              --gin_param=LlamaConfig.kv_heads=2 --gin_param=LlamaConfig.mlp=128 --gin_param=LlamaConfig.vocab_size=512
              --gin_param=TrainConfig.global_batch=4 --gin_param=TrainConfig.seq_len=128
              --gin_param=LossConfig.loss_chunk=64)
  MOE_TINY=(--gin_param=DeepSeekConfig.layers=2 --gin_param=DeepSeekConfig.embed=64 --gin_param=DeepSeekConfig.heads=2
            --gin_param=DeepSeekConfig.kv_lora_rank=32 --gin_param=DeepSeekConfig.qk_nope_head_dim=16
            --gin_param=DeepSeekConfig.qk_rope_head_dim=8 --gin_param=DeepSeekConfig.v_head_dim=16
            --gin_param=DeepSeekConfig.mlp=128 --gin_param=DeepSeekConfig.expert_mlp=32
            --gin_param=DeepSeekConfig.vocab_size=512 --gin_param=RouterConfig.num_experts=4
            --gin_param=RouterConfig.top_k=2 --gin_param=TrainConfig.global_batch=2
            --gin_param=TrainConfig.seq_len=128 --gin_param=LossConfig.loss_chunk=64
            '--gin_param=DeepSeekConfig.kernels="pallas"')  # interpreted: the GPU's kernel path
  LONG_TINY=("${DENSE_TINY[@]:0:6}" --gin_param=LossConfig.loss_chunk=64)
  PALLAS_ATTENTION=pallas_interpret LONG_SEQ=256 STEPS=2 LONG_STEPS=2
fi
stage train_dense TERM 6 "$PY" -m jaxtrain.bench step --gin_file=configs/gpu_dense_4k.gin --steps "$STEPS" \
  --json "$RESULTS/train_dense.jsonl" "${PEAK[@]}" "${DENSE_TINY[@]}"
stage train_moe TERM 6 "$PY" -m jaxtrain.bench step --gin_file=configs/gpu_moe_4k.gin --steps "$STEPS" \
  --json "$RESULTS/train_moe.jsonl" "${PEAK[@]}" "${MOE_TINY[@]}"

# -- long context on one GPU: the small dense model, one 8k-token row, three attentions side by
# side in one process (the materialized reference last: if it runs out of memory the others are in).
stage long_context TERM 10 "$PY" -m jaxtrain.bench step --gin_file=configs/gpu_dense_small.gin --steps "$LONG_STEPS" \
  --json "$RESULTS/long_context.jsonl" "${PEAK[@]}" "${LONG_TINY[@]}" \
  --gin_param=TrainConfig.global_batch=1 --gin_param=TrainConfig.seq_len="$LONG_SEQ" \
  --layout attention="$PALLAS_ATTENTION" --layout attention=blockwise --layout attention=materialized

# -- the table (also written to summary.txt); it fails when a stage left no results.
stage summary TERM 200 "$PY" benchmarks/gpu_summary.py "$RESULTS"
exit $status
