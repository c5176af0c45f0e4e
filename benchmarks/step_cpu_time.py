"""Runs `python -m jaxtrain.bench step ARGS` of the checkout in the current directory (any
commit, older ones too) and adds what the bench does not print: this process's CPU
seconds per timed step (the figure least moved by other load on a shared machine) and the
last step's loss. One JSON line on stdout after the bench's own output:
{"cpu_step_s": median over the timed steps, "wall_step_s": ..., "loss": ...}.

    cd CHECKOUT && PYTHON benchmarks/step_cpu_time.py step --gin_file=... --layout L --steps N

Each step ends at the bench's `jax.block_until_ready(metrics)` (both an older checkout's and this
one's timing loops), so the CPU between two of them is one step's (two warm-up steps skipped).
HLO_OUT=PATH also writes the compiled step's per-device HLO text there (for
benchmarks/hlo_dot_flops.py; add --compile_only to stop after the compile).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())  # the checkout's jaxtrain, not the installed one
DEVICES = "--xla_force_host_platform_device_count=16"
if DEVICES.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {DEVICES}".strip()

import jax  # noqa: E402

marks: list[tuple[float, float]] = []  # (wall, process CPU) at each step's end
last: dict = {}
_wait = jax.block_until_ready


def _marked(x):
    out = _wait(x)
    marks.append((time.perf_counter(), time.process_time()))
    if isinstance(x, dict) and "loss" in x:
        last["loss"] = float(x["loss"])
    return out


jax.block_until_ready = _marked
if os.environ.get("HLO_OUT"):
    import jaxtrain.observe.hlo_stats as hlo_stats  # the bench imports it inside its function: patched in time

    _count = hlo_stats.executed_collective_stats

    def _saved(hlo: str):
        with open(os.environ["HLO_OUT"], "w") as f:
            f.write(hlo)
        return _count(hlo)

    hlo_stats.executed_collective_stats = _saved
from jaxtrain.cli.bench import main  # noqa: E402

sys.argv = ["jaxtrain.bench", *sys.argv[1:]]
rc = main()
timed = list(zip(marks[1:], marks[2:]))  # steps 2.. (0 and 1 warm up)
if timed:
    print(json.dumps({"cpu_step_s": statistics.median(b[1] - a[1] for a, b in timed),
                      "wall_step_s": statistics.median(b[0] - a[0] for a, b in timed),
                      "steps": len(timed), "loss": last.get("loss")}), flush=True)
sys.exit(rc)
