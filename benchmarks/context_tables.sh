#!/usr/bin/env bash
# Re-measures the long-context tables in README.md ("Long context"): compile-only per-device
# memory and collective bytes per step (loop bodies counted once per trip) on simulated CPU
# devices, and ring vs all-gather step time measured side by side.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
quiet() { grep -v -E "^(W|I|E)[0-9]{4}|Warning|warnings.warn|Constant folding|This isn't|If you'd like|reduce-window|^\s*$"; }
LLAMA_LONG="--gin_file=configs/default.gin --gin_param=TrainConfig.global_batch=1 --gin_param=LlamaConfig.remat=\"full\""

echo "== default Llama, batch 1, context=16: materialized vs blockwise attention at 64k tokens"
$PY -m jaxtrain.bench step $LLAMA_LONG --gin_param=TrainConfig.seq_len=65536 --compile_only \
  --layout context=16,attention=materialized --layout context=16,attention=blockwise,kv=ring 2>&1 | quiet

for L in 1048576 2097152 4194304; do
  echo "== default Llama, batch 1, context=16, $L tokens"
  $PY -m jaxtrain.bench step $LLAMA_LONG --gin_param=TrainConfig.seq_len=$L --compile_only \
    --layout context=16,attention=blockwise,kv=ring --layout context=16,attention=blockwise,kv=allgather 2>&1 | quiet
done

echo "== DeepSeek-V2-Lite attention shape (27 layers made dense), 128k tokens, context=16"
$PY -m jaxtrain.bench step --gin_file=configs/deepseek_v2_lite.gin --gin_param=DeepSeekConfig.first_k_dense=27 \
  --gin_param=TrainConfig.global_batch=1 --gin_param=TrainConfig.seq_len=131072 --compile_only \
  --layout context=16,rules=dp,attention=materialized --layout context=16,rules=dp,attention=blockwise \
  --layout context=16,rules=zero1,attention=blockwise 2>&1 | quiet

echo "== DeepSeek-V2-Lite (MoE, full size), 1M tokens, 64 devices"
$PY -m jaxtrain.bench step --gin_file=configs/deepseek_v2_lite.gin --gin_param=TrainConfig.global_batch=1 \
  --gin_param=TrainConfig.seq_len=1048576 --gin_param=LossConfig.loss_chunk=4096 --compile_only \
  --layout context=32,tensor=2,rules=fsdp+experts_folded,attention=blockwise \
  --layout context=16,tensor=4,rules=fsdp+experts_folded,attention=blockwise 2>&1 | quiet

echo "== DeepSeek-V2-Lite attention shape (27 layers made dense), 1M tokens, 64 devices"
$PY -m jaxtrain.bench step --gin_file=configs/deepseek_v2_lite.gin --gin_param=DeepSeekConfig.first_k_dense=27 \
  --gin_param=TrainConfig.global_batch=1 --gin_param=TrainConfig.seq_len=1048576 --gin_param=LossConfig.loss_chunk=4096 \
  --compile_only --layout context=32,tensor=2,rules=fsdp,attention=blockwise \
  --layout context=16,tensor=4,rules=fsdp,attention=blockwise --layout context=64,rules=fsdp,attention=blockwise 2>&1 | quiet

echo "== ring vs all-gather (and contiguous order) step time, 2-layer default Llama, batch 2 x 4096, context=8 x data=2"
$PY -m jaxtrain.bench step --gin_file=configs/default.gin --gin_param=TrainConfig.global_batch=2 \
  --gin_param=TrainConfig.seq_len=4096 --gin_param=LlamaConfig.layers=2 --steps 3 \
  --layout context=8,data=2,attention=blockwise,kv=ring --layout context=8,data=2,attention=blockwise,kv=allgather \
  --layout context=8,data=2,attention=blockwise,kv=ring,order=contiguous 2>&1 | quiet
