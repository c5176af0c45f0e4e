"""Collective microbenchmarks over the axes of the named mesh: what each link class delivers.

    python -m jaxtrain.bench collectives --mesh data=4,tensor=4 [--axes data,tensor,data+tensor]
        [--sizes 1k,64k,1m,16m] [--iters 10] [--repeats 5] [--json out.jsonl] [--png out.png]

For each axis (or axis group, `a+b`), each collective and each message size, one jitted
shard_map runs the collective `iters` times back to back (a loop on device, so the host's
dispatch is not timed); the best of `repeats` runs, divided by `iters`, is the time. The
bandwidths follow the nccl-tests conventions, so figures compare with theirs:

  size     all_reduce, all_to_all, collective_permute: the buffer each device holds;
           all_gather: the gathered output; reduce_scatter: the input (n x the output)
  algbw    size / time
  busbw    algbw x factor, the bytes each device's link carries per byte of size:
           all_reduce 2(n-1)/n, all_gather, reduce_scatter and all_to_all (n-1)/n, permute 1

The rows are also written as JSON lines (`--json`), the form the layout planner reads as a
cluster's measured link figures, and plotted (`--png`: bus bandwidth against size, one line
per axis and collective). Runs on simulated CPU devices, several processes (`--num_processes`
etc.) and GPUs alike; only process 0 prints and writes.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Callable, Sequence

import numpy as np

_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30}


@dataclasses.dataclass(frozen=True)
class Collective:
    """`run(x, axes, n)` is one collective on a device's block `x` (per-device elements `in_elems`
    of a message of `size` bytes); `carry(x, out)` turns its output into the next iteration's
    input with O(input) work at most, using a value from another device so that XLA cannot
    drop the collective."""
    name: str
    run: Callable
    carry: Callable
    input_fraction: Callable[[int], float]  # per-device input bytes / size, for n devices
    bus_factor: Callable[[int], float]


def _ring(n: int):
    return [(i, (i + 1) % n) for i in range(n)]


def _collectives():
    import jax
    from jax import lax

    same = lambda x, out: out
    return {c.name: c for c in (
        Collective("all_reduce", lambda x, axes, n: lax.psum(x, axes), same,
                   lambda n: 1.0, lambda n: 2 * (n - 1) / n),
        Collective("all_gather", lambda x, axes, n: lax.all_gather(x, axes, tiled=True),
                   lambda x, out: x + out[-x.shape[0]:], lambda n: 1.0 / n, lambda n: (n - 1) / n),
        Collective("reduce_scatter", lambda x, axes, n: lax.psum_scatter(x, axes, tiled=True),
                   lambda x, out: jax.lax.dynamic_update_slice_in_dim(x, out, 0, 0), lambda n: 1.0,
                   lambda n: (n - 1) / n),
        Collective("all_to_all", lambda x, axes, n: lax.all_to_all(x, axes, 0, 0, tiled=True), same,
                   lambda n: 1.0, lambda n: (n - 1) / n),
        Collective("collective_permute", lambda x, axes, n: lax.ppermute(x, axes, _ring(n)), same,
                   lambda n: 1.0, lambda n: 1.0),
    )}


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute")


def parse_size(text: str) -> int:
    text = text.strip().lower()
    number, unit = (text[:-1], text[-1]) if text[-1:] in _UNITS and not text[-1:].isdigit() else (text, "")
    try:
        value = int(float(number) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"message size {text!r}: expected a number with an optional k, m or g suffix") from None
    if value <= 0:
        raise ValueError(f"message size {text!r} must be positive")
    return value


def parse_axes(spec: str, mesh_shape: dict) -> list[tuple[str, ...]]:
    """'data,tensor,data+tensor' -> [("data",), ("tensor",), ("data", "tensor")]; default: every
    axis of size > 1 and every pair of them."""
    if not spec:
        big = [a for a, n in mesh_shape.items() if n > 1]
        return [(a,) for a in big] + [(a, b) for i, a in enumerate(big) for b in big[i + 1:]]
    groups = []
    for part in filter(None, spec.split(",")):
        group = tuple(part.split("+"))
        unknown = [a for a in group if a not in mesh_shape]
        if unknown:
            raise ValueError(f"--axes {spec!r}: unknown mesh axis {unknown[0]!r} (axes: {', '.join(mesh_shape)})")
        if math.prod(mesh_shape[a] for a in group) < 2:
            raise ValueError(f"--axes {spec!r}: {part} has size 1 in mesh {mesh_shape}: nothing to communicate")
        groups.append(group)
    return groups


def _per_device_elements(size: int, fraction: float, n: int, itemsize: int) -> int:
    """Elements of a device's input block, a multiple of n (all_to_all and reduce_scatter split it)."""
    elems = max(int(size * fraction) // itemsize, n)
    return elems - elems % n


def build(mesh, op: Collective, axes: tuple[str, ...], elems: int, iters: int, dtype):
    """(jitted function, its input): `iters` collectives over `axes` on each device's `elems` elements."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    n = math.prod(mesh.shape[a] for a in axes)
    axes_name = axes if len(axes) > 1 else axes[0]
    spec = PartitionSpec(tuple(mesh.axis_names))  # every device its own block of the flat input

    def per_device(x):
        body = lambda _, x: op.carry(x, op.run(x, axes_name, n))
        return jax.lax.fori_loop(0, iters, body, x)

    fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    x = jax.device_put(jnp.ones((elems * mesh.size,), dtype), NamedSharding(mesh, spec))
    return fn, x


def measure(mesh, op: Collective, axes, size: int, *, iters: int, repeats: int, dtype=np.float32) -> dict:
    import jax

    n = math.prod(mesh.shape[a] for a in axes)
    itemsize = np.dtype(dtype).itemsize
    elems = _per_device_elements(size, op.input_fraction(n), n, itemsize)
    size = int(round(elems * itemsize / op.input_fraction(n)))  # the size actually moved
    fn, x = build(mesh, op, axes, elems, iters, dtype)
    jax.block_until_ready(fn(x))  # compile and warm up
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        best = min(best, time.perf_counter() - t0)
    return {"op": op.name, "axes": "+".join(axes), "devices": n, "bytes": size,
            **bandwidths(op, n, size, best / iters)}


def bandwidths(op: Collective, n: int, size: int, seconds: float) -> dict:
    """The timing columns of one row: `size` bytes (the nccl-tests size) moved by `op` over `n`
    devices in `seconds`."""
    algbw = size / seconds / 1e9
    return {"time_us": seconds * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * op.bus_factor(n)}


def run_all(mesh, axis_groups: Sequence[tuple[str, ...]], ops: Sequence[str], sizes: Sequence[int], *,
            iters: int, repeats: int, on_row=None) -> list[dict]:
    table = _collectives()
    rows = []
    for axes in axis_groups:
        for name in ops:
            for size in sizes:
                row = measure(mesh, table[name], axes, size, iters=iters, repeats=repeats)
                rows.append(row)
                if on_row is not None:
                    on_row(row)
    return rows


def format_row(r: dict) -> str:
    return (f"{r['axes']:<16} {r['op']:<19} {r['devices']:>4} {_human(r['bytes']):>9} {r['time_us']:>11.1f} "
            f"{r['algbw_GBps']:>10.3f} {r['busbw_GBps']:>10.3f}")


HEADER = f"{'axes':<16} {'collective':<19} {'n':>4} {'size':>9} {'time (us)':>11} {'algbw GB/s':>10} {'busbw GB/s':>10}"


def _human(n: int) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return f"{n}B"


def write_json(rows: list[dict], path: str, device_kind: str, mesh: dict[str, int]) -> None:
    """One JSON line per row, with the device kind and the mesh's axis sizes (the planner finds
    which link an axis crossed from its place in the mesh: jaxtrain/planner/links.py)."""
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({"device_kind": device_kind, "mesh": mesh, **r}) + "\n")


def plot(rows: list[dict], path: str, title: str) -> None:
    """Bus bandwidth against message size, one line per (axes, collective)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    groups = list(dict.fromkeys(r["axes"] for r in rows))
    styles = ["-", "--", ":", "-."]
    for key in dict.fromkeys((r["axes"], r["op"]) for r in rows):  # colour: collective; line style: axes
        line = sorted((r["bytes"], r["busbw_GBps"]) for r in rows if (r["axes"], r["op"]) == key)
        ax.plot([b for b, _ in line], [g for _, g in line], marker="o", label=f"{key[0]}: {key[1]}",
                color=f"C{COLLECTIVES.index(key[1])}", linestyle=styles[groups.index(key[0]) % len(styles)])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes, nccl-tests convention)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_flags(parser) -> None:
    parser.add_argument("--mesh", default="", help="collectives: mesh axis sizes, e.g. data=4,tensor=4 "
                        "(default: the gin config's MeshConfig)")
    parser.add_argument("--axes", default="", help="collectives: axes or groups a+b, comma-separated "
                        "(default: every axis of size > 1 and every pair)")
    parser.add_argument("--ops", default=",".join(COLLECTIVES), help="collectives: which, comma-separated")
    parser.add_argument("--sizes", default="4k,64k,1m,16m", help="collectives: message sizes (k, m, g suffixes)")
    parser.add_argument("--iters", type=int, default=10, help="collectives: back to back on device per timing")
    parser.add_argument("--repeats", type=int, default=5, help="collectives: timings; the best one counts")
    parser.add_argument("--json", default=None, help="collectives: write the rows as JSON lines here")
    parser.add_argument("--png", default=None, help="collectives: plot bus bandwidth against size here")


