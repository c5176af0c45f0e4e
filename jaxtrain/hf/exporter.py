"""Our parameters -> an HF directory that transformers loads, one tensor at a time.

The parameters come from a *source* with `layer(path, index) -> np.ndarray` (one stack row of
one parameter): a live model (sources.ModelSource) or a checkpoint read lazily from disk
(checkpoint_io.CheckpointSource). Each HF tensor is built from the rows it needs, written to
its place in its shard, and dropped.
"""
from __future__ import annotations

import json
import os

import numpy as np

from jaxtrain.hf.mapping import Family
from jaxtrain.hf.plan import BoundMap, LeafPlan, check_tiling, leaf_plans
from jaxtrain.hf.safetensors_io import PlannedTensor, ShardedWriter
from models.dtypes import dtype_from_name

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

    def build(self, name: str, source) -> np.ndarray:
        planned = self.planned[name]
        out = None
        for leaf, b, index in self.parts[name]:
            row = source.layer(leaf.path, index)
            if b.map.ours_slice is not None:
                axis, start, stop = b.map.ours_slice
                row = row[(slice(None),) * axis + (slice(start, stop),)]
            hf = b.rearrange.backward(np.asarray(row), b.hf_part_shape).astype(planned.dtype, copy=False)
            if b.map.hf_slice is None:
                return hf
            if out is None:
                out = np.empty(planned.shape, planned.dtype)
            axis, start, stop = b.map.hf_slice
            out[(slice(None),) * axis + (slice(start, stop),)] = hf
        return out

    def write_order(self) -> list[str]:
        """HF names grouped by the parameter they come from, so a source caching one parameter
        at a time reads each once."""
        order = {path: i for i, path in enumerate(self.leaves)}
        return sorted(self.parts, key=lambda n: (order[self.parts[n][0][0].path], self.parts[n][0][2]))

    def hf_config(self) -> dict:
        dtype = self.dtype or next(iter(self.leaves.values())).dtype
        return {"architectures": [self.family.architecture], "model_type": self.family.model_type,
                **self.family.config_to_hf(self.config), "dtype": str(dtype)}


def write_hf_dir(plan: ExportPlan, source, directory: str,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """config.json plus safetensors shards (and their index when there are several)."""
    os.makedirs(directory, exist_ok=True)
    writer = ShardedWriter(directory, list(plan.planned.values()), max_shard_bytes)
    try:
        for name in plan.write_order():
            writer.write(name, plan.build(name, source))
    except BaseException:
        writer.close(check=False)
        raise
    writer.close()
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(plan.hf_config(), f, indent=2, sort_keys=True)
