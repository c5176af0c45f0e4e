"""HF tensors -> our parameters: checked up front, then read a region or a layer at a time."""
from __future__ import annotations

import re
from typing import Iterator, NamedTuple

import numpy as np

from jaxtrain.hf.errors import HFCheckpointError
from jaxtrain.hf.mapping import Family
from jaxtrain.hf.plan import BoundMap, LeafPlan, check_tiling, leaf_plans

Region = tuple[slice, ...]


class ParamPiece(NamedTuple):
    """One stack row of one of our parameters (`index` is () for an unstacked parameter)."""
    path: str
    index: tuple[int, ...]
    array: np.ndarray


class ImportPlan:
    """Our parameters from the tensors of `source` (a SafetensorsDir or anything with `tensors`
    (name -> info with .shape) and `read(name, slices)`).

    Construction checks every tensor the model needs is there with the right shape, and that
    no tensor is left over, so bad input fails before anything is read or written.
    """

    def __init__(self, family: Family, config, source):
        self.family, self.config, self.source = family, config, source
        self.leaves: dict[str, LeafPlan] = leaf_plans(family, config)
        self._check()

    # -- checks ------------------------------------------------------------------------------
    def _check(self) -> None:
        where = getattr(self.source, "directory", "the HF checkpoint")
        used: dict[str, list[tuple[int, int, int] | None]] = {}
        for leaf in self.leaves.values():
            for b in leaf.maps:
                for index in leaf.stack_indices():
                    name = b.map.hf_name(index)
                    if name not in self.source.tensors:
                        raise HFCheckpointError(f"{where}: missing tensor {name!r} (needed for our {leaf.path})")
                    actual = tuple(self.source.tensors[name].shape)
                    expected = b.hf_part_shape
                    if b.map.hf_slice is not None and len(actual) == len(expected):
                        axis = b.map.hf_slice[0]  # a fused tensor: only the other dims are known here
                        expected = expected[:axis] + (actual[axis],) + expected[axis + 1:]
                    if actual != expected:
                        raise HFCheckpointError(f"{where}: tensor {name!r} has shape {list(actual)}, but the config "
                                                f"implies {list(expected)} (for our {leaf.path})")
                    used.setdefault(name, []).append(b.map.hf_slice)
        for name, parts in used.items():
            if parts != [None]:
                shape = tuple(self.source.tensors[name].shape)
                try:
                    check_tiling(f"{where}: tensor {name!r}", shape, parts)
                except ValueError as e:
                    raise HFCheckpointError(str(e)) from e
        ignored = [re.compile(p) for p in self.family.ignored_hf_tensors]
        unexpected = sorted(n for n in self.source.tensors
                            if n not in used and not any(p.fullmatch(n) for p in ignored))
        if unexpected:
            raise HFCheckpointError(
                f"{where}: unexpected tensor(s) {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} that the "
                f"{self.family.model_type} mapping of this config does not use (does config.json match the weights?)")

    # -- reading -----------------------------------------------------------------------------
    def read_region(self, path: str, region: Region) -> np.ndarray:
        """our_param[path][region], reading only the HF slices it covers."""
        leaf = self.leaves[path]
        region = tuple(slice(*s.indices(d)[:2]) for s, d in zip(region, leaf.shape))
        n = len(leaf.stack_shape)
        stack_region, layer_region = region[:n], region[n:]
        out = np.empty([s.stop - s.start for s in region], leaf.dtype)
        for offset in np.ndindex(*out.shape[:n]):
            index = tuple(s.start + i for s, i in zip(stack_region, offset))
            out[offset] = self._layer_region(leaf, index, layer_region)
        return out

    def layer(self, path: str, index: tuple[int, ...]) -> np.ndarray:
        leaf = self.leaves[path]
        return self._layer_region(leaf, index, tuple(slice(0, d) for d in leaf.layer_shape))

    def pieces(self) -> Iterator[ParamPiece]:
        """Every parameter, one stack row at a time."""
        for leaf in self.leaves.values():
            for index in leaf.stack_indices():
                yield ParamPiece(leaf.path, tuple(index), self.layer(leaf.path, tuple(index)))

    def _layer_region(self, leaf: LeafPlan, index: tuple[int, ...], region: Region) -> np.ndarray:
        out = np.empty([s.stop - s.start for s in region], leaf.dtype)
        for b in leaf.maps:
            part_region, dest = region, (slice(None),) * len(region)
            if b.map.ours_slice is not None:
                axis, start, stop = b.map.ours_slice
                lo, hi = max(region[axis].start, start), min(region[axis].stop, stop)
                if lo >= hi:
                    continue
                part_region = _replace(region, axis, slice(lo - start, hi - start))
                dest = _replace(dest, axis, slice(lo - region[axis].start, hi - region[axis].start))
            block = b.rearrange.read_region(self._reader(b, index), b.hf_part_shape, b.ours_part_shape, part_region)
            out[dest] = block.astype(leaf.dtype, copy=False)
        return out

    def _reader(self, b: BoundMap, index: tuple[int, ...]):
        name = b.map.hf_name(index)

        def read(slices: Region) -> np.ndarray:
            if b.map.hf_slice is not None:
                axis, start, _ = b.map.hf_slice
                lo, hi, _ = slices[axis].indices(b.hf_part_shape[axis])
                slices = _replace(slices, axis, slice(start + lo, start + hi))
            return self.source.read(name, slices)
        return read


def _replace(t: tuple, i: int, value) -> tuple:
    return t[:i] + (value,) + t[i + 1:]
