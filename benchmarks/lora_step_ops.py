"""What a LoRA step adds to the full fine-tuning step: the compiled program's collectives, dots
and fusions, and the median step time, for a set of adapter targets.

    python benchmarks/lora_step_ops.py [--layout data=16,rules=fsdp] [--targets q,kv_a,kv_b,o] [--steps 6]

The tiny DeepSeek-V2 (configs/deepseek_v2_tiny.gin) on 16 simulated CPU devices, LoRA rank 16;
the full step and the LoRA step built, compiled and timed in one process, full first. On XLA:CPU
every collective is a barrier of the 16 device threads on the machine's cores, so the count of
collectives, not their bytes, moves a tiny model's step time.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import statistics
import sys
import time

ALL_TARGETS = ("q", "kv_a", "kv_b", "o", "gate", "up", "down", "shared_gate", "shared_up", "shared_down",
               "experts_gate_up", "experts_down")
OPS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute", "dot", "fusion")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", default="data=16,rules=fsdp")
    parser.add_argument("--targets", default=",".join(ALL_TARGETS))
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from jaxtrain.cli.launch import simulate_cpu_devices

    simulate_cpu_devices(16)  # before jax starts
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import gin
    import jax

    from jaxtrain.models.lora import LoraConfig, with_lora
    from jaxtrain.planner.layout_bench import random_batch
    from jaxtrain.training.config import load_experiment, parse_gin
    from jaxtrain.training.parallel_plan import ParallelPlan
    from jaxtrain.training.train_setup import build_train_setup

    parse_gin(["configs/deepseek_v2_tiny.gin"], [])
    full = load_experiment()
    gin.clear_config()
    lora = dataclasses.replace(full, model=with_lora(full.model, LoraConfig(rank=16, alpha=32.0,
                                                                            targets=tuple(args.targets.split(",")))))
    print(f"# {args.layout}, LoRA rank 16 on {args.targets}")
    print("| run | " + " | ".join(OPS) + " | step (median) |")
    print("| --- |" + " ---: |" * (len(OPS) + 1))
    for name, exp in (("full", full), ("lora", lora)):
        plan = ParallelPlan.from_experiment(exp).with_spec(args.layout)
        setup = build_train_setup(exp.model, plan, exp.train, exp.optimizer, jax.devices()[:plan.device_count()])
        state, batch = setup.state.init(exp.train.seed), setup.device_batch(random_batch(exp))
        text = setup.train_step.lower(state, batch).compile().as_text()
        ops = collections.Counter(re.findall(r"= \S+ (" + "|".join(OPS) + r")\(", text))
        for _ in range(2):  # compile and warm up
            state, metrics = setup.train_step(state, batch)
        jax.block_until_ready(metrics)
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            state, metrics = setup.train_step(state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
        print(f"| {name} | " + " | ".join(str(ops[o]) for o in OPS) + f" | {1e3 * statistics.median(times):.0f} ms |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
