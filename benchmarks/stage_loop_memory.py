"""A pipeline stage's two loops side by side: run by run against one switched scan, compile only.

    python benchmarks/stage_loop_memory.py --gin_file=configs/nemotron3_nano_reference_layout.gin \
        --gin_param='NemotronHConfig.remat="full"' --rounds 2

Compiles (never runs) the train step of a pipelined experiment once per round with each loop of
models/stage_program.py (`loop="runs"`: a scan per run of one kind; `loop="switched"`: one scan
over the stage's slots with a switch on the kind; `loop="kinds"`: the same with the switch's own
VJP, `--loops runs,switched,kinds`), alternating in one process, and prints one
JSON line per compile: XLA's temp and argument memory per device, and the compile time. Only
stages whose kinds alternate differ (others scan run by run either way). Sets its own simulated
device count (16): run it as a script from the repository root.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gin_file", action="append", default=[])
    parser.add_argument("--gin_param", action="append", default=[])
    parser.add_argument("--layout", default=None, help="a layout string applied on top of the config's")
    parser.add_argument("--loops", default="runs,switched")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)
    sys.path.insert(0, os.getcwd())
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=16").strip()

    import jaxtrain.pipeline.gradients as gradients
    from jaxtrain.training.config import load_experiment, parse_gin
    from jaxtrain.training.parallel_plan import ParallelPlan
    from jaxtrain.training.train_setup import build_train_setup
    from jaxtrain.models.stage_program import StageProgram

    parse_gin(args.gin_file, args.gin_param)
    exp = load_experiment()
    plan = ParallelPlan.from_experiment(exp)
    if args.layout:
        plan = plan.with_spec(args.layout)
    for _ in range(args.rounds):
        for loop in args.loops.split(","):
            gradients.StageProgram = functools.partial(lambda *a, forced, **k: StageProgram(*a, **{**k, "loop": forced}),
                                                   forced=loop)
            setup = build_train_setup(exp.model, plan, exp.train, exp.optimizer, loss=exp.loss)
            t = exp.train
            lowered = setup.train_step.lower(setup.state.abstract, setup.abstract_batch(t.global_batch, t.seq_len))
            start = time.perf_counter()
            memory = lowered.compile().memory_analysis()
            print(json.dumps({"loop": loop, "layout": plan.label(), "compile_s": round(time.perf_counter() - start, 1),
                              "temp_gib": round(memory.temp_size_in_bytes / 2**30, 4),
                              "argument_gib": round(memory.argument_size_in_bytes / 2**30, 4)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
