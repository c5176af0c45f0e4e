"""`python -m jaxtrain.bench step --gin_file=F [--layout data=8,tensor=2,rules=fsdp ...] [--compile_only]`
`python -m jaxtrain.bench collectives --mesh data=4,tensor=4 [...]`: see jaxtrain/bench_collectives.py.

For each layout (default: the config's own), compiles the train step on abstract arrays and
prints XLA's per-device memory (arguments, outputs, temporaries) and collective counts; unless
--compile_only, also runs it and prints step time, tokens/s and MFU. A layout may also set the
pipeline: `pipeline=4,schedule=interleaved2,microbatches=8,split=7/7/7/6` (the pipeline
bubble fraction is printed with it), and the attention and context parallelism:
`context=16,attention=blockwise,kv=ring,order=balanced` (attention=materialized|blockwise|
pallas|pallas_interpret|auto, kv=ring|allgather, order=balanced|contiguous). Layouts run side by side
in one process, so their ratios are comparable even on a noisy machine. Compile-only sizing
allocates nothing, so full-size models can be sized on CPU. --json PATH appends one JSON line per
layout (the printed figures plus the model, batch and device) for scripts such as
benchmarks/gpu_check.sh.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

from jaxtrain import bench_collectives
from jaxtrain.launch import add_common_flags, fail, start

_DEVICE_FLAG = "--xla_force_host_platform_device_count"


ATTENTION_KEYS = ("materialized", "blockwise", "pallas", "pallas_interpret", "auto")
KV_KEYS = ("ring", "allgather")
ORDER_KEYS = ("balanced", "contiguous")


def parse_layout(spec: str) -> tuple[dict, str | None, dict]:
    """(mesh axis sizes, rule table or None, other settings: microbatches, schedule, split,
    attention, kv, order)."""
    mesh, rules, other = {}, None, {}
    for part in filter(None, spec.split(",")):
        key, _, value = part.partition("=")
        if key == "rules":
            rules = value
        elif (key, value) in [("attention", v) for v in ATTENTION_KEYS] + [("kv", v) for v in KV_KEYS] + \
                [("order", v) for v in ORDER_KEYS]:
            other[key] = value
        elif key in ("pipeline", "data", "context", "expert", "tensor", "microbatches"):
            (mesh if key != "microbatches" else other)[key] = int(value)
        elif key == "schedule" and (value == "gpipe" or value.startswith("interleaved")):
            other[key] = value
        elif key == "split":
            other[key] = tuple(int(n) for n in value.split("/"))
        else:
            raise ValueError(f"layout {spec!r}: unknown key or value {part!r} (mesh axes, rules, microbatches, "
                             f"schedule=gpipe|interleavedV, split=a/b/..., attention={'|'.join(ATTENTION_KEYS)}, "
                             f"kv={'|'.join(KV_KEYS)}, order={'|'.join(ORDER_KEYS)})")
    return mesh, rules, other


def apply_layout(base, mesh_sizes: dict, rules: str | None, other: dict):
    """The experiment `base` with a layout's mesh, rules, microbatches and pipeline settings."""
    import dataclasses

    from jaxtrain.pipeline_config import PipelineConfig
    from meshes.context_layout import AllGatherKV, Contiguous, LoadBalanced, RingKV
    from meshes.pipeline_schedules import GPipe, Interleaved

    full = {a: 1 for a in ("pipeline", "data", "context", "expert", "tensor")} if mesh_sizes else {}
    train = dataclasses.replace(base.train, rules=rules or base.train.rules,
                                microbatches=other.get("microbatches", base.train.microbatches))
    pipeline = base.pipeline or PipelineConfig()
    if "schedule" in other:
        v = other["schedule"][len("interleaved"):]
        pipeline = dataclasses.replace(pipeline, schedule=GPipe() if other["schedule"] == "gpipe" else
                                       Interleaved(int(v) if v else 2))
    if "split" in other:
        pipeline = dataclasses.replace(pipeline, stages_layers=other["split"])
    model = base.model
    if "attention" in other:
        model = dataclasses.replace(model, attention=_attention(other["attention"]))
    cp = train.context_parallel
    if "kv" in other:
        cp = dataclasses.replace(cp, kv_exchange=RingKV() if other["kv"] == "ring" else AllGatherKV())
    if "order" in other:
        cp = dataclasses.replace(cp, layout=LoadBalanced() if other["order"] == "balanced" else Contiguous())
    return dataclasses.replace(base, model=model, mesh=dataclasses.replace(base.mesh, **{**full, **mesh_sizes}),
                               train=dataclasses.replace(train, context_parallel=cp), pipeline=pipeline)


