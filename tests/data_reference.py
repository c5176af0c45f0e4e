"""The one reference packer the data tests compare the production packer against
(jaxtrain/data/store/windows.py): the whole corpus concatenated, then walked token by token.

Windows hold `seq_len + 1` tokens with stride `seq_len` (consecutive windows share one token);
the last one is filled with `pad`. Per position: segment ids number the documents within the row
(0 = padding), positions restart at each document and at the row start, and the loss mask is 1
where the target belongs to the input token's document (times the document's own per-token mask
of the target, when given).
"""
from __future__ import annotations

FIELDS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


def reference_windows(docs, seq_len: int, pad: int, masks=None) -> list[dict[str, list]]:
    """Rows of the documents `docs` (token sequences, in stream order, framed as the source
    stores them); `masks`: per-document per-token 0/1 lists, or None (every token counts)."""
    stream, owner, keep = [], [], []
    for number, doc in enumerate(docs):
        stream += [int(t) for t in doc]
        owner += [number] * len(doc)
        keep += [int(m) for m in masks[number]] if masks is not None else [1] * len(doc)
    rows = []
    # A stream of at most one token still gives one (padded, untrained) window: WindowIndex.count
    # is at least 1, so an index is never empty (runs refuse empty sources before they get here).
    for start in range(0, max(len(stream) - 1, 1), seq_len):
        tokens = stream[start:start + seq_len + 1]
        owners = owner[start:start + seq_len + 1]
        kept = keep[start:start + seq_len + 1]
        fill = seq_len + 1 - len(tokens)
        tokens, owners, kept = tokens + [pad] * fill, owners + [None] * fill, kept + [0] * fill
        row = {name: [] for name in FIELDS}
        segment = position = 0
        for i in range(seq_len):
            if owners[i] is None:
                seg, pos = 0, 0
            else:
                if i == 0 or owners[i] != owners[i - 1]:
                    segment, position = segment + 1, 0
                else:
                    position += 1
                seg, pos = segment, position
            row["inputs"].append(tokens[i])
            row["targets"].append(tokens[i + 1])
            row["segment_ids"].append(seg)
            row["positions"].append(pos)
            same_document = owners[i] is not None and owners[i + 1] == owners[i]
            row["loss_mask"].append(float(same_document and kept[i + 1] > 0))
        rows.append(row)
    return rows
