"""LoRA against full fine-tuning: per-device memory of the compiled train step, compile only.

    python benchmarks/lora_memory.py [--layouts fsdp,reference] [--rank 16] [--json out.jsonl]

DeepSeek-V2-Lite on 16 simulated CPU devices, for each layout the full fine-tuning step and the
LoRA step (rank 16 on MLA's projections, the dense and shared MLPs and every routed expert): the
parameters, the optimizer state and XLA's argument and temp memory per device, and the LoRA
step's share of each. The layouts:

    fsdp        data=16, every weight split over all devices (rules fsdp)
    reference   the reference 16-GPU layout: pipeline 2 (layers 14/13), data 2, context 2,
                tensor 2, the routed experts folded over data x context (expert parallel 4,
                tensor their expert-data axis), 4 microbatches
    expert4axis data 2, context 2, expert 2, tensor 2 with the experts' hidden dimension over tensor
                (rules fsdp+expert_tp), no pipeline

With the base frozen, a LoRA step keeps no gradient and no Adam moment for it: the optimizer
state is the adapters' alone and the temp loses the base's gradient buffers. Sets its own
simulated device count: run it as a script.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

LAYOUTS = {
    "fsdp": "data=16,rules=fsdp",
    "reference": "pipeline=2,data=2,context=2,tensor=2,rules=fsdp+experts_folded,split=14/13,microbatches=4",
    "expert4axis": "data=2,context=2,expert=2,tensor=2,rules=fsdp+expert_tp",
}
TARGETS = ("q", "kv_a", "kv_b", "o", "gate", "up", "down", "shared_gate", "shared_up", "shared_down",
           "experts_gate_up", "experts_down")
DEVICES = 16


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    names = [n for n in args.layouts.split(",") if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layout(s) {unknown}; choose from {', '.join(LAYOUTS)}")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from jaxtrain.cli.launch import simulate_cpu_devices

    simulate_cpu_devices(DEVICES)  # before jax starts
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"  # compile only: memory, not speed
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import dataclasses

    import gin
    import jax

    from jaxtrain.planner.layout_bench import bench_layout
    from jaxtrain.training.config import load_experiment, parse_gin
    from jaxtrain.training.parallel_plan import ParallelPlan
    from jaxtrain.models.lora import LoraConfig, with_lora

    gin.clear_config()
    parse_gin(["configs/deepseek_v2_lite.gin"], ["TrainConfig.global_batch=16"])
    full = load_experiment()
    gin.clear_config()
    lora = dataclasses.replace(full, model=with_lora(full.model, LoraConfig(rank=args.rank, alpha=2.0 * args.rank,
                                                                            targets=TARGETS)))
    print(f"# DeepSeek-V2-Lite, batch {full.train.global_batch} x {full.train.seq_len}, {jax.device_count()} "
          f"{jax.devices()[0].device_kind} devices, LoRA rank {args.rank} on {', '.join(TARGETS)}", flush=True)
    print("| layout | run | params / device | optimizer state / device | arguments / device | temp / device "
          "| arguments + temp |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name in names:
        spec = LAYOUTS[name]
        results = {}
        for run, exp in (("full fine-tuning", full), (f"LoRA rank {args.rank}", lora)):
            plan = ParallelPlan.from_experiment(exp).with_spec(spec)
            r = bench_layout(exp, plan, steps=0, compile_only=True, devices=jax.devices()[:DEVICES])
            r["total_gb"] = r["argument_gb"] + r["temp_gb"]
            results[run] = r
            print(f"| `{spec}` | {run} | {r['params_gb']:.2f} GiB | {r['opt_state_gb']:.3f} GiB | "
                  f"{r['argument_gb']:.2f} GiB | {r['temp_gb']:.2f} GiB | {r['total_gb']:.2f} GiB |", flush=True)
        (_, f), (_, l) = results.items()
        print(f"| `{spec}` | LoRA / full | {l['params_gb'] / f['params_gb']:.3f} | "
              f"{l['opt_state_gb'] / f['opt_state_gb']:.4f} | {l['argument_gb'] / f['argument_gb']:.3f} | "
              f"{l['temp_gb'] / f['temp_gb']:.3f} | {l['total_gb'] / f['total_gb']:.3f} |", flush=True)
        if args.json:
            with open(args.json, "a") as out:
                for run, r in results.items():
                    out.write(json.dumps({"layout": spec, "run": run, "rank": args.rank, "devices": DEVICES,
                                          **{k: r[k] for k in ("params_gb", "opt_state_gb", "argument_gb",
                                                                "temp_gb", "total_gb", "compile_s")}}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
