"""A pipeline stage's loops timed side by side: run by run against the kinds loop, one process.

    python benchmarks/stage_loop_step.py --gin_file=configs/nemotron3_nano_reference_layout.gin --steps 4

Compiles the train step once per loop of models/stage_program.py (`--loops runs,kinds`), then runs
them alternately (one step of each per round, after one warm-up step each) on the same batch and
prints one JSON line per loop: compile seconds, median step seconds and this process's CPU seconds
per step, and the losses (the loops must agree). Sets its own simulated device count (16): run it
as a script from the repository root.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gin_file", action="append", default=[])
    parser.add_argument("--gin_param", action="append", default=[])
    parser.add_argument("--loops", default="runs,kinds")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    sys.path.insert(0, os.getcwd())
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=16").strip()

    import jax

    from jaxtrain.planner.layout_bench import random_batch
    from jaxtrain.training.config import load_experiment, parse_gin
    from jaxtrain.training.parallel_plan import ParallelPlan
    from jaxtrain.training.train_setup import build_train_setup

    parse_gin(args.gin_file, args.gin_param)
    exp = load_experiment()
    plan = ParallelPlan.from_experiment(exp)
    t = exp.train
    runs = {}
    for loop in args.loops.split(","):
        setup = build_train_setup(exp.model, plan.with_spec(f"stage_loop={loop}"), t, exp.optimizer, loss=exp.loss)
        start = time.perf_counter()
        compiled = setup.train_step.lower(setup.state.abstract, setup.abstract_batch(t.global_batch, t.seq_len)).compile()
        runs[loop] = {"setup": setup, "step": compiled, "compile_s": time.perf_counter() - start,
                      "wall": [], "cpu": [], "loss": []}
    host = random_batch(exp)
    for r in runs.values():
        r["state"], r["batch"] = r["setup"].state.init(t.seed), r["setup"].device_batch(host)
    for i in range(args.steps + 1):  # the first round warms up
        for r in runs.values():
            w, c = time.perf_counter(), time.process_time()
            r["state"], metrics = r["step"](r["state"], r["batch"])
            jax.block_until_ready(metrics)
            if i:
                r["wall"].append(time.perf_counter() - w)
                r["cpu"].append(time.process_time() - c)
            r["loss"].append(float(metrics["loss"]))
    for loop, r in runs.items():
        print(json.dumps({"loop": loop, "compile_s": round(r["compile_s"], 1),
                          "step_s": round(statistics.median(r["wall"]), 3),
                          "cpu_step_s": round(statistics.median(r["cpu"]), 3),
                          "losses": [round(x, 6) for x in r["loss"]]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
