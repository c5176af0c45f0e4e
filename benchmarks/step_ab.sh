#!/usr/bin/env bash
# Step time of a base commit (d43f5dd) against this checkout: tiny DeepSeek (tiny_deepseek_shape.sh),
# FSDP-16 and the 4-axis layout (this checkout also with kv=allgather and kv=latent), alternating run by run, ROUNDS times; one process per run, each under the shared timing lock.
# Prints per run: tokens/s and wall s/step (bench: median of the timed steps), this process's CPU
# s/step (benchmarks/step_cpu_time.py; the figure least moved by other load), the last loss.
#   ROUNDS=2 STEPS=5 BASE=/tmp/base26 KV="ring allgather latent" benchmarks/step_ab.sh
# BASE is made (git worktree of d43f5dd) when missing and removed at the end if this script made it.
set -u
HEAD_DIR=${HEAD_DIR:-$(cd "$(dirname "$0")/.." && pwd)}  # "head": this checkout, or HEAD_DIR=another
PY=${PYTHON:-$HEAD_DIR/.venv/bin/python}
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-5}
BASE=${BASE:-/tmp/base26}
LOCK=${LOCK:-/tmp/jaxtrain_heavy.lock}
OUT=${OUT:-$(mktemp -d /tmp/issue26_ab.XXXX)}
mkdir -p "$OUT"
made_base=0
if [ ! -d "$BASE" ]; then git -C "$HEAD_DIR" worktree add "$BASE" d43f5dd >/dev/null && made_base=1; fi

source "$(dirname "$0")/tiny_deepseek_shape.sh"  # FLAGS, FSDP, AXES4
# name | checkout | layout
KV=${KV:-"ring allgather latent"}  # this checkout's 4-axis context exchanges (ring: the default)
RUNS=("base|$BASE|$FSDP" "head|$HEAD_DIR|$FSDP" "base|$BASE|$AXES4")
for kv in $KV; do RUNS+=("head|$HEAD_DIR|$AXES4$([ "$kv" = ring ] || echo ",kv=$kv")"); done

for round in $(seq 1 "$ROUNDS"); do
  for run in "${RUNS[@]}"; do
    IFS='|' read -r name dir layout <<<"$run"
    tag="r${round}_${name}_$(echo "$layout" | sed 's/[,=+]/_/g')"
    echo "== round $round: $name $layout ($(date -u +%H:%M:%S), load $(cut -d' ' -f1 /proc/loadavg))" >&2
    (cd "$dir" && flock "$LOCK" "$PY" "$HEAD_DIR/benchmarks/step_cpu_time.py" step "${FLAGS[@]}" --layout "$layout" \
       --json "$OUT/$tag.bench.json") >"$OUT/$tag.log" 2>&1
    tail -n 1 "$OUT/$tag.log" >"$OUT/$tag.cpu.json"
    echo "$round|$name|$layout|$(cut -d' ' -f1 /proc/loadavg)|$tag" >>"$OUT/runs.txt"
  done
done

"$PY" - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
print(f"{'round':>5} {'code':<5} {'layout':<58} {'tok/s':>7} {'wall s/step':>11} {'CPU s/step':>10} {'loss':>9} {'load after':>10}")
for line in open(os.path.join(out, "runs.txt")):
    rnd, name, layout, load, tag = line.strip().split("|")
    try:
        bench = json.loads(open(os.path.join(out, f"{tag}.bench.json")).read().splitlines()[-1])
        cpu = json.loads(open(os.path.join(out, f"{tag}.cpu.json")).read())
        print(f"{rnd:>5} {name:<5} {layout:<58} {bench['tokens_per_sec']:7.0f} {bench['step_time_s']:11.2f} "
              f"{cpu['cpu_step_s']:10.2f} {cpu['loss']:9.5f} {load:>10}")
    except Exception as e:  # a failed run: say so, keep the table
        print(f"{rnd:>5} {name:<5} {layout:<58} failed ({type(e).__name__}: see {out}/{tag}.log)")
PY
echo "logs: $OUT" >&2
if [ "$made_base" = 1 ]; then git -C "$HEAD_DIR" worktree remove --force "$BASE"; fi
