#!/usr/bin/env bash
# A/B of two checkouts on the tiny DeepSeek shape (tiny_deepseek_shape.sh): BEFORE and AFTER (e.g.
# worktrees of a commit and of it plus one change), RUNS in order ("LAYOUT:before" / "LAYOUT:after"; A4, F16, A4AG = the 4-axis with kv=allgather,
# A4CAP = the 4-axis at capacity factor 1.0),
# one process per run (benchmarks/step_cpu_time.py), each run under the timing lock:
#   BEFORE=/tmp/b AFTER=/tmp/a STEPS=3 OUT=/tmp/ab benchmarks/step_before_after.sh
set -u
OUT=${OUT:-/tmp/h3ab}; mkdir -p $OUT; : > $OUT/runs.txt
STEPS=${STEPS:-3}; HERE=$(cd "$(dirname "$0")" && pwd); source "$HERE/tiny_deepseek_shape.sh"
PY=${PYTHON:-$HERE/../.venv/bin/python}; BEFORE=${BEFORE:?a checkout}; AFTER=${AFTER:?a checkout}
RUNS=${RUNS:-"A4:before A4:after A4:after A4:before F16:before F16:after F16:after F16:before"}
i=0
for r in $RUNS; do
  i=$((i+1)); lay=${r%%:*}; code=${r##*:}
  EXTRA=(); case $lay in A4) L=$AXES4;; F16) L=$FSDP;; A4AG) L=$AXES4,kv=allgather;;
    A4CAP) L=$AXES4; EXTRA=(--gin_param=RouterConfig.capacity_factor=1.0);; esac
  tag=run${i}_${lay}_${code}
  flock /tmp/jaxtrain_heavy.lock bash -c "cd $([ $code = before ] && echo $BEFORE || echo $AFTER) && $PY $HERE/step_cpu_time.py step ${FLAGS[*]@Q} ${EXTRA[*]@Q} --layout $L --json $OUT/$tag.bench.json > $OUT/$tag.log 2>&1"
  echo "$i $lay $code $(tail -n1 $OUT/$tag.log) load $(cut -d' ' -f1 /proc/loadavg) $(date -u +%T)" | tee -a $OUT/runs.txt
done