def _attention(name: str):
    from models.layers import attention_impl as impl
    return {"materialized": impl.MaterializedAttention(), "blockwise": impl.BlockwiseAttention(),
            "pallas": impl.PallasAttention(), "pallas_interpret": impl.PallasAttention(interpret=True),
            "auto": impl.AutoAttention()}[name]


def bench_layout(exp, *, steps: int, compile_only: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxtrain.flops import peak_flops
    from jaxtrain.hlo_stats import collective_stats, executed_collective_stats
    from jaxtrain.optim import make_optimizer
    from jaxtrain.train_setup import build_train_setup
    from jaxtrain.trainer import check_layout
    from meshes.mesh import build_mesh
    from meshes.rules import get_rule_set

    t = exp.train
    mesh = build_mesh(exp.mesh)
    check_layout(exp, mesh)
    rules = get_rule_set(t.rules)
    tx, schedule = make_optimizer(exp.optimizer, t.steps)
    setup = build_train_setup(exp.model, t, tx, schedule, mesh, rules, exp.pipeline)
    abstract, bsh, step = setup.state.abstract, setup.batch_sharding, setup.train_step
    dtypes = {"loss_mask": jnp.float32}
    abstract_batch = {k: jax.ShapeDtypeStruct((t.global_batch, t.seq_len), dtypes.get(k, jnp.int32), sharding=s)
                      for k, s in bsh.items()}
    t0 = time.perf_counter()
    compiled = step.lower(abstract, abstract_batch).compile()
    out = {"compile_s": time.perf_counter() - t0}
    mem = compiled.memory_analysis()
    if mem is not None:
        for name in ("argument", "output", "temp", "generated_code"):
            out[f"{name}_gb"] = getattr(mem, f"{name}_size_in_bytes", 0) / 2**30
    hlo = compiled.as_text()
    out["collectives"] = collective_stats(hlo)  # each instruction once
    out["executed"] = executed_collective_stats(hlo)  # each run counted: loop bodies x trips
    if hasattr(setup.gradients, "bubble"):
        out["bubble"] = setup.gradients.bubble
    if compile_only:
        return out
    state = setup.state.init(t.seed)
    rng = np.random.default_rng(0)
    host = {"inputs": rng.integers(0, exp.model.vocab_size, (t.global_batch, t.seq_len), dtype=np.int32),
            "segment_ids": np.ones((t.global_batch, t.seq_len), np.int32),
            "positions": np.broadcast_to(np.arange(t.seq_len, dtype=np.int32), (t.global_batch, t.seq_len)),
            "loss_mask": np.ones((t.global_batch, t.seq_len), np.float32)}
    host["targets"] = np.roll(host["inputs"], -1, axis=1)
    batch = {k: jax.device_put(v, bsh[k]) for k, v in host.items()}
    times = []
    for i in range(steps + 2):  # two warm-up steps
        t1 = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        if i >= 2:
            times.append(time.perf_counter() - t1)
    step_time = statistics.median(times)
    tps = t.global_batch * t.seq_len / step_time
    peak = peak_flops(jax.devices()[0].device_kind, t.peak_flops_per_device)
    out.update(step_time_s=step_time, tokens_per_sec=tps,
               mfu=exp.model.flops_per_token(t.seq_len) * tps / (peak * mesh.size) if peak else None)
    return out


def format_row(name: str, r: dict) -> str:
    coll = r.get("executed", {})
    coll_text = " ".join(f"{op}:{v['count']}/{v['bytes'] / 2**20:.1f}MiB" for op, v in coll.items() if v["count"])
    total = sum(v["bytes"] for v in coll.values())
    fields = [f"{name:<34}"]
    if "step_time_s" in r:
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
        fields += [f"step {1e3 * r['step_time_s']:8.1f} ms", f"{r['tokens_per_sec']:9.0f} tok/s", f"MFU {mfu}"]
    if "bubble" in r:
        fields.append(f"bubble {r['bubble']:.3f}")
    fields += [f"args {r.get('argument_gb', 0):.3f} GB", f"out {r.get('output_gb', 0):.3f} GB",
               f"temp {r.get('temp_gb', 0):.3f} GB", f"compile {r['compile_s']:.1f}s"]
    return " | ".join(fields) + (f"\n{'':<34}   collectives per step {total / 2**30:.2f} GiB: {coll_text}"
                                 if coll_text else "")


def json_record(spec: str, exp, r: dict | None, error: str | None = None) -> dict:
    """One layout's result for --json: the figures without the per-op collective tables."""
    import jax

    model, t = exp.model, exp.train
    record = {"layout": spec, "model": type(model).__name__, "dtype": getattr(model, "dtype", None),
              "remat": getattr(model, "remat", None), "global_batch": t.global_batch, "seq_len": t.seq_len,
              "microbatches": t.microbatches, "device_kind": jax.devices()[0].device_kind,
              "devices": jax.device_count(), "flops_per_token": model.flops_per_token(t.seq_len)}
    for name, kwargs in (("params", {}), ("active_params", {"active_only": True})):
        try:
            record[name] = model.param_count(**kwargs)
        except (AttributeError, TypeError):
            pass
    if error is not None:
        record["error"] = error
    else:
        record.update({k: v for k, v in r.items() if k not in ("collectives", "executed")})
        record["collective_bytes"] = sum(v["bytes"] for v in r.get("executed", {}).values())
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
    args = parser.parse_args(argv)
    if args.what == "collectives":
        return _collectives(args)
    try:
        layouts = [(spec, *parse_layout(spec)) for spec in args.layout]
    except ValueError as e:
        fail(str(e))
    if layouts and _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
        needed = max(math.prod(m.values()) for _, m, _, _ in layouts)
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}={needed}".strip()
    start(args)

    import jax

    from jaxtrain.config import load_experiment

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
    for spec, mesh_sizes, rules, other in layouts or [("config", {}, None, {})]:
        exp = base
        try:
            exp = apply_layout(base, mesh_sizes, rules, other)
            result = bench_layout(exp, steps=args.steps, compile_only=args.compile_only)
            print(format_row(spec, result), flush=True)
            record(spec, exp, result)
        except ValueError as e:
            print(f"{spec:<34} | error: {e}", flush=True)
            record(spec, exp, None, error=str(e))
        except Exception as e:  # e.g. out of memory: the next layout still runs, the exit code says it
            if not args.json:
                raise
            import traceback
            traceback.print_exc()
            print(f"{spec:<34} | failed: {type(e).__name__}", flush=True)
            record(spec, exp, None, error=f"{type(e).__name__}: {str(e)[:500]}")
            crashed = True
    return 1 if crashed else 0


def _collectives(args) -> int:
    try:
        mesh_sizes, _, _ = bench_collectives.check_args(args)
    except ValueError as e:
        fail(str(e))
    needed = math.prod(mesh_sizes.values()) if mesh_sizes else 0
    if needed > 1 and _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
        per_process = max(needed // max(args.num_processes or 1, 1), 1)
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}={per_process}".strip()
    start(args)
    return bench_collectives.main(args, fail)


if __name__ == "__main__":
    sys.exit(main())
