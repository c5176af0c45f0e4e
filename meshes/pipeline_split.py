"""Which layers each pipeline stage holds: layer counts per chunk and the stage layout.

The model is a sequence of layers, each of a *kind* (one stacked parameter tree per kind:
DeepSeek's `dense_blocks` then `moe_blocks`; Nemotron-H's mamba/attention/mlp/moe). It is cut
into `stages × repeats` contiguous chunks; chunk `c = repeat * stages + stage` runs on `stage`
in pass `repeat` (GPipe has one pass).

All stages run one program, so every chunk is laid out on one common *slot pattern*: a
sequence of kinds of which each chunk's own kind sequence is a subsequence (a shortest common
supersequence). A chunk fills the slots its layers match; the rest are padding, computed at run
time but discarded (a select), holding zero parameters. Per kind, every stage holds
`repeats × slots[kind]` layers' parameters, so padding costs one layer's parameters and
optimizer state per padded slot on that stage.
"""
from __future__ import annotations

import dataclasses
from typing import Hashable, Sequence

import numpy as np

Kind = Hashable


def balanced_counts(costs: Sequence[float], chunks: int) -> tuple[int, ...]:
    """Contiguous split of layers into `chunks` non-empty chunks minimizing the costliest chunk
    (ties: earlier chunks take more layers, e.g. 27 equal layers over 2 -> (14, 13))."""
    n = len(costs)
    if not 1 <= chunks <= n:
        raise ValueError(f"cannot split {n} layers into {chunks} non-empty pipeline chunks")
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, np.float64))])
    inf = float("inf")
    # best[c][i]: the least possible max-chunk cost of splitting layers i.. into c chunks
    best = np.full((chunks + 1, n + 1), inf)
    best[0][n] = 0.0
    cut = np.zeros((chunks + 1, n + 1), np.int64)
    for c in range(1, chunks + 1):
        for i in range(n - c, -1, -1):
            for j in range(n - c + 1, i, -1):  # first chunk i..j-1; prefer the longest on ties
                value = max(prefix[j] - prefix[i], best[c - 1][j])
                if value < best[c][i] - 1e-9 * max(1.0, abs(value)):
                    best[c][i], cut[c][i] = value, j
    counts, i = [], 0
    for c in range(chunks, 0, -1):
        counts.append(int(cut[c][i] - i))
        i = int(cut[c][i])
    return tuple(counts)


def slot_pattern(kinds: Sequence, counts: Sequence[int]) -> list:
    """The common slot pattern of the chunks `counts` cuts `kinds` (one kind per layer) into."""
    bounds = np.concatenate([[0], np.cumsum(counts)])
    pattern: list = []
    for c in range(len(counts)):
        pattern = common_supersequence(pattern, list(kinds[bounds[c]:bounds[c + 1]]))
    return pattern


def fastest_counts(kinds: Sequence, costs: Sequence[float], chunks: int, reach: int = 3) -> tuple[int, ...]:
    """A split whose common slot pattern is cheapest: every stage runs every slot (padding too),
    so a tick costs the pattern's layers. Starts from `balanced_counts` and moves chunk
    boundaries by up to `reach` layers while that makes the pattern cheaper (then the costliest
    chunk lighter). With one kind of layer the pattern is the longest chunk: the balanced split."""
    cost_of = dict(zip(kinds, costs))
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, np.float64))])

    def score(counts):
        bounds = np.cumsum((0,) + counts)
        return (round(sum(cost_of[k] for k in slot_pattern(kinds, counts)), 6),
                round(max(prefix[b] - prefix[a] for a, b in zip(bounds[:-1], bounds[1:])), 6))

    best = balanced_counts(costs, chunks)
    best_score = score(best)
    improved = len(set(kinds)) > 1
    while improved:
        improved = False
        for i in range(chunks - 1):
            for shift in [d for r in range(1, reach + 1) for d in (r, -r)]:
                moved = list(best)
                moved[i] += shift
                moved[i + 1] -= shift
                if min(moved) < 1:
                    continue
                moved = tuple(moved)
                if score(moved) < best_score:
                    best, best_score, improved = moved, score(moved), True
    return best


