"""Training batches from token sources: one corpus, or a weighted blend of several, as a grain
iterator whose state is the step.

One corpus (`DataConfig.train_files`): its documents are shuffled once (seed), packed into
windows (windows.py), and batch `s` of the global batch size G is `order[e][t*G:(t+1)*G]` with
`e, t = divmod(s, steps_per_epoch)` and `order[e]` a permutation of the windows seeded by
(seed, e); windows left over after the last full batch of an epoch are skipped that epoch.

A blend (`DataConfig.blend`): global sample `i = s*G + r` comes from the source blend.py assigns
it; that source's `k`-th sample is window `order_j[k // count_j][k % count_j]` of its own
windows, so each source runs through its own epochs, each in a fresh order. Batches carry
`source_ids` (int32 per row) for the per-source token counts; the steps ignore it.

Either way process `p` of `P` takes rows `p::P` of the global batch and reads only those
windows: each step's global batch is the same whatever the process count, and a resume at any
step equals the uninterrupted run.
"""
from __future__ import annotations

import sys

import grain
import numpy as np

from jaxtrain.data.store.blend import BlendSchedule
from jaxtrain.data.store.windows import WindowIndex, pack_rows

DOC_ORDER_STREAM = 0  # separate seeded random streams for the document and window orders
WINDOW_ORDER_STREAM = 1
BLEND_STREAM = 2  # a blend's per-source orders: (stream, seed, source, [epoch])


def document_order(source, seed: int | None, stream: tuple[int, ...] = ()) -> np.ndarray | None:
    """The seeded document permutation (int64 per document); None (the source's order) unseeded."""
    if seed is None:
        return None
    return np.random.default_rng([DOC_ORDER_STREAM, seed, *stream]).permutation(len(source))


class _EpochOrders:
    """Window order of each epoch of one window index; the last one is kept (O(windows))."""

    def __init__(self, count: int, key: tuple[int, ...] | None):
        self.count, self.key = count, key  # key None: windows in order
        self._last = (-1, None)  # (epoch, order): a plain tuple keeps this picklable

    def __call__(self, epoch: int) -> np.ndarray:
        cached_epoch, order = self._last  # one read, so a racing thread can't mix entries
        if cached_epoch == epoch:
            return order
        if self.key is None:
            order = np.arange(self.count)
        else:
            order = np.random.default_rng([*self.key, epoch]).permutation(self.count)
        self._last = (epoch, order)
        return order


def _rows_of(global_rows: np.ndarray, process_index: int, process_count: int) -> np.ndarray:
    return global_rows[process_index::process_count]


class TrainBatchAtStep:
    """step -> this process's batch of one corpus; a pure function of the step."""

    def __init__(self, windows: WindowIndex, global_batch, seed, shuffle, process_index, process_count):
        self.windows = windows
        self.global_batch = global_batch
        self.steps_per_epoch = windows.count // global_batch
        self.process_index, self.process_count = process_index, process_count
        self._orders = _EpochOrders(windows.count, (WINDOW_ORDER_STREAM, seed) if shuffle else None)

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        epoch, step_in_epoch = divmod(int(step), self.steps_per_epoch)
        start = step_in_epoch * self.global_batch
        global_rows = self._orders(epoch)[start:start + self.global_batch]
        return self.windows.examples(_rows_of(global_rows, self.process_index, self.process_count))


class BlendBatchAtStep:
    """step -> this process's batch of a blend; a pure function of the step."""

    def __init__(self, windows: list[WindowIndex], weights, global_batch, seed, shuffle, process_index,
                 process_count):
        self.windows = windows
        self.global_batch = global_batch
        self.process_index, self.process_count = process_index, process_count
        self.schedule = BlendSchedule(weights)
        self._orders = [_EpochOrders(w.count, (BLEND_STREAM, seed, j) if shuffle else None)
                        for j, w in enumerate(windows)]

    def rows(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, window) of this process's rows of batch `step`."""
        first = int(step) * self.global_batch
        sources, ranks = self.schedule.assign(first, first + self.global_batch)
        sources = _rows_of(sources, self.process_index, self.process_count)
        ranks = _rows_of(ranks, self.process_index, self.process_count)
        windows = np.empty(len(sources), np.int64)
        for r, (j, k) in enumerate(zip(sources.tolist(), ranks.tolist())):
            epoch, index = divmod(k, self.windows[j].count)
            windows[r] = self._orders[j](epoch)[index]
        return sources, windows

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        sources, windows = self.rows(step)
        parts = [self.windows[j].row(w) for j, w in zip(sources.tolist(), windows.tolist())]
        return {**pack_rows(parts, self.windows[0].seq_len), "source_ids": sources.astype(np.int32)}


def iterate_steps(batch_at_step) -> grain.DatasetIterator:
    """An endless grain iterator over `batch_at_step(0), batch_at_step(1), ...`; its state is the
    step (`{'next_index': s}`), so checkpoints restore onto any process count."""
    dataset = grain.MapDataset.range(sys.maxsize).map(batch_at_step)
    # One thread prepares the next batches while the accelerator runs the current step (enough:
    # benchmarks/bench_loader.py measures far more batches per second than a step consumes).
    read_options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)
    return iter(dataset.to_iter_dataset(read_options))


def source_token_counts(batch: dict[str, np.ndarray], sources: int) -> np.ndarray:
    """Trained target tokens (loss_mask sum) of each source in `batch` (float64 [sources])."""
    per_row = np.asarray(batch["loss_mask"], np.float64).sum(axis=1)
    return np.bincount(np.asarray(batch["source_ids"]), weights=per_row, minlength=sources)
