"""Data parallelism across device groups of different speed, each taking its own share of the batch.

One SPMD program runs the same shapes on every device, so a slower group (a node of slower GPUs)
would hold the faster ones back. Instead each group runs its own program on its own rows of the
global batch, as many microbatches as its speed warrants, and one program over all devices sums
the groups' gradients and applies the optimizer (jaxtrain/training/group_step.py).

    groups      G groups of equal device count, each laid out by the run's ParallelPlan (its own
                5-axis mesh, `GroupLayout.meshes[g]`)
    global mesh the groups' device arrays stacked: axes `groups, pipeline, data, ..., tensor`;
                the rule tables never name `groups`, so the train state is replicated across groups
                and laid out by the plan's rules within each
    shares      `DeviceGroups.rows[g]` rows of each global batch for group g, whole microbatches of
                global_batch / microbatches rows each (`BatchShares`)

A state array on the global mesh, seen on group g's mesh, is the same device buffers
(`GroupLayout.view`, no copy); a group's result goes the other way, as entry g of a [G, ...]
array on the global mesh (`GroupLayout.stack`).
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxtrain.meshes.mesh import build_mesh
from jaxtrain.meshes.mesh_config import AXES, MeshConfig

GROUP_AXIS = "groups"


@dataclasses.dataclass(frozen=True)
class DeviceGroups:
    """`rows[g]`: the rows of each global batch that device group g trains on (group order: the
    devices in process order, cut into len(rows) equal consecutive ranges, so one group per node
    is one group per process). () trains without groups."""
    rows: tuple[int, ...] = ()

    def shares(self, global_batch: int, microbatches: int) -> "BatchShares":
        """The microbatches each group runs; ValueError naming the numbers when the shares do not
        cut the batch into whole microbatches."""
        rows = tuple(self.rows)
        if not rows:
            raise ValueError("DeviceGroups.rows is empty: give each group's rows of the global batch")
        if any(not isinstance(r, int) or r <= 0 for r in rows):
            raise ValueError(f"DeviceGroups.rows={rows}: every group needs a positive number of rows "
                             f"(leave a group's devices out instead of giving it none)")
        if sum(rows) != global_batch:
            raise ValueError(f"DeviceGroups.rows={rows} sum to {sum(rows)}, not TrainConfig.global_batch="
                             f"{global_batch}")
        if microbatches < 1 or global_batch % microbatches:
            raise ValueError(f"TrainConfig.global_batch={global_batch} is not divisible by microbatches="
                             f"{microbatches} (the microbatches of the whole step, across groups)")
        per_microbatch = global_batch // microbatches
        for g, r in enumerate(rows):
            if r % per_microbatch:
                raise ValueError(f"DeviceGroups.rows={rows}: group {g}'s {r} rows are not whole microbatches of "
                                 f"global_batch={global_batch} / microbatches={microbatches} = {per_microbatch} rows")
        return BatchShares(rows, per_microbatch)


@dataclasses.dataclass(frozen=True)
class BatchShares:
    """Which rows of a global batch each group takes. Microbatch j of the global batch is rows
    j, j+M, j+2M, ... (M microbatches: the order step.split_microbatches cuts a batch in), and
    group g takes microbatches first[g] .. first[g] + microbatches[g] - 1, its rows ordered so that
    its own split_microbatches finds those same microbatches. So the groups together run exactly
    the microbatches one program with M microbatches would (per-microbatch quantities such as the
    MoE aux loss included)."""
    rows: tuple[int, ...]
    microbatch_rows: int

    @property
    def microbatches(self) -> tuple[int, ...]:
        return tuple(r // self.microbatch_rows for r in self.rows)

    @property
    def total_microbatches(self) -> int:
        return sum(self.microbatches)

    def first(self, g: int) -> int:
        return sum(self.microbatches[:g])

    def row_indices(self, g: int) -> np.ndarray:
        """Group g's rows of the global batch, in its order: its local row k*m + i is row k of
        global microbatch first + i."""
        m, total = self.microbatches[g], self.total_microbatches
        k, i = np.arange(self.microbatch_rows)[:, None], np.arange(m)[None, :]
        return (k * total + self.first(g) + i).reshape(-1)


def split_devices(devices, count: int, mesh_config: MeshConfig) -> list[list]:
    """The devices of `count` groups. `devices`: a list of lists (the groups, as given) or a flat
    list, cut into `count` equal consecutive ranges in (process, id) order (of the first
    count x its size when the group's mesh has a fixed size)."""
    group_size = None if -1 in mesh_config.sizes().values() else mesh_config.fixed_device_count()
    devices = list(devices)
    if devices and isinstance(devices[0], (list, tuple, np.ndarray)):
        groups = [list(np.asarray(g).flat) for g in devices]
        if len(groups) != count:
            raise ValueError(f"{len(groups)} device groups given for DeviceGroups.rows of {count} groups")
        sizes = [len(g) for g in groups]
        if len(set(sizes)) != 1:
            raise ValueError(f"device groups differ in size: {sizes} devices (every group runs the same "
                             f"ParallelPlan, so each needs as many devices)")
    else:
        devices = sorted(devices, key=lambda d: (d.process_index, d.id))
        size = group_size if group_size is not None else len(devices) // count
        if size == 0 or count * size > len(devices) or (group_size is None and len(devices) % count):
            raise ValueError(f"{len(devices)} devices do not make {count} equal groups"
                             + (f" of {group_size} (the plan's mesh)" if group_size is not None else ""))
        groups = [devices[g * size:(g + 1) * size] for g in range(count)]
    seen = [d for g in groups for d in g]
    if len(set(seen)) != len(seen):
        raise ValueError("a device is in more than one device group")
    return groups


def one_mesh_program(plan, devices=None) -> tuple:
    """(plan, devices) of the one program on one mesh that evaluates or generates from a run of
    `plan` (a ParallelPlan). A run over device groups holds the same state on every group, so that
    is the groups' own layout on the first group's devices; any other run's is its own plan, on
    the first devices a fixed-size mesh needs (all of them when an axis fills). `devices`: default
    jax.devices(). Callers compile what this returns and never branch on the variant."""
    devices = list(jax.devices() if devices is None else devices)
    if plan.groups:
        return dataclasses.replace(plan, groups=()), split_devices(devices, len(plan.groups), plan.mesh)[0]
    if -1 not in plan.mesh.sizes().values():
        devices = devices[:plan.mesh.fixed_device_count()]
    return plan, devices


class GroupLayout:
    """The groups' meshes and the global mesh over all of them; moving arrays between the two
    without copies."""

    def __init__(self, mesh_config: MeshConfig, group_devices: list[list]):
        self.meshes = [build_mesh(mesh_config, devices) for devices in group_devices]
        self.mesh = Mesh(np.stack([m.devices for m in self.meshes]), (GROUP_AXIS, *AXES),
                         axis_types=(AxisType.Auto,) * (len(AXES) + 1))
        here = jax.process_index()
        # The groups this process runs: it holds (some of) their devices.
        self.own = [g for g, m in enumerate(self.meshes) if any(d.process_index == here for d in m.devices.flat)]
        if not self.own:
            raise ValueError(f"process {here} holds no device of the {self.count} device groups: every process "
                             f"runs the step over all groups, so each must own part of one")

    @property
    def count(self) -> int:
        return len(self.meshes)

    @property
    def group_shape(self) -> dict:
        return dict(self.meshes[0].shape)

    def on_group(self, sharding, g: int):
        """A global-mesh NamedSharding (not naming `groups`) as the same layout on group g's mesh."""
        if GROUP_AXIS in _spec_axes(sharding.spec):
            raise ValueError(f"sharding {sharding.spec} splits over {GROUP_AXIS!r}: only replicated state has a view")
        return NamedSharding(self.meshes[g], sharding.spec, memory_kind=sharding.memory_kind)

    def group_shardings(self, shardings, g: int):
        """A tree of global-mesh shardings as the same layouts on group g's mesh."""
        return jax.tree.map(lambda s: self.on_group(s, g), shardings)

    def view(self, tree, g: int):
        """Global-mesh arrays replicated over `groups` -> the same buffers as arrays on group g's mesh."""
        def one(x):
            by_device = {shard.device: shard.data for shard in x.addressable_shards}
            local = [by_device[d] for d in self.meshes[g].devices.flat if d in by_device]
            return jax.make_array_from_single_device_arrays(x.shape, self.on_group(x.sharding, g), local)

        return jax.tree.map(one, tree)

    def stack(self, per_group: dict):
        """{group: tree of group-mesh arrays with a leading axis of 1, laid out P(None, *spec)} for
        this process's groups -> one tree of [G, ...] global arrays laid out P('groups', *spec),
        made of the same buffers."""
        groups = sorted(per_group)
        if groups != self.own:
            raise ValueError(f"results of groups {groups}, but this process runs groups {self.own}")

        def one(*xs):
            first = xs[0]
            spec = PartitionSpec(GROUP_AXIS, *first.sharding.spec[1:])
            shards = [shard.data for x in xs for shard in x.addressable_shards]
            return jax.make_array_from_single_device_arrays(
                (self.count,) + first.shape[1:], NamedSharding(self.mesh, spec), shards)

        return jax.tree.map(one, *(per_group[g] for g in groups))


def _spec_axes(spec) -> set:
    """The mesh axis names a PartitionSpec uses."""
    names = set()
    for entry in spec:
        if entry is None:
            continue
        names.update(entry if isinstance(entry, tuple) else (entry,))
    return names
