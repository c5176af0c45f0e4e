#!/usr/bin/env bash
# Re-measures the CPU tables in README.md (16 simulated devices on this machine's CPU cores).
# Each table's layouts run side by side in one process, so their ratios are comparable.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
quiet() { grep -v -E "^(W|I)[0-9]{4}|Warning|warnings.warn|^\s*$"; }

echo "== default model (configs/default.gin), 16 simulated devices"
$PY -m jaxtrain.bench step --gin_file=configs/default.gin --steps 5 \
  --layout data=16 --layout data=4,tensor=4 --layout data=8,tensor=2,rules=fsdp \
  --layout data=2,expert=2,tensor=4 --layout data=4,context=2,tensor=2,rules=dp_sp 2>&1 | quiet

echo "== tiny DeepSeek-V2 (configs/deepseek_v2_tiny.gin), 16 simulated devices"
$PY -m jaxtrain.bench step --gin_file=configs/deepseek_v2_tiny.gin --steps 5 \
  --layout expert=16,rules=dp --layout data=4,context=2,tensor=2,rules=dp+experts_folded \
  --layout data=16,rules=fsdp 2>&1 | quiet

echo "== DeepSeek-V2-Lite, full size, seq 4096, compile only (8 devices: one pipeline stage's shape)"
$PY -m jaxtrain.bench step --gin_file=configs/deepseek_v2_lite.gin --compile_only \
  --layout data=2,context=2,tensor=2,rules=fsdp+experts_folded 2>&1 | quiet

echo "== Mamba-2 SSD scan on one CPU device: chunked reference vs token-by-token scan, forward+backward"
$PY benchmarks/ssd_cpu.py --lengths 512,2048,8192 2>&1 | quiet

echo "== Nemotron-3-Nano, full size, seq 8192, compile only, 16 devices (the gin's rules, fsdp, where a layout names none)"
$PY -m jaxtrain.bench step --gin_file=configs/nemotron3_nano.gin --compile_only \
  --layout data=8,tensor=2 --layout data=16,rules=fsdp \
  --layout data=8,tensor=2,rules=dp+experts_folded --layout data=16,rules=fsdp+experts_folded 2>&1 | quiet

echo "== pipeline schedules (issue 7): Llama, 8 layers, 16 simulated devices, bubble and step time"
L=""; for m in 4 8 16; do L="$L --layout pipeline=1,data=4,tensor=4,microbatches=$m"; done
for p in 2 4; do for s in gpipe interleaved2; do for m in 4 8 16; do
  L="$L --layout pipeline=$p,data=4,tensor=$((4 / p)),schedule=$s,microbatches=$m"; done; done; done
$PY -m jaxtrain.bench step --gin_file=configs/default.gin --steps 5 --gin_param=LlamaConfig.layers=8 \
  --gin_param=LlamaConfig.heads=8 --gin_param=LlamaConfig.kv_heads=4 \
  --gin_param=TrainConfig.global_batch=64 --gin_param=TrainConfig.seq_len=64 $L 2>&1 | quiet

echo "== DeepSeek-V2-Lite, full size, seq 4096, compile only: pipeline=2 (14/13) beside no pipeline (issue 7)"
$PY -m jaxtrain.bench step --gin_file=configs/deepseek_v2_lite_pipeline.gin --compile_only \
  --layout pipeline=2,data=4,tensor=2,rules=fsdp+experts_folded,split=14/13,microbatches=4 2>&1 | quiet
$PY -m jaxtrain.bench step --gin_file=configs/deepseek_v2_lite_pipeline.gin --compile_only \
  --layout pipeline=1,data=4,tensor=2,rules=fsdp+experts_folded,microbatches=4 2>&1 | quiet
$PY -m jaxtrain.bench step --gin_file=configs/deepseek_v2_lite_pipeline.gin --compile_only \
  --layout pipeline=1,data=8,tensor=2,rules=fsdp+experts_folded,microbatches=2 2>&1 | quiet
