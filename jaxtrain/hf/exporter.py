"""Our parameters -> an HF directory that transformers loads, one tensor at a time.

The parameters come from a *source* with `region(path, index, slices) -> np.ndarray` (part of
one stack row of one parameter): a live model (saving.ParamsSource) or a checkpoint read
lazily from disk (checkpoint_streaming.CheckpointSource). Each HF tensor is built a block of
rows at a time from the regions it needs, written to its place in its shard, and dropped.
"""
from __future__ import annotations

import json
import os

import numpy as np

from jaxtrain.hf.mapping import Family
from jaxtrain.hf.plan import BLOCK_BYTES, BoundMap, LeafPlan, check_tiling, leaf_plans
from jaxtrain.hf.safetensors_io import PlannedTensor, ShardedWriter
from jaxtrain.models.dtypes import dtype_from_name

DEFAULT_MAX_SHARD_BYTES = 5 * 10 ** 9  # transformers' customary shard size


class ExportPlan:
    def __init__(self, family: Family, config, dtype: str | None = None):
        self.family, self.config = family, config
        self.leaves: dict[str, LeafPlan] = leaf_plans(family, config)
        self.dtype = np.dtype(dtype_from_name(dtype)) if dtype else None
        # HF name -> the (leaf, map, stack index) parts it is assembled from
        self.parts: dict[str, list[tuple[LeafPlan, BoundMap, tuple[int, ...]]]] = {}
        for leaf in self.leaves.values():
            for b in leaf.maps:
                for index in leaf.stack_indices():
                    self.parts.setdefault(b.map.hf_name(index), []).append((leaf, b, tuple(index)))
        self.planned = {name: self._plan(name, parts) for name, parts in self.parts.items()}

    def _plan(self, name: str, parts) -> PlannedTensor:
        leaf, b, _ = parts[0]
        dtype = self.dtype or leaf.dtype
        if len(parts) == 1 and b.map.hf_slice is None:
            return PlannedTensor(name, b.hf_part_shape, dtype)
        axis = b.map.hf_slice[0] if b.map.hf_slice else 0
        shape = list(b.hf_part_shape)
        shape[axis] = max((p[1].map.hf_slice or (0, 0, 0))[2] for p in parts)
        check_tiling(f"HF tensor {name!r}", tuple(shape), [p[1].map.hf_slice for p in parts])
        return PlannedTensor(name, tuple(shape), dtype)

    def build(self, name: str, source, rows: slice | None = None) -> np.ndarray:
        """HF tensor `name` (only its rows `rows`, default all), from the parameter regions
        it needs; `source.region(path, index, slices)` gives one stack row's region."""
        planned = self.planned[name]
        rows = slice(*(rows or slice(None)).indices(planned.shape[0] if planned.shape else 1)[:2])
        out = np.empty((rows.stop - rows.start,) + planned.shape[1:], planned.dtype)
        for leaf, b, index in self.parts[name]:
            region = tuple(slice(0, d) for d in b.hf_part_shape)  # of this part, in part coordinates
            dest = (slice(None),) * out.ndim
            start = b.map.hf_slice[1] if b.map.hf_slice else 0
            if b.map.hf_slice is None or b.map.hf_slice[0] == 0:
                lo, hi = max(rows.start, start), min(rows.stop, start + b.hf_part_shape[0])
                if lo >= hi:
                    continue
                region = (slice(lo - start, hi - start),) + region[1:]
                dest = (slice(lo - rows.start, hi - rows.start),) + dest[1:]
            else:
                axis = b.map.hf_slice[0]
                region = (slice(rows.start, rows.stop),) + region[1:]
                dest = dest[:axis] + (slice(start, start + b.hf_part_shape[axis]),) + dest[axis + 1:]
            read = self._reader(source, leaf, b, index)
            out[dest] = b.rearrange.inverse.read_region(read, b.ours_part_shape, b.hf_part_shape, region)
        return out

    @staticmethod
    def _reader(source, leaf: LeafPlan, b: BoundMap, index: tuple[int, ...]):
        def read(slices):
            if b.map.ours_slice is not None:
                axis, start, _ = b.map.ours_slice
                lo, hi, _ = slices[axis].indices(b.ours_part_shape[axis])
                slices = slices[:axis] + (slice(start + lo, start + hi),) + slices[axis + 1:]
            return np.asarray(source.region(leaf.path, index, slices))
        return read

    def row_blocks(self, name: str, max_bytes: int) -> list[slice]:
        planned = self.planned[name]
        if not planned.shape:
            return [slice(None)]
        rows = planned.shape[0]
        per_row = max(planned.nbytes // max(rows, 1), 1)
        step = max(1, min(rows, max_bytes // per_row))
        return [slice(r, min(r + step, rows)) for r in range(0, rows, step)] or [slice(0, 0)]

    def write_order(self) -> list[str]:
        """HF names grouped by the parameter they come from, so a source caching one parameter
        at a time reads each once."""
        order = {path: i for i, path in enumerate(self.leaves)}
        return sorted(self.parts, key=lambda n: (order[self.parts[n][0][0].path], self.parts[n][0][2]))

    def hf_config(self) -> dict:
        dtype = self.dtype or next(iter(self.leaves.values())).dtype
        return {"architectures": [self.family.architecture], "model_type": self.family.model_type,
                **self.family.config_to_hf(self.config), "dtype": str(dtype)}


def write_hf_dir(plan: ExportPlan, source, directory: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 block_bytes: int = BLOCK_BYTES) -> None:
    """config.json plus safetensors shards (and their index when there are several), each
    tensor written in runs of whole rows of at most `block_bytes`."""
    config = plan.hf_config()  # a config HF cannot express fails here, before anything is written
    os.makedirs(directory, exist_ok=True)
    writer = ShardedWriter(directory, list(plan.planned.values()), max_shard_bytes)
    try:
        for name in plan.write_order():
            for rows in plan.row_blocks(name, block_bytes):
                writer.write(name, plan.build(name, source, rows), rows.start or 0)
    except BaseException:
        writer.close(check=False)
        raise
    writer.close()
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
