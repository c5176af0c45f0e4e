"""`python -m jaxtrain.bench step --gin_file=F [--layout data=8,tensor=2,rules=fsdp ...] [--compile_only]`
`python -m jaxtrain.bench collectives --mesh data=4,tensor=4 [...]`: see jaxtrain/cli/bench_collectives.py.

Each --layout is a ParallelPlan spec string (jaxtrain/training/parallel_plan.py; every key in
jaxtrain/training/plan_keys.py) applied over the config's own plan. For each layout (default: the config's own), compiles the train step on abstract arrays and
prints XLA's per-device memory (arguments, outputs, temporaries) and collective counts; unless
--compile_only, also runs it and prints step time, tokens/s and MFU. A layout may also set the
pipeline: `pipeline=4,schedule=interleaved2,microbatches=8,split=7/7/7/6` (the pipeline
bubble fraction is printed with it), and the attention and context parallelism:
`context=16,attention=blockwise,kv=ring,order=balanced` (attention=materialized|blockwise|
pallas|pallas_interpret|auto, kv=ring|allgather, order=balanced|contiguous). Layouts run side by side
in one process, so their ratios are comparable even on a noisy machine; each runs on the first N
devices of the process its own mesh names (`context=1` runs on one device whatever the config's mesh
is). Compile-only sizing
allocates nothing, so full-size models can be sized on CPU. --json PATH appends one JSON line per
layout (the printed figures plus the model, batch and device) for scripts such as
benchmarks/gpu_check.sh.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from jaxtrain.cli import bench_collectives
from jaxtrain.cli.launch import add_common_flags, fail, simulate_cpu_devices, start
from jaxtrain.planner.layout_bench import bench_layout
from jaxtrain.training.parallel_plan import ParallelPlan


def apply_layout(base, spec: str):
    """(experiment, ParallelPlan): `base` with a --layout spec applied over its own plan, the
    plan's model overrides (remat=, attention=) in the experiment's model."""
    import dataclasses

    plan = base.plan.with_spec(spec)
    if plan.groups != base.plan.groups:
        raise ValueError(f"layout {spec!r}: groups= is not benchmarked (one program on one mesh): bench one "
                         f"group's layout")
    plan = dataclasses.replace(plan, groups=())  # a config's device groups: one group's program is benched
    return dataclasses.replace(base, model=plan.apply_to_model(base.model)), plan


def layout_devices(plan, available=None):
    """The devices a layout's mesh runs on: the first N of this process when its axes name fewer
    than are available (`context=1` on a config whose own mesh took 8), else all (None). The
    simulated device count is the largest any layout or the config asks for, so smaller layouts
    take a prefix. With several processes every device of the mesh must be named, so all."""
    import jax

    available = jax.devices() if available is None else available
    needed = plan.mesh.fixed_device_count()
    if -1 in plan.mesh.sizes().values() or jax.process_count() > 1 or needed >= len(available):
        return None  # a filled axis takes every device; too few devices is build_mesh's error to name
    return list(available[:needed])


def format_row(name: str, r: dict) -> str:
    coll = r.get("executed", {})
    coll_text = " ".join(f"{op}:{_executed_text(v)}" for op, v in coll.items() if v["count"])
    total = sum(v["bytes"] for v in coll.values())
    least = sum(v.get("min_bytes", v["bytes"]) for v in coll.values())
    fields = [f"{name:<34}"]
    if "step_time_s" in r:
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
        fields += [f"step {1e3 * r['step_time_s']:8.1f} ms", f"{r['tokens_per_sec']:9.0f} tok/s", f"MFU {mfu}"]
    if "bubble" in r:
        fields.append(f"bubble {r['bubble']:.3f}")
    fields += [f"args {r.get('argument_gb', 0):.3f} GB (params {r.get('params_gb', 0):.3f}, "
               f"optimizer {r.get('opt_state_gb', 0):.3f})", f"out {r.get('output_gb', 0):.3f} GB",
               f"temp {r.get('temp_gb', 0):.3f} GB", f"compile {r['compile_s']:.1f}s"]
    typed = " ".join(f"{op}:{dtype}:{v['count']}/{v['bytes'] / 2**20:.1f}MiB"
                     for (op, dtype), v in sorted(r.get("partitioned", {}).items()))
    total_text = f"{total / 2**30:.2f}" if least == total else f"{least / 2**30:.2f}..{total / 2**30:.2f}"
    return " | ".join(fields) + (f"\n{'':<34}   collectives per step {total_text} GiB: {coll_text}"
                                 if coll_text else "") + (
        f"\n{'':<34}   as partitioned (each instruction once, before XLA:CPU widens bf16): {typed}" if typed else "") + (f"\n{'':<34}   {r['sharding_audit']}" if "sharding_audit" in r else "")


def _executed_text(v: dict) -> str:
    """count/MiB of one op per step; "least..most" where a branch the data chooses (the
    non-finite guard's update) holds collectives (jaxtrain/observe/hlo_stats.py)."""
    lo_count, lo_bytes = v.get("min_count", v["count"]), v.get("min_bytes", v["bytes"])
    if (lo_count, lo_bytes) == (v["count"], v["bytes"]):
        return f"{v['count']}/{v['bytes'] / 2**20:.1f}MiB"
    return f"{lo_count}..{v['count']}/{lo_bytes / 2**20:.1f}..{v['bytes'] / 2**20:.1f}MiB"


def json_record(spec: str, exp, plan, r: dict | None, error: str | None = None) -> dict:
    """One layout's result for --json: the figures without the per-op collective tables."""
    import jax

    model, t = exp.model, exp.train
    record = {"layout": spec, "model": type(model).__name__, "dtype": getattr(model, "dtype", None),
              "remat": model.runtime().remat, "global_batch": t.global_batch, "seq_len": t.seq_len,
              "microbatches": plan.microbatches if plan else t.microbatches, "device_kind": jax.devices()[0].device_kind,
              "devices": (r or {}).get("devices", jax.device_count()),  # the layout's mesh, when it was built
              "flops_per_token": model.flops_per_token(t.seq_len)}
    record["params"], record["active_params"] = model.param_count(), model.param_count(active_only=True)
    if error is not None:
        record["error"] = error
    else:
        record.update({k: v for k, v in r.items() if k not in ("collectives", "executed", "partitioned", "sharding_audit")})
        record["collective_bytes"] = sum(v["bytes"] for v in r.get("executed", {}).values())  # the most
        record["collective_bytes_min"] = sum(v.get("min_bytes", v["bytes"]) for v in r.get("executed", {}).values())
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxtrain.bench", description=__doc__)
    parser.add_argument("what", choices=["step", "collectives"])
    add_common_flags(parser)
    bench_collectives.add_flags(parser)
    parser.add_argument("--layout", action="append", default=[],
                        help="e.g. data=8,tensor=2,rules=fsdp (repeatable; default: the config's mesh)")
    parser.add_argument("--compile_only", action="store_true")
    parser.add_argument("--steps", type=int, default=5, help="timed steps after two warm-up steps")
    parser.add_argument("--max_replicated", type=float, default=None,
                        help="fail a layout whose replicated parameter bytes exceed this fraction per device")
    args = parser.parse_args(argv)
    if args.what == "collectives":
        return _collectives(args)
    try:  # every spec readable before anything starts
        plans = [ParallelPlan().with_spec(spec) for spec in args.layout]
    except ValueError as e:
        fail(str(e))
    sized = [p.device_count() for p in plans if p.mesh.sizes() != ParallelPlan().mesh.sizes()]
    if sized:  # the largest mesh a layout names (the others: the config's own mesh sizes the devices)
        simulate_cpu_devices(max(sized))
    start(args)

    import jax

    from jaxtrain.training.config import load_experiment

    try:
        base = load_experiment()
    except ValueError as e:
        fail(str(e))
    print(f"# {jax.devices()[0].device_kind} x {jax.device_count()}, model {type(base.model).__name__}, "
          f"batch {base.train.global_batch} x {base.train.seq_len}", flush=True)

    def record(*a, **kw):  # step: --json (the collectives' flag) appends one line per layout
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(json_record(*a, **kw)) + "\n")

    crashed = False
    for spec in args.layout or [""]:
        name, exp, plan = spec or "config", base, None
        try:
            exp, plan = apply_layout(base, spec)
            result = bench_layout(exp, plan, steps=args.steps, compile_only=args.compile_only,
                                  max_replicated=args.max_replicated, devices=layout_devices(plan))
            print(format_row(name, result), flush=True)
            record(name, exp, plan, result)
        except ValueError as e:
            print(f"{name:<34} | error: {e}", flush=True)
            record(name, exp, plan, None, error=str(e))
        except Exception as e:  # e.g. out of memory: the next layout still runs, the exit code says it
            if not args.json:
                raise
            import traceback
            traceback.print_exc()
            print(f"{name:<34} | failed: {type(e).__name__}", flush=True)
            record(name, exp, plan, None, error=f"{type(e).__name__}: {str(e)[:500]}")
            crashed = True
    return 1 if crashed else 0


def _collectives(args) -> int:
    try:
        mesh_sizes, _, _ = bench_collectives.check_args(args)
    except ValueError as e:
        fail(str(e))
    simulate_cpu_devices(math.prod(mesh_sizes.values()) if mesh_sizes else 0, args.num_processes or 1)
    start(args)
    return bench_collectives.main(args, fail)


if __name__ == "__main__":
    sys.exit(main())
