"""Invertible axis rearrangements written as patterns, e.g. "(heads head_dim) embed -> embed heads head_dim".

A tensor mapping declares how one HF tensor's layout becomes ours as such a pattern; the same
pattern run backwards exports. Each side lists groups of named axes; a parenthesized group is
one dimension that holds its axes merged in row-major order. Both sides must name the same axes;
a literal `1` is a dimension of size 1 that one side has and the other lacks (HF's depthwise conv
weights are [channels, 1, kernel], ours [channels, kernel]).

`read_region` pulls only what one device shard needs: it maps a region of the output back to
the smallest contiguous block of the input it can express as plain slices (whole dims where a
merged group cannot be sliced contiguously), reads that, and trims the rest after rearranging.
"""
from __future__ import annotations

import functools
import math
import re
from typing import Callable, Sequence

import numpy as np

Group = tuple[str, ...]
Region = tuple[slice, ...]

_TOKEN = re.compile(r"\(|\)|[A-Za-z_][A-Za-z0-9_]*|1(?![0-9])")


def _parse_side(text: str, pattern: str) -> tuple[Group, ...]:
    groups, current = [], None
    position = 0
    for match in _TOKEN.finditer(text):
        if text[position:match.start()].strip():
            raise ValueError(f"bad rearrange pattern {pattern!r}: unexpected {text[position:match.start()]!r}")
        position = match.end()
        token = match.group()
        if token == "(":
            if current is not None:
                raise ValueError(f"bad rearrange pattern {pattern!r}: nested parentheses")
            current = []
        elif token == ")":
            if not current:
                raise ValueError(f"bad rearrange pattern {pattern!r}: empty or unopened group")
            groups.append(tuple(current))
            current = None
        elif token == "1":  # a size-1 dimension holding no named axis
            if current is not None:
                raise ValueError(f"bad rearrange pattern {pattern!r}: `1` inside a group")
            groups.append(())
        elif current is not None:
            current.append(token)
        else:
            groups.append((token,))
    if text[position:].strip() or current is not None:
        raise ValueError(f"bad rearrange pattern {pattern!r}: unbalanced or trailing text")
    return tuple(groups)


@functools.lru_cache(maxsize=None)
def parse(pattern: str) -> "Rearrange":
    return Rearrange(pattern)


