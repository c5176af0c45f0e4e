"""A LoRA step against the full fine-tuning step, timed side by side (ABBA) in one process.

    python benchmarks/lora_speed.py [--layouts data=16,rules=fsdp ...] [--targets q,kv_a,...] [--steps 10] [--rounds 3]

The tiny DeepSeek-V2 (configs/deepseek_v2_tiny.gin) on 16 simulated CPU devices; for each layout
both steps are compiled, then timed in rounds of full, LoRA, LoRA, full (each a median over
`--steps` steps), so drift of a noisy machine falls on both alike. Prints each layout's median
step times and the ratio LoRA / full, and what each compiled step holds: its all-gathers,
reduce-scatters, dots and fusions. On XLA:CPU every collective is a barrier of the 16 device
threads on the machine's cores, so a tiny model's step time follows the count of collectives more
than their bytes. LoRA: rank 16 on every DeepSeek-V2 target (or `--targets`).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import sys
import time

LAYOUTS = ["data=16,rules=fsdp", "data=4,expert=4,rules=dp", "data=2,expert=4,tensor=2,rules=fsdp"]
TARGETS = ("q", "kv_a", "kv_b", "o", "gate", "up", "down", "shared_gate", "shared_up", "shared_down",
           "experts_gate_up", "experts_down")
OPS = ("all-gather", "reduce-scatter", "dot", "fusion")


def op_counts(compiled_text: str) -> str:
    """'all-gather / reduce-scatter / dot / fusion' counts of a compiled program's text."""
    found = collections.Counter(re.findall(r"= \S+ (" + "|".join(OPS) + r")\(", compiled_text))
    return " / ".join(str(found[op]) for op in OPS)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="*", default=LAYOUTS)
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated LoRA targets")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from jaxtrain.cli.launch import simulate_cpu_devices

    simulate_cpu_devices(16)  # before jax starts
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import dataclasses

    import gin
    import jax

    from jaxtrain.planner.layout_bench import random_batch
    from jaxtrain.training.config import load_experiment, parse_gin
    from jaxtrain.training.parallel_plan import ParallelPlan
    from jaxtrain.training.train_setup import build_train_setup
    from jaxtrain.models.lora import LoraConfig, with_lora

    parse_gin(["configs/deepseek_v2_tiny.gin"], [])
    full = load_experiment()
    gin.clear_config()
    lora = dataclasses.replace(full, model=with_lora(full.model, LoraConfig(rank=16, alpha=32.0,
                                                                            targets=tuple(args.targets.split(",")))))
    t = full.train
    print(f"# tiny DeepSeek-V2, batch {t.global_batch} x {t.seq_len}, {jax.device_count()} "
          f"{jax.devices()[0].device_kind} devices; ABBA rounds of {args.steps} steps; LoRA on {args.targets}")
    print(f"| layout | full step (median) | LoRA step (median) | LoRA / full | full: {' / '.join(OPS)} | LoRA: the same |")
    print("| --- | ---: | ---: | ---: | --- | --- |")
    for spec in args.layouts:
        runs, ops = {}, {}
        for name, exp in (("full", full), ("lora", lora)):
            plan = ParallelPlan.from_experiment(exp).with_spec(spec)
            setup = build_train_setup(exp.model, plan, t, exp.optimizer, jax.devices()[:plan.device_count()])
            state = setup.state.init(t.seed)
            batch = setup.device_batch(random_batch(exp))
            ops[name] = op_counts(setup.train_step.lower(state, batch).compile().as_text())
            for _ in range(2):  # compile and warm up
                state, metrics = setup.train_step(state, batch)
            jax.block_until_ready(metrics)
            runs[name] = [setup.train_step, state, batch]
        times = {"full": [], "lora": []}

        def timed(name):
            step, state, batch = runs[name]
            for _ in range(args.steps):
                start = time.perf_counter()
                state, metrics = step(state, batch)
                jax.block_until_ready(metrics)
                times[name].append(time.perf_counter() - start)
            runs[name][1] = state

        for _ in range(args.rounds):
            for name in ("full", "lora", "lora", "full"):
                timed(name)
        f, l = statistics.median(times["full"]), statistics.median(times["lora"])
        print(f"| `{spec}` | {1e3 * f:.1f} ms | {1e3 * l:.1f} ms | {l / f:.3f} | {ops['full']} | {ops['lora']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
