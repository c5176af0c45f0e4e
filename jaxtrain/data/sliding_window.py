"""Sliding-window evaluation windows over one long token stream.

Window w covers inputs t[b : b+L] with b = w * stride and predicts t[b+1 : b+L+1]. The first
window scores all its targets; each later window scores only the targets the previous one
did not reach (its last `stride` ones), so every token after the first is scored exactly once
and, past the first window, always with at least L - stride tokens of context.
"""
from __future__ import annotations

import numpy as np


def sliding_windows(stream: np.ndarray, seq_len: int, stride: int, pad_id: int) -> list[dict]:
    if not 0 < stride <= seq_len:
        raise ValueError(f"stride must be in [1, seq_len={seq_len}], got {stride}")
    n = len(stream)
    if n < 2:
        raise ValueError(f"need at least 2 tokens to evaluate, got {n}")
    windows, scored_up_to = [], 0  # targets with index <= scored_up_to are done (index 0 is never a target)
    begin = 0
    while scored_up_to < n - 1:
        chunk = stream[begin: begin + seq_len + 1]
        valid = len(chunk) - 1
        inputs = np.full(seq_len, pad_id, np.int32)
        targets = np.full(seq_len, pad_id, np.int32)
        inputs[:valid], targets[:valid] = chunk[:-1], chunk[1:]
        target_index = begin + 1 + np.arange(seq_len)
        mask = (np.arange(seq_len) < valid) & (target_index > scored_up_to)
        windows.append(dict(inputs=inputs, targets=targets, segment_ids=np.ones(seq_len, np.int32),
                            positions=np.arange(seq_len, dtype=np.int32), loss_mask=mask.astype(np.float32)))
        scored_up_to = begin + valid
        begin += stride
    return windows


def batch_windows(windows: list[dict], batch_size: int) -> list[dict]:
    """Stacks windows into batches, padding the last with rows whose loss mask is zero."""
    batches = []
    for start in range(0, len(windows), batch_size):
        rows = windows[start: start + batch_size]
        rows = rows + [{k: np.zeros_like(v) for k, v in rows[0].items()}] * (batch_size - len(rows))
        batches.append({k: np.stack([r[k] for r in rows]) for k in rows[0]})
    return batches
