"""A family's tensor table bound to one configured model: which maps fill which parameter, with
every shape worked out, before any tensor is read or written."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
from flax import nnx

from jaxtrain.hf.mapping import STACK_AXES, Family, TensorMap
from jaxtrain.hf.rearrange import Rearrange, parse
from jaxtrain.training.state import abstract_model
from jaxtrain.models.layers.params import logical_axes

# The most of one tensor converted at once. Small blocks keep the host-memory peak of a
# conversion near the fixed cost of the libraries (the peak above that cost grows with the block:
# on a 1.2 GB model about 60 MiB at 2 MiB blocks, 190 MiB at 32); storage chunks are this size too.
BLOCK_BYTES = 4 * 2 ** 20


@dataclasses.dataclass(frozen=True)
class BoundMap:
    map: TensorMap
    rearrange: Rearrange
    ours_part_shape: tuple[int, ...]  # one stack row of ours, restricted to ours_slice
    hf_part_shape: tuple[int, ...]  # one HF tensor, restricted to hf_slice


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    stack_shape: tuple[int, ...]  # leading axes enumerated by the HF name's placeholders
    maps: tuple[BoundMap, ...]

    @property
    def layer_shape(self) -> tuple[int, ...]:
        return self.shape[len(self.stack_shape):]

    def stack_indices(self):
        return np.ndindex(*self.stack_shape)  # a single () when unstacked

    def blocks(self, max_bytes: int) -> tuple[tuple[int, ...], list[tuple[slice, ...]]]:
        """(block shape, regions) tiling the parameter: one stack row at a time, each row cut
        along the axis that is outermost in the HF tensor (so every block is a run of whole
        HF rows, contiguous on disk) into blocks of at most `max_bytes` where possible."""
        n, layer = len(self.stack_shape), self.layer_shape
        b = self.maps[0]
        cut = b.rearrange.axis_group(0) if layer and len(self.maps) == 1 else None
        rows = None
        if cut is not None:
            unit = self.dtype.itemsize * math.prod(layer) // max(layer[cut], 1)
            rows = max(1, min(layer[cut], max_bytes // max(unit, 1)))
        block = (1,) * n + tuple(rows if i == cut else d for i, d in enumerate(layer))
        starts = range(0, layer[cut], rows) if cut is not None else [0]
        regions = []
        for index in self.stack_indices():
            for start in starts:
                per_layer = tuple(slice(start, min(start + rows, d)) if i == cut else slice(0, d)
                                  for i, d in enumerate(layer))
                regions.append(tuple(slice(i, i + 1) for i in index) + per_layer)
        return block, regions


def identity_pattern(rank: int) -> str:
    axes = " ".join(f"a{i}" for i in range(rank))
    return f"{axes} -> {axes}"


def part_shape(shape: tuple[int, ...], part: tuple[int, int, int] | None) -> tuple[int, ...]:
    if part is None:
        return shape
    axis, start, stop = part
    return shape[:axis] + (stop - start,) + shape[axis + 1:]


def leaf_plans(family: Family, config) -> dict[str, LeafPlan]:
    """Our parameter path -> LeafPlan, for every parameter of the model `config` builds.

    Raises ValueError for a table that does not fit the model (a bug in the family file, not
    in the checkpoint): a required map whose parameter is absent, a parameter nothing maps,
    stack axes that are not the parameter's leading axes, parts that do not tile a parameter.
    """
    _, abstract = abstract_model(config)
    leaves = {"/".join(str(k) for k in path): var for path, var in nnx.to_flat_state(abstract)}
    bound: dict[str, list[BoundMap]] = {}
    for m in family.tensors(config):
        if m.ours not in leaves:
            if m.optional:
                continue
            raise ValueError(f"{family.model_type} mapping: our model has no parameter {m.ours!r}")
        var = leaves[m.ours]
        stack = m.stack
        axes = logical_axes(var)
        if tuple(axes[:len(stack)]) != tuple(STACK_AXES[s] for s in stack):
            raise ValueError(f"{family.model_type} mapping: {m.ours} has leading axes {axes[:len(stack)]}, "
                             f"but {m.hf!r} stacks {stack}")
        ours_part = part_shape(tuple(var.shape[len(stack):]), m.ours_slice)
        rearrange = parse(m.pattern or identity_pattern(len(ours_part)))
        bound.setdefault(m.ours, []).append(BoundMap(m, rearrange, ours_part, rearrange.left_shape(ours_part)))
    unmapped = sorted(set(leaves) - set(bound))
    if unmapped:
        raise ValueError(f"{family.model_type} mapping: no HF tensor maps to our parameter(s) {unmapped}")
    plans = {}
    for path, maps in bound.items():
        var = leaves[path]
        stacks = {b.map.stack for b in maps}
        if len(stacks) != 1:
            raise ValueError(f"{family.model_type} mapping: maps of {path} disagree on stack axes {stacks}")
        n = len(stacks.pop())
        check_tiling(path, tuple(var.shape[n:]), [b.map.ours_slice for b in maps])
        plans[path] = LeafPlan(path, tuple(var.shape), np.dtype(var.dtype), tuple(var.shape[:n]), tuple(maps))
    return plans


def check_tiling(what: str, shape: tuple[int, ...], parts) -> None:
    """Parts (None = whole) must cover `shape` exactly once, along one axis."""
    if parts == [None]:
        return
    axes = {p[0] for p in parts if p is not None}
    if None in parts or len(axes) != 1:
        raise ValueError(f"{what}: parts {parts} must all slice the same axis")
    axis = axes.pop()
    ranges = sorted((p[1], p[2]) for p in parts)
    starts = [start for start, _ in ranges]
    ends = [0] + [stop for _, stop in ranges]
    if starts != ends[:-1] or ends[-1] != shape[axis]:
        raise ValueError(f"{what}: parts {parts} do not tile axis {axis} of size {shape[axis]} exactly")
