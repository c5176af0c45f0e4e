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

    def read(self, window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Window `window`'s `seq_len + 1` tokens, which slot of the order each belongs to (-1:
        padding), and the source's loss mask of each (None when the source has none)."""
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
        rows = np.asarray(rows, np.int64)
        width = self.seq_len + 1
        tokens = np.full((len(rows), width), self.pad_id, np.int32)
        doc = np.full((len(rows), width), -1, np.int64)
        target_ok = np.ones((len(rows), self.seq_len), bool)
        for i, window in enumerate(rows):
            if window >= 0:
                tokens[i], doc[i], mask = self.read(int(window))
                if mask is not None:
                    target_ok[i] = mask[1:] > 0
        return pack_rows(tokens, doc, target_ok)


def pack_rows(tokens: np.ndarray, doc: np.ndarray, target_ok: np.ndarray) -> dict[str, np.ndarray]:
    """Examples from windows [rows, L + 1] of tokens and their document slots (-1 padding);
    `target_ok` [rows, L] multiplies the loss mask of each target."""
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
