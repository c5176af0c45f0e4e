"""How well a tree of arrays is sharded: bytes per device, and what replication costs.

    report = audit_sharding(abstract_params, shardings, name="params")   # ShapeDtypeStructs or arrays
    print(report.summary())
      params 11.57 GiB/device, 0.63 GiB replicated (5.4%): top stacks/moe/layers/attn/kv_up/kernel x16 ...
    check_sufficiently_sharded(report, tolerance=0.02)   # ShardingAuditError naming the top offenders

`audit_sharding(tree, shardings=None, *, paths=None, name="tree", top=10)` walks the leaves of
`tree` (jax.ShapeDtypeStruct or jax.Array) with the matching tree of shardings (`NamedSharding`,
or any `jax.sharding.Sharding`; by default each leaf's own `.sharding`). `paths`, optional, names
the leaves in flatten order (default: the tree's keys joined by "/", e.g. `stacks/blocks/layers/
attn/q/kernel`). For each leaf, on the devices of its sharding:

- bytes: the whole (global) array's size;
- bytes per device: the largest shard a device holds (shards of an uneven split are padded);
- copies: how many devices hold each element (1: fully sharded; the device count: replicated);
- replicated bytes per device: bytes per device beyond the ideal bytes / devices, i.e. what the
  leaf's copies cost each device.

The report sums these over the leaves (`bytes_per_device`, `ideal_bytes_per_device` = total /
devices, `replicated_bytes_per_device`) and lists the leaves by replicated bytes (`top`).
Leaves whose sharding lives in host memory (`memory_kind` "pinned_host" / "unpinned_host", e.g.
an optimizer state offloaded with the `+opt_host` rule overlay) are excluded from the device
figures and summed separately (`host_bytes_per_device`, `host_leaves`); the summary says so.

`check_sufficiently_sharded(report, tolerance)` is the equivalent of MaxText's
`assert_params_sufficiently_sharded`: it raises when the replicated bytes exceed `tolerance` x
the bytes per device (device memory only).

No model or training code here: the bench and the trainer decide what to audit and when.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxtrain.meshes.tree_paths import path_text

HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")


class ShardingAuditError(ValueError):
    """More of a tree is replicated than a tolerance allows."""


@dataclasses.dataclass(frozen=True)
class LeafAudit:
    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: str  # the PartitionSpec (or the sharding, for other kinds), as text
    memory_kind: str | None
    devices: int  # devices of the leaf's sharding
    bytes: int  # the global array
    bytes_per_device: int  # the largest shard one device holds
    copies: int  # devices holding each element

    @property
    def on_host(self) -> bool:
        return self.memory_kind in HOST_MEMORY_KINDS

    @property
    def ideal_bytes_per_device(self) -> float:
        return self.bytes / self.devices

    @property
    def replicated_bytes_per_device(self) -> float:
        return max(self.bytes_per_device - self.ideal_bytes_per_device, 0.0)


@dataclasses.dataclass(frozen=True)
class ShardingReport:
    name: str
    devices: int  # the largest device count among the leaves' shardings (the mesh size)
    total_bytes: int  # device-memory leaves, global
    bytes_per_device: int
    ideal_bytes_per_device: float  # total_bytes / devices
    replicated_bytes_per_device: float  # bytes_per_device - the leaves' ideal shares
    host_bytes_per_device: int  # host-memory leaves (excluded from the figures above)
    leaves: tuple[LeafAudit, ...]  # device-memory leaves, most replicated bytes first
    host_leaves: tuple[LeafAudit, ...]

    @property
    def replicated_fraction(self) -> float:
        return self.replicated_bytes_per_device / self.bytes_per_device if self.bytes_per_device else 0.0

    def top(self, n: int = 10) -> tuple[LeafAudit, ...]:
        """The n leaves that cost the most replicated bytes per device (none that cost nothing)."""
        return tuple(leaf for leaf in self.leaves[:n] if leaf.replicated_bytes_per_device > 0)

    def summary(self, top: int = 3) -> str:
        """One line for a CLI log."""
        text = (f"{self.name} {format_bytes(self.bytes_per_device)}/device, "
                f"{format_bytes(self.replicated_bytes_per_device)} replicated ({100 * self.replicated_fraction:.1f}%)")
        worst = self.top(top)
        if worst:
            text += ": top " + ", ".join(f"{leaf.path} x{leaf.copies} {format_bytes(leaf.replicated_bytes_per_device)}"
                                         for leaf in worst)
        if self.host_leaves:
            text += (f"; {len(self.host_leaves)} host-memory leaves ({format_bytes(self.host_bytes_per_device)}/device)"
                     f" not counted")
        return text


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _itemsize(dtype) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:  # extended dtypes (PRNG keys) carry their own itemsize
        return int(dtype.itemsize)


def _copies(sharding, shape: tuple[int, ...]) -> int:
    if isinstance(sharding, NamedSharding):
        split = 1
        for entry in sharding.spec:
            for axis in (() if entry is None else (entry,) if isinstance(entry, str) else entry):
                split *= sharding.mesh.shape[axis]
        return sharding.num_devices // split
    distinct = {tuple((s.start, s.stop, s.step) for s in idx) for idx in sharding.devices_indices_map(shape).values()}
    return sharding.num_devices // len(distinct)


def _shard_shape(sharding, shape: tuple[int, ...]) -> tuple[int, ...]:
    try:
        return tuple(sharding.shard_shape(shape))
    except ValueError:  # an uneven split: the largest shard (XLA pads the others to it)
        if not isinstance(sharding, NamedSharding):
            raise
        out = []
        for dim, entry in zip(shape, tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
            out.append(-(-dim // math.prod(sharding.mesh.shape[a] for a in axes)))
        return tuple(out)


def audit_leaf(path: str, leaf, sharding) -> LeafAudit:
    shape = tuple(int(d) for d in np.shape(leaf)) if not hasattr(leaf, "shape") else tuple(leaf.shape)
    itemsize = _itemsize(leaf.dtype)
    spec = str(sharding.spec) if isinstance(sharding, NamedSharding) else str(sharding)
    return LeafAudit(path=path, shape=shape, dtype=str(leaf.dtype), spec=spec, memory_kind=sharding.memory_kind,
                     devices=sharding.num_devices, bytes=math.prod(shape) * itemsize,
                     bytes_per_device=math.prod(_shard_shape(sharding, shape)) * itemsize,
                     copies=_copies(sharding, shape))


def audit_sharding(tree, shardings=None, *, paths: Sequence[str] | None = None, name: str = "tree",
                   top: int | None = None) -> ShardingReport:
    """The sharding report of `tree` laid out by `shardings` (module docstring). `top`: keep only
    that many leaves in `report.leaves` (all by default; the sums always cover every leaf)."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if shardings is None:
        leaf_shardings = [getattr(leaf, "sharding", None) for _, leaf in with_path]
        if any(s is None for s in leaf_shardings):
            missing = next(path_text(p) for (p, _), s in zip(with_path, leaf_shardings) if s is None)
            raise ValueError(f"leaf {missing} of {name} carries no sharding: pass the shardings tree")
    else:
        leaf_shardings = treedef.flatten_up_to(shardings)
    if paths is None:
        paths = [path_text(p) for p, _ in with_path]
    elif len(paths) != len(with_path):
        raise ValueError(f"{len(paths)} paths for the {len(with_path)} leaves of {name}")
    audits = [audit_leaf(p, leaf, s) for p, (_, leaf), s in zip(paths, with_path, leaf_shardings)]
    device = sorted((a for a in audits if not a.on_host), key=lambda a: -a.replicated_bytes_per_device)
    host = tuple(a for a in audits if a.on_host)
    devices = max((a.devices for a in audits), default=1)
    total = sum(a.bytes for a in device)
    per_device = sum(a.bytes_per_device for a in device)
    return ShardingReport(
        name=name, devices=devices, total_bytes=total, bytes_per_device=per_device,
        ideal_bytes_per_device=total / devices,
        replicated_bytes_per_device=sum(a.replicated_bytes_per_device for a in device),
        host_bytes_per_device=sum(a.bytes_per_device for a in host),
        leaves=tuple(device if top is None else device[:top]), host_leaves=host)


def check_sufficiently_sharded(report: ShardingReport, tolerance: float = 0.02, *, show: int = 5) -> None:
    """ShardingAuditError when more than `tolerance` of the bytes per device are copies (device
    memory; host-memory leaves are not counted), naming the `show` leaves that cost the most."""
    if report.replicated_bytes_per_device <= tolerance * report.bytes_per_device:
        return
    offenders = "; ".join(f"{leaf.path} {leaf.shape} {leaf.spec} x{leaf.copies} "
                          f"({format_bytes(leaf.replicated_bytes_per_device)}/device)" for leaf in report.top(show))
    raise ShardingAuditError(
        f"{report.name}: {format_bytes(report.replicated_bytes_per_device)} of "
        f"{format_bytes(report.bytes_per_device)} per device are replicated copies "
        f"({100 * report.replicated_fraction:.1f}% > tolerance {100 * tolerance:.1f}%) on {report.devices} devices; "
        f"most replicated: {offenders}")
