"""Which source each global sample comes from, in a blend of weighted sources (Megatron-LM's
BlendedDataset rule, with the lag measured at the prefix being filled, in exact integers).

The weights become integers `a_j` with the same ratios (blend_weights.py; `A = sum(a)`). Sample
`i` goes to the source whose realized count lags its share the most: the `j` maximizing
`a_j * (i + 1) - A * count_j(i)` (`A` times `w_j * (i + 1) - count_j(i)`, compared exactly: a tie
goes to the first source whatever float rounding would say). So at every prefix `n` each
source's count stays within one sample of `w_j * n`. Megatron's helpers.cpp measures the lag at
`max(i, 1)`, the prefix before the sample, which lets a source drift up to ~1.16 samples from its
share (seen over random weights of 2-6 sources); this rule is one sample later.

The assignment repeats with period `A`: after `A` samples every source has had exactly `a_j`
(each lag is then an integer multiple of `A` below `A` in size, so 0) and the rule starts over.
So sample `i`'s source and its rank among that source's samples follow from position `i mod A`
and `(i div A) * a_j`: a resume at any sample costs at most one pass over one period (cached in
blocks of `_BLOCK`), never a pass from sample 0. The `k`-th sample of a source is its own `k`-th
window in its own order (epoch `k // windows`, a fresh permutation per epoch).
"""
from __future__ import annotations

import numpy as np

from jaxtrain.data.store.blend_weights import integer_weights

_BLOCK = 4096  # positions of a period per cached block


def assign_block(weights: np.ndarray, counts: np.ndarray, first: int, size: int) -> np.ndarray:
    """Sources of period positions `first ... first + size - 1` given each source's count before
    `first` (integer `weights`); advances `counts` in place."""
    a = [int(x) for x in weights]
    total = sum(a)
    c = [int(x) for x in counts]
    out = np.empty(size, np.int64)
    sources = range(1, len(a))
    for n in range(size):
        i = first + n + 1  # the lag at the prefix this sample completes
        best, lag = 0, a[0] * i - total * c[0]
        for j in sources:  # the largest lag; the first source on a tie
            here = a[j] * i - total * c[j]
            if here > lag:
                best, lag = j, here
        out[n] = best
        c[best] += 1
    counts[:] = c
    return out


class BlendSchedule:
    """`assign(first, stop)`: each sample's source and how many samples of that source came
    before it (its index within the source's own sample stream)."""

    def __init__(self, weights):
        self.weights = integer_weights(weights)
        self.period = int(self.weights.sum())
        self._start_counts = [np.zeros(len(self.weights), np.int64)]  # counts before block b of a period
        self._block = (-1, None, None)  # (b, its sources, their ranks): a plain tuple stays picklable

    def _block_size(self, b: int) -> int:
        return min(_BLOCK, self.period - b * _BLOCK)

    def _block_at(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Sources and in-period ranks of block `b` of the period."""
        cached, sources, ranks = self._block
        if cached == b:
            return sources, ranks
        while len(self._start_counts) <= b:  # one pass from the last known block
            k = len(self._start_counts) - 1
            counts = self._start_counts[k].copy()
            assign_block(self.weights, counts, k * _BLOCK, self._block_size(k))
            self._start_counts.append(counts)
        counts = self._start_counts[b].copy()
        sources = assign_block(self.weights, counts, b * _BLOCK, self._block_size(b))
        if (b + 1) * _BLOCK >= self.period and not np.array_equal(counts, self.weights):
            raise AssertionError(f"blend weights {self.weights.tolist()}: a period ended with counts "
                                 f"{counts.tolist()}; the assignment would not repeat")
        ranks = np.empty(len(sources), np.int64)
        start = self._start_counts[b]
        for j in range(len(self.weights)):  # rank = count of j before the block + earlier in-block j's
            here = sources == j
            ranks[here] = start[j] + np.arange(int(here.sum()))
        self._block = (b, sources, ranks)
        return sources, ranks

    def assign(self, first: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, rank) of samples `first ... stop - 1`."""
        pieces_sources, pieces_ranks = [], []
        n = first
        while n < stop:
            period, position = divmod(n, self.period)
            b = position // _BLOCK
            sources, ranks = self._block_at(b)
            lo = position - b * _BLOCK
            hi = min(len(sources), lo + stop - n)
            pieces_sources.append(sources[lo:hi])
            pieces_ranks.append(ranks[lo:hi] + period * self.weights[sources[lo:hi]])
            n += hi - lo
        if not pieces_sources:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(pieces_sources), np.concatenate(pieces_ranks)
