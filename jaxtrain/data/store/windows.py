"""Packed windows over a `TokenSource`, read document slice by document slice, never the whole corpus.

Packing (concat-then-split): the documents, in `doc_order` (a seeded permutation for training),
form one virtual token stream that is cut into windows of `seq_len + 1` tokens with stride
`seq_len` (consecutive windows share one token, so every token but the first is a target exactly
once); the last, partial window is filled with the source's `pad_id`. The stream is never built:
the index keeps only the order (int64 per document) and the cumulative lengths, and window `w`
is found by a binary search in them and read as the few document slices it spans.

Window `w` gives one example:

  inputs, targets  int32 [L]  window[:-1], window[1:]
  segment_ids      int32 [L]  1, 2, ... numbering the documents within the row; 0 = padding
  positions        int32 [L]  0, 1, ... restarting at each segment (also at the row start)
  loss_mask      float32 [L]  1 where the target is in the input token's document (times the
                              source's own mask of the target token, for chat data), else 0
"""
from __future__ import annotations

import numpy as np

from jaxtrain.data.store.source import TokenSource


class WindowIndex:
    """The windows of `source` packed in `doc_order` (None: the source's own order)."""

    def __init__(self, source: TokenSource, seq_len: int, doc_order: np.ndarray | None = None):
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        lengths = np.asarray(source.document_lengths, np.int64)
        self.doc_order = (np.arange(len(lengths), dtype=np.int64) if doc_order is None
                          else np.asarray(doc_order, np.int64))
        if len(self.doc_order) != len(lengths):
            raise ValueError(f"{source.name}: a document order of {len(self.doc_order)} entries for "
                             f"{len(lengths)} documents")
        self.source, self.seq_len, self.pad_id = source, seq_len, int(source.pad_id)
        # starts[i]: where the i-th document of the order begins in the virtual stream
        self.starts = np.concatenate([[0], np.cumsum(lengths[self.doc_order])])
        self.total_tokens = int(self.starts[-1])
        self.count = max(1, -(-(self.total_tokens - 1) // seq_len))

    def row(self, window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One example's parts, which `pack_rows` turns into its fields: window `window`'s
        `seq_len + 1` tokens, which slot of the order each belongs to (-1: padding), and whether
        the source's own mask trains each of its `seq_len` targets (all True for a source without
        a mask). A negative `window` is all padding. The one place a source's mask meets a window,
        whether the window is read alone or in a blend."""
        if window < 0:
            return (np.full(self.seq_len + 1, self.pad_id, np.int32), np.full(self.seq_len + 1, -1, np.int64),
                    np.ones(self.seq_len, bool))
        tokens, slots, mask = self._read(window)
        # Example position i trains target token i + 1: the target's mask, not the input's.
        return tokens, slots, np.ones(self.seq_len, bool) if mask is None else mask[1:] > 0

    def _read(self, window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Window `window`'s tokens, their slots, and the source's loss mask of each (None when
        the source has none)."""
        width = self.seq_len + 1
        tokens = np.full(width, self.pad_id, np.int32)
        slots = np.full(width, -1, np.int64)
        mask = np.zeros(width, np.uint8) if self.source.has_loss_mask else None
        begin = window * self.seq_len
        end = min(begin + width, self.total_tokens)
        slot = int(np.searchsorted(self.starts, begin, side="right")) - 1
        while begin < end:
            doc_start, doc_end = int(self.starts[slot]), int(self.starts[slot + 1])
            stop = min(end, doc_end)
            if stop > begin:  # (an empty document spans nothing)
                document = int(self.doc_order[slot])
                here = slice(begin - window * self.seq_len, stop - window * self.seq_len)
                tokens[here] = self.source.tokens(document, begin - doc_start, stop - doc_start)
                slots[here] = slot
                if mask is not None:
                    mask[here] = self.source.loss_mask(document, begin - doc_start, stop - doc_start)
                begin = stop
            slot += 1
        return tokens, slots, mask

    def examples(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """One example per entry of `rows` (window indices); a negative index is an all-padding row."""
        return pack_rows([self.row(int(window)) for window in np.asarray(rows, np.int64)], self.seq_len)


def pack_rows(rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]], seq_len: int) -> dict[str, np.ndarray]:
    """Examples from `WindowIndex.row` parts, one per row: tokens and document slots [L + 1]
    (-1 padding), and `target_ok` [L], which multiplies the loss mask of each target."""
    if rows:
        tokens, doc, target_ok = (np.stack(parts) for parts in zip(*rows))
    else:
        tokens, doc = np.zeros((0, seq_len + 1), np.int32), np.zeros((0, seq_len + 1), np.int64)
        target_ok = np.ones((0, seq_len), bool)
    length = tokens.shape[1] - 1
    doc_in, doc_out = doc[:, :-1], doc[:, 1:]
    real = doc_in >= 0
    starts = np.ones(doc_in.shape, bool)
    starts[:, 1:] = doc_in[:, 1:] != doc_in[:, :-1]
    column = np.arange(length)
    last_start = np.maximum.accumulate(np.where(starts, column, 0), axis=1)
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "segment_ids": np.where(real, np.cumsum(starts, axis=1), 0).astype(np.int32),
        "positions": np.where(real, column - last_start, 0).astype(np.int32),
        "loss_mask": (real & (doc_out == doc_in) & target_ok).astype(np.float32),
    }