def chunk_counts(costs: Sequence[float], chunks: int, given: Sequence[int] | None,
                 kinds: Sequence | None = None) -> tuple[int, ...]:
    """Layer counts per chunk: `given` checked, or when None the split whose slot pattern is
    cheapest (`kinds`: each layer's kind; without them, the balanced split of `costs`)."""
    n = len(costs)
    if given is None:
        if not 1 <= chunks <= n:
            raise ValueError(f"cannot split {n} layers into {chunks} non-empty pipeline chunks "
                             f"(pipeline stages x virtual stages)")
        return balanced_counts(costs, chunks) if kinds is None else fastest_counts(kinds, costs, chunks)
    given = tuple(int(c) for c in given)
    where = f"PipelineConfig.stages_layers={given}"
    if len(given) != chunks:
        raise ValueError(f"{where} names {len(given)} chunks but the layout has {chunks} "
                         f"(pipeline stages x virtual stages)")
    if sum(given) != n:
        raise ValueError(f"{where} sums to {sum(given)} but the model has {n} layers")
    empty = [i for i, c in enumerate(given) if c <= 0]
    if empty:
        raise ValueError(f"{where} leaves pipeline chunk(s) {empty} empty: every stage needs at least one layer")
    return given


def common_supersequence(a: Sequence, b: Sequence) -> list:
    """A shortest common supersequence of a and b (by the LCS table)."""
    n, m = len(a), len(b)
    lcs = np.zeros((n + 1, m + 1), np.int64)
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            lcs[i, j] = lcs[i + 1, j + 1] + 1 if a[i] == b[j] else max(lcs[i + 1, j], lcs[i, j + 1])
    out, i, j = [], 0, 0
    while i < n and j < m:
        if a[i] == b[j]:
            out.append(a[i]); i += 1; j += 1
        elif lcs[i + 1, j] >= lcs[i, j + 1]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + list(a[i:]) + list(b[j:])


@dataclasses.dataclass(frozen=True)
class StagePlan:
    stages: int
    repeats: int
    counts: tuple[int, ...]  # layers per chunk, chunk = repeat * stages + stage
    pattern: tuple  # the common slot pattern: one kind per slot position
    kinds: tuple  # kinds in order of first appearance
    layers: dict  # kind -> number of layers of that kind in the model
    index: dict  # kind -> int array [stages, repeats, slots]: the kind's layer index, -1 = padding

    def slots(self, kind) -> int:
        return self.index[kind].shape[-1]

    def valid(self, kind) -> np.ndarray:
        return self.index[kind] >= 0

    def padding(self) -> dict:
        """Per kind, each stage's padded slots (summed over its repeats)."""
        return {k: [int((self.index[k][s] < 0).sum()) for s in range(self.stages)] for k in self.kinds}

    def runs(self) -> tuple[tuple[Kind, int, int], ...]:
        """The slot pattern as runs of one kind: (kind, first slot of that kind, length)."""
        out, seen = [], {k: 0 for k in self.kinds}
        for kind in self.pattern:
            if out and out[-1][0] == kind:
                out[-1][2] += 1
            else:
                out.append([kind, seen[kind], 1])
            seen[kind] += 1
        return tuple(tuple(r) for r in out)

    def canonical_positions(self, kind) -> np.ndarray:
        """For each layer of `kind` (in model order), its flat position in [stages*repeats*slots]."""
        flat = self.index[kind].reshape(-1)
        where = np.full(self.layers[kind], -1, np.int64)
        where[flat[flat >= 0]] = np.nonzero(flat >= 0)[0]
        return where

    def describe(self) -> str:
        return ", ".join(f"{k}: {self.slots(k)} slots x {self.repeats} per stage" for k in self.kinds)


def plan_stages(sequence: Sequence[tuple[Kind, int]], stages: int, repeats: int,
                counts: Sequence[int]) -> StagePlan:
    """`sequence`: every layer as (kind, its index within the kind), in model order."""
    counts = tuple(counts)
    if len(counts) != stages * repeats or sum(counts) != len(sequence):
        raise ValueError(f"chunk counts {counts} do not cut {len(sequence)} layers into {stages * repeats} chunks")
    bounds = np.concatenate([[0], np.cumsum(counts)])
    chunks = [list(sequence[bounds[c]:bounds[c + 1]]) for c in range(len(counts))]
    pattern = slot_pattern([kind for kind, _ in sequence], counts)
    kinds = tuple(dict.fromkeys(kind for kind, _ in sequence))
    slots = {k: sum(1 for p in pattern if p == k) for k in kinds}
    index = {k: np.full((stages, repeats, slots[k]), -1, np.int64) for k in kinds}
    for c, chunk in enumerate(chunks):
        repeat, stage = divmod(c, stages)
        filled = {k: 0 for k in kinds}
        pos = 0
        for kind, layer in chunk:  # greedy leftmost embedding of the chunk into the pattern
            while pattern[pos] != kind:
                filled[pattern[pos]] += 1
                pos += 1
            index[kind][stage, repeat, filled[kind]] = layer
            filled[kind] += 1
            pos += 1
    layers = {k: sum(1 for kind, _ in sequence if kind == k) for k in kinds}
    return StagePlan(stages, repeats, counts, tuple(pattern), kinds, layers, index)
