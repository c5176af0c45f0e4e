"""The memory headline: per-component parallelism against pure FSDP, per device, compile only.

    python benchmarks/memory_headline.py [--cases v2_lite,v2_236b] [--json out.jsonl]

For each MoE model and layout: XLA's argument (state) and temp (activations and transients)
memory per device on simulated CPU devices, the collective bytes per step the compiled program
moves, and the planner's prediction for the same layout on H100s (peak per device on a GPU,
whether it fits 80 GB, step time, tokens per second per device, MFU). The layouts:

    pure FSDP         every weight, routed experts included, split over all devices and
                      gathered per layer for compute (expert=1: no expert parallelism)
    per-component     attention and dense MLPs FSDP over data (x tensor parallel), routed experts
                      folded over the data axis (expert parallel, each device keeps its experts
                      and receives the tokens routed to them), tensor as their expert-data axis
    capacity 1.25     the same with a capacity factor: fixed [experts, capacity] buffers
                      (meshes/expert_capacity.py) instead of dropless receive buffers sized
                      for every peer's slots
    host optimizer    Adam's moments in pinned host memory (`+opt_host`)

XLA:CPU's temp memory of a MoE step overstates a GPU's (the CPU grouped matmul is a loop over
tiles with float32 transposes, its expert exchange is a padded all-to-all); the planner's
column is the GPU model. Sets its own simulated device count: run it as a script, not
imported after jax has started.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

CAPACITY = "RouterConfig.capacity_factor=1.25"
CASES = {
    "v2_lite": ("DeepSeek-V2-Lite (15.7B, 2.4B active)", ["configs/deepseek_v2_lite.gin"],
                ["TrainConfig.global_batch=16"], 16, [
                    ("pure FSDP", "data=16,rules=fsdp", []),
                    ("per-component: experts EP 8 over data, dense FSDP x TP 2",
                     "data=8,tensor=2,rules=fsdp+experts_folded", []),
                    ("per-component, capacity 1.25", "data=8,tensor=2,rules=fsdp+experts_folded", [CAPACITY]),
                    ("per-component, capacity 1.25, host optimizer",
                     "data=8,tensor=2,rules=fsdp+experts_folded+opt_host", [CAPACITY]),
                ]),
    "v2_236b": ("DeepSeek-V2 (236B, 21B active)", ["configs/deepseek_v2.gin"], [], 64, [
        ("pure FSDP", "data=64,rules=fsdp", []),
        ("per-component: experts EP 32 over data, dense FSDP x TP 2", "data=32,tensor=2,rules=fsdp+experts_folded", []),
        ("per-component, capacity 1.25", "data=32,tensor=2,rules=fsdp+experts_folded", [CAPACITY]),
        ("per-component, capacity 1.25, host optimizer", "data=32,tensor=2,rules=fsdp+experts_folded+opt_host",
         [CAPACITY]),
    ]),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    devices = max(CASES[c][3] for c in names)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
                               " --xla_backend_optimization_level=0").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    import gin
    import jax

    from jaxtrain.planner.layout_bench import bench_layout
    from jaxtrain.planner.cluster import Cluster
    from jaxtrain.planner.links import LinkTable
    from jaxtrain.planner.planner import Planner, Workload
    from jaxtrain.training.config import load_experiment, parse_gin
    from jaxtrain.training.parallel_plan import ParallelPlan

    gib = 2 ** 30
    print("| model | layout | state / device | temp / device (XLA:CPU) | collectives / step (XLA:CPU) | "
          "planner on H100: peak / device | fits 80 GB | collectives / step | step | tokens/s/device | MFU |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for name in names:
        title, files, bindings, n, layouts = CASES[name]
        group = Cluster.from_args(cluster=None, device="H100", devices=n).groups[0]
        for label, spec, extra in layouts:
            gin.clear_config()
            parse_gin(files, bindings + extra)
            exp = load_experiment()
            gin.clear_config()
            t = exp.train
            planner = Planner(Workload(exp.model, t.global_batch, t.seq_len, exp.loss.loss_chunk, exp.optimizer), group,
                              LinkTable(group.spec.intra_node_gbps, group.spec.inter_node_gbps))
            plan = ParallelPlan.from_experiment(exp).with_spec(spec)
            result = bench_layout(exp, plan, steps=0, compile_only=True, devices=jax.devices()[:n])
            e = planner.evaluate(plan)  # remat: the model's own
            collective = sum(v["bytes"] for v in result["executed"].values())
            host = f" (+{e.memory.optimizer_host / gib:.1f} host)" if e.memory.optimizer_host else ""
            planned_bytes = sum(e.time.bytes_by_kind.values())
            print(f"| {title} | {label} (`{spec}`) | {result['argument_gb']:.2f} GiB{host} | {result['temp_gb']:.2f} GiB | "
                  f"{collective / gib:.0f} GiB | {e.memory.peak / gib:.1f} GiB | {'yes' if e.fits else 'no'} | "
                  f"{planned_bytes / gib:.0f} GiB | {e.time.total:.2f} s | {e.tokens_per_sec_per_device:.0f} | "
                  f"{100 * e.mfu:.0f}% |", flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps({"model": name, "layout": spec, "bindings": extra, "argument_gib": result["argument_gb"],
                                        "temp_gib": result["temp_gb"], "collective_gib": collective / gib,
                                        "compile_s": result["compile_s"], "planned_peak_gib": e.memory.peak / gib,
                                        "planned_host_gib": e.memory.optimizer_host / gib, "fits": e.fits,
                                        "step_s": e.time.total, "tokens_per_sec_per_device": e.tokens_per_sec_per_device,
                                        "mfu": e.mfu, "collectives_s": e.time.by_kind,
                                        "planned_collective_bytes": e.time.bytes_by_kind}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