def parse_mesh(spec: str) -> dict[str, int]:
    from jaxtrain.meshes.mesh_config import AXES
    sizes = {}
    for part in filter(None, spec.split(",")):
        key, _, value = part.partition("=")
        if key not in AXES or not value.lstrip("-").isdigit():
            raise ValueError(f"--mesh {spec!r}: expected axis=size pairs over {', '.join(AXES)}, got {part!r}")
        sizes[key] = int(value)
    return sizes


def check_args(args) -> tuple[dict, list[str], list[int]]:
    """Everything checkable before jax starts: (mesh sizes, ops, sizes); ValueError names the flag."""
    mesh = parse_mesh(args.mesh)
    ops = [o for o in args.ops.split(",") if o]
    unknown = [o for o in ops if o not in COLLECTIVES]
    if unknown or not ops:
        raise ValueError(f"--ops {args.ops!r}: choose from {', '.join(COLLECTIVES)}")
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    if not sizes:
        raise ValueError("--sizes is empty")
    if args.iters < 1 or args.repeats < 1:
        raise ValueError("--iters and --repeats must be positive")
    return mesh, ops, sizes


def main(args, fail) -> int:
    import dataclasses

    import jax

    from jaxtrain.training.config import load_experiment
    from jaxtrain.meshes.mesh import build_mesh, describe
    from jaxtrain.meshes.mesh_config import MeshConfig

    mesh_sizes, ops, sizes = check_args(args)
    try:
        base = load_experiment().mesh if not mesh_sizes else MeshConfig()
        config = dataclasses.replace(base, **{"data": 1, **mesh_sizes}) if mesh_sizes else base
        mesh = build_mesh(config)
        groups = parse_axes(args.axes, dict(mesh.shape))
    except ValueError as e:
        fail(str(e))
    main_process = jax.process_index() == 0
    kind = jax.devices()[0].device_kind
    title = f"{kind} x {jax.device_count()} ({jax.process_count()} process(es)), mesh {describe(mesh)}"
    if main_process:
        print(f"# {title}; best of {args.repeats} x {args.iters} iterations", flush=True)
        print(HEADER, flush=True)
    rows = run_all(mesh, groups, ops, sizes, iters=args.iters, repeats=args.repeats,
                   on_row=lambda r: main_process and print(format_row(r), flush=True))
    if main_process and args.json:
        write_json(rows, args.json, kind, dict(mesh.shape))
    if main_process and args.png:
        plot(rows, args.png, title)
    return 0
