#!/usr/bin/env bash
# Step time of a base commit and this checkout on an idle machine, in ABBA order (drift cancels):
# tiny DeepSeek (tiny_deepseek_shape.sh), base d43f5dd and this checkout, FSDP-16 (also this checkout's
# +cast_where_used, the pre-5469cfb gathers) and the 4-axis layout; one process per run
# (benchmarks/step_cpu_time.py: tok/s, wall and CPU s/step).
#   STEPS=5 benchmarks/step_abba.sh      (~15 min on 2 cores; nothing else running)
set -u
HEAD_DIR=${HEAD_DIR:-$(cd "$(dirname "$0")/.." && pwd)}; BASE=${BASE:-/tmp/base26}
PY=${PYTHON:-$HEAD_DIR/.venv/bin/python}; OUT=${OUT:-$(mktemp -d /tmp/issue26_abba.XXXX)}
mkdir -p $OUT; : > $OUT/runs.txt
made_base=0
[ -d $BASE ] || { git -C $HEAD_DIR worktree add $BASE d43f5dd >/dev/null && made_base=1; }
STEPS=${STEPS:-5}
source "$(dirname "$0")/tiny_deepseek_shape.sh"  # FLAGS, FSDP, AXES4
F=$FSDP; A=$AXES4
R=("base|$BASE|$F" "head|$HEAD_DIR|$F" "head|$HEAD_DIR|$F+cast_where_used" "base|$BASE|$A" "head|$HEAD_DIR|$A")
ORDER=(0 1 2 3 4 4 3 2 1 0)
i=0
for k in "${ORDER[@]}"; do
  i=$((i+1)); IFS='|' read -r name dir layout <<<"${R[$k]}"; tag="run${i}_${name}_$(echo $layout | sed 's/[,=+]/_/g')"
  echo "== $i $name $layout $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)" >&2
  (cd $dir && $PY $HEAD_DIR/benchmarks/step_cpu_time.py step "${FLAGS[@]}" --layout "$layout" --json $OUT/$tag.bench.json) > $OUT/$tag.log 2>&1
  tail -n 1 $OUT/$tag.log > $OUT/$tag.cpu.json
  echo "$i|$name|$layout|$(cut -d' ' -f1 /proc/loadavg)|$tag" >> $OUT/runs.txt
done
$PY - $OUT <<'PY'
import json, os, sys
out = sys.argv[1]
for line in open(os.path.join(out, "runs.txt")):
    i, name, layout, load, tag = line.strip().split("|")
    try:
        b = json.loads(open(os.path.join(out, f"{tag}.bench.json")).read().splitlines()[-1]); c = json.loads(open(os.path.join(out, f"{tag}.cpu.json")).read())
        print(f"{i:>3} {name:<5} {layout:<52} {b['tokens_per_sec']:7.0f} tok/s {b['step_time_s']:7.2f} s/step  CPU {c['cpu_step_s']:6.2f} s/step  loss {c['loss']:.5f} load {load}")
    except Exception as e:
        print(i, name, layout, "failed", type(e).__name__, tag)
PY
if [ "$made_base" = 1 ]; then git -C "$HEAD_DIR" worktree remove --force "$BASE"; fi