class Rearrange:
    """`forward` maps the left layout to the right one; `backward` undoes it."""

    def __init__(self, pattern: str):
        if "->" not in pattern:
            raise ValueError(f"bad rearrange pattern {pattern!r}: expected 'left -> right'")
        left, right = pattern.split("->")
        self.pattern = pattern
        self.left, self.right = _parse_side(left, pattern), _parse_side(right, pattern)
        left_axes, right_axes = _flat(self.left), _flat(self.right)
        if sorted(left_axes) != sorted(right_axes) or len(set(left_axes)) != len(left_axes):
            raise ValueError(f"bad rearrange pattern {pattern!r}: both sides must name the same axes once")

    @property
    def inverse(self) -> "Rearrange":
        left, right = self.pattern.split("->")
        return parse(f"{right.strip()} -> {left.strip()}")

    def axis_group(self, left_group: int) -> int:
        """The right-side dimension holding the outermost axis of left dimension `left_group`."""
        axis = self.left[left_group][0]
        return next(i for i, g in enumerate(self.right) if axis in g)

    # -- shapes ------------------------------------------------------------------------------
    def axis_sizes(self, left_shape: Sequence[int] | None = None,
                   right_shape: Sequence[int] | None = None) -> dict[str, int]:
        """Sizes of the named axes from whichever shapes are known (a group of several axes
        needs all but one of them sized by the other side)."""
        sizes: dict[str, int] = {}
        sides = [(g, s) for g, s in ((self.left, left_shape), (self.right, right_shape)) if s is not None]
        for groups, shape in sides:
            if len(groups) != len(shape):
                raise ValueError(f"shape {tuple(shape)} does not fit the pattern {self.pattern!r}")
        for _ in range(2):  # a second pass resolves groups whose other axes the first pass sized
            for groups, shape in sides:
                for group, dim in zip(groups, shape):
                    unknown = [a for a in group if a not in sizes]
                    known = math.prod(sizes[a] for a in group if a in sizes)
                    if len(unknown) == 1:
                        if dim % known:
                            raise ValueError(f"dimension {dim} cannot hold axes {group} of the pattern {self.pattern!r}")
                        sizes[unknown[0]] = dim // known
                    elif not unknown and known != dim:
                        raise ValueError(f"shape {tuple(shape)} does not fit the pattern {self.pattern!r} "
                                         f"(axes {group} have size {known}, not {dim})")
        missing = [a for a in _flat(self.left) if a not in sizes]
        if missing:
            raise ValueError(f"cannot size axes {missing} of the pattern {self.pattern!r} from the shapes given")
        return sizes

    def left_shape(self, right_shape: Sequence[int]) -> tuple[int, ...]:
        sizes = self.axis_sizes(right_shape=right_shape)
        return tuple(math.prod(sizes[a] for a in g) for g in self.left)

    def right_shape(self, left_shape: Sequence[int]) -> tuple[int, ...]:
        sizes = self.axis_sizes(left_shape=left_shape)
        return tuple(math.prod(sizes[a] for a in g) for g in self.right)

    # -- whole tensors -----------------------------------------------------------------------
    def forward(self, x: np.ndarray, right_shape: Sequence[int] | None = None) -> np.ndarray:
        return _move(x, self.left, self.right, self.axis_sizes(x.shape, right_shape))

    def backward(self, y: np.ndarray, left_shape: Sequence[int] | None = None) -> np.ndarray:
        return _move(y, self.right, self.left, self.axis_sizes(left_shape, y.shape))

    # -- regions -----------------------------------------------------------------------------
    def read_region(self, read: Callable[[Region], np.ndarray], left_shape: Sequence[int],
                    right_shape: Sequence[int], region: Region) -> np.ndarray:
        """forward(left)[region] where `read(slices)` returns left[slices]; reads no more of the
        left tensor than plain slices allow."""
        sizes = self.axis_sizes(left_shape, right_shape)
        region = tuple(slice(*s.indices(d)[:2]) for s, d in zip(region, right_shape))
        wanted: dict[str, tuple[int, int]] = {}
        trim_after = []  # slices of merged right groups that had to be read whole
        for group, sl, dim in zip(self.right, region, right_shape):
            if len(group) == 1:
                wanted[group[0]] = (sl.start, sl.stop)
                trim_after.append(slice(None))
            else:
                wanted.update({a: (0, sizes[a]) for a in group})
                trim_after.append(sl)
        read_slices, have = [], {}
        for group in self.left:
            sl, ranges = _contiguous(group, sizes, wanted)
            read_slices.append(sl)
            have.update(ranges)
        block = read(tuple(read_slices))
        elementary = _flat(self.left)
        block = block.reshape([have[a][1] - have[a][0] for a in elementary])
        order = _flat(self.right)
        block = block.transpose([elementary.index(a) for a in order])
        block = block[tuple(slice(wanted[a][0] - have[a][0], wanted[a][1] - have[a][0]) for a in order)]
        block = block.reshape([math.prod(wanted[a][1] - wanted[a][0] for a in g) for g in self.right])
        return block[tuple(trim_after)]


def _flat(groups: Sequence[Group]) -> list[str]:
    return [a for g in groups for a in g]


def _move(x: np.ndarray, src: Sequence[Group], dst: Sequence[Group], sizes: dict[str, int]) -> np.ndarray:
    src_axes, dst_axes = _flat(src), _flat(dst)
    x = x.reshape([sizes[a] for a in src_axes]).transpose([src_axes.index(a) for a in dst_axes])
    return x.reshape([math.prod(sizes[a] for a in g) for g in dst])


def _contiguous(group: Group, sizes: dict[str, int], wanted: dict[str, tuple[int, int]]):
    """The slice of a (possibly merged) dimension covering the wanted ranges of its axes, and the
    range of each axis that slice holds. A merged dimension is sliced only when that is one
    contiguous run: single indices on the outer axes, a range on one axis, the inner axes whole."""
    full = {a: (0, sizes[a]) for a in group}
    partial = [i for i, a in enumerate(group) if wanted[a] != full[a]]
    if not partial:
        return slice(None), full
    k = partial[0]
    if any(wanted[a] != full[a] for a in group[k + 1:]) or any(
            wanted[a][1] - wanted[a][0] != 1 for a in group[:k]):
        return slice(None), full
    strides = [math.prod(sizes[b] for b in group[i + 1:]) for i in range(len(group))]
    start = sum(wanted[a][0] * strides[i] for i, a in enumerate(group[:k + 1]))
    stop = start + (wanted[group[k]][1] - wanted[group[k]][0]) * strides[k]
    return slice(start, stop), {**full, **{a: wanted[a] for a in group[:k + 1]}}
