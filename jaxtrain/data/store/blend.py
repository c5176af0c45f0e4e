"""Which source each global sample comes from, in a blend of weighted sources (Megatron-LM's
BlendedDataset rule, with the lag measured at the prefix being filled).

Sample `i` goes to the source whose realized count lags its share the most: the source `j`
maximizing `w_j * (i + 1) - count_j(i)` (ties: the first source), with `w` normalized to sum 1.
So at every prefix `n` each source's count stays within one sample of `w_j * n`. Megatron's
helpers.cpp measures the lag at `max(i, 1)`, the prefix before the sample: that rule lets a
source drift up to ~1.16 samples from its share (seen over random weights of 2-6 sources), which
is why this one is one sample later. The assignment
is a pure function of the weights: no state beyond the sample index. The `k`-th sample of a
source is its own `k`-th window in its own order (epoch `k // windows`, a fresh permutation per
epoch), so a small source that runs out simply begins its next epoch.

The rule is sequential; `BlendSchedule` computes it in blocks and keeps each block's starting
counts, so a run reads ahead cheaply and a resume at sample `n` costs one pass up to `n`.
"""
from __future__ import annotations

import numpy as np

_BLOCK = 4096  # samples per cached block


def normalized_weights(weights) -> np.ndarray:
    weights = np.asarray(weights, np.float64)
    if weights.ndim != 1 or not len(weights):
        raise ValueError("a blend needs at least one weighted source")
    if not np.all(np.isfinite(weights)) or np.any(weights <= 0):
        raise ValueError(f"blend weights must be positive numbers, got {weights.tolist()}")
    return weights / weights.sum()


def assign_block(weights: np.ndarray, counts: np.ndarray, first: int, size: int) -> np.ndarray:
    """Sources of samples `first ... first + size - 1` given each source's count before `first`;
    advances `counts` in place."""
    w = [float(x) for x in weights]
    c = [int(x) for x in counts]
    out = np.empty(size, np.int64)
    sources = range(1, len(w))
    for n in range(size):
        i = first + n + 1  # the lag at the prefix this sample completes
        best, lag = 0, w[0] * i - c[0]
        for j in sources:  # the largest lag; the first source on a tie
            if w[j] * i - c[j] > lag:
                best, lag = j, w[j] * i - c[j]
        out[n] = best
        c[best] += 1
    counts[:] = c
    return out


class BlendSchedule:
    """`sources(first, stop)` and `ranks(first, stop)`: each sample's source and how many samples
    of that source came before it (its index within the source's own sample stream)."""

    def __init__(self, weights):
        self.weights = normalized_weights(weights)
        self._start_counts = [np.zeros(len(self.weights), np.int64)]  # counts before block b
        self._block = (-1, None, None)  # (b, its sources, their ranks): a plain tuple stays picklable

    def _block_at(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        cached, sources, ranks = self._block
        if cached == b:
            return sources, ranks
        while len(self._start_counts) <= b:  # one pass from the last known block
            k = len(self._start_counts) - 1
            counts = self._start_counts[k].copy()
            assign_block(self.weights, counts, k * _BLOCK, _BLOCK)
            self._start_counts.append(counts)
        counts = self._start_counts[b].copy()
        sources = assign_block(self.weights, counts, b * _BLOCK, _BLOCK)
        ranks = np.empty(_BLOCK, np.int64)
        start = self._start_counts[b]
        for j in range(len(self.weights)):  # rank = count of j before the block + earlier in-block j's
            here = sources == j
            ranks[here] = start[j] + np.arange(int(here.sum()))
        self._block = (b, sources, ranks)
        return sources, ranks

    def assign(self, first: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, rank) of samples `first ... stop - 1`."""
        pieces = []
        for b in range(first // _BLOCK, (stop - 1) // _BLOCK + 1):
            sources, ranks = self._block_at(b)
            lo, hi = max(first - b * _BLOCK, 0), min(stop - b * _BLOCK, _BLOCK)
            pieces.append((sources[lo:hi], ranks[lo:hi]))
        return np.concatenate([p[0] for p in pieces]), np.concatenate([p[1] for p in pieces])
