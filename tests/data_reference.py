"""The references the data tests compare the production loader against: the one packer
(jaxtrain/data/store/windows.py: the whole corpus concatenated, then walked token by token), the
blend's per-sample source assignment (jaxtrain/data/store/blend.py, in exact fractions), and a
blend's rows built from the two (jaxtrain/data/store/loader.py's documented orders).

Windows hold `seq_len + 1` tokens with stride `seq_len` (consecutive windows share one token);
the last one is filled with `pad`. Per position: segment ids number the documents within the row
(0 = padding), positions restart at each document and at the row start, and the loss mask is 1
where the target belongs to the input token's document (times the document's own per-token mask
of the target, when given).
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np

FIELDS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
# The seeded random streams loader.py documents: a blend's document order of source j is
# default_rng([DOC_ORDER_STREAM, seed, BLEND_STREAM, j]), its window order of epoch e
# default_rng([BLEND_STREAM, seed, j, e]); written out here, so a changed stream is caught.
DOC_ORDER_STREAM, BLEND_STREAM = 0, 2


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


def brute_force_assignment(weights, count):
    """The rule written out sample by sample in exact fractions: the source with the largest
    `w * (i + 1) - realized` (the first on a tie; Megatron's helpers.cpp uses max(i, 1), which can
    drift past one sample). A weight is the decimal the config writes."""
    exact = [Fraction(repr(float(w))) for w in weights]
    share = [w / sum(exact) for w in exact]
    realized = [0] * len(share)
    sources, ranks = [], []
    for i in range(count):
        lags = [w * (i + 1) - n for w, n in zip(share, realized)]
        j = lags.index(max(lags))
        sources.append(j)
        ranks.append(realized[j])
        realized[j] += 1
    return np.array(sources), np.array(ranks)


def reference_blend_rows(sources, weights, seq_len: int, seed: int, count: int) -> list[dict]:
    """Global samples 0 ... count - 1 of a shuffled blend of `sources` ((documents, masks or None,
    pad id) each), from the documented rules alone: source `j`'s documents in its seeded order,
    packed by the reference packer; the `k`-th sample of `j` (the assignment's rank) is window
    `k mod windows` of epoch `k div windows`'s seeded order. Each row also names its source."""
    packed = []
    for j, (docs, masks, pad) in enumerate(sources):
        order = np.random.default_rng([DOC_ORDER_STREAM, seed, BLEND_STREAM, j]).permutation(len(docs))
        packed.append(reference_windows([docs[d] for d in order], seq_len, pad,
                                        None if masks is None else [masks[d] for d in order]))
    assigned, ranks = brute_force_assignment(weights, count)
    rows = []
    for j, k in zip(assigned.tolist(), ranks.tolist()):
        epoch, index = divmod(k, len(packed[j]))
        window = np.random.default_rng([BLEND_STREAM, seed, j, epoch]).permutation(len(packed[j]))[index]
        rows.append({**packed[j][window], "source_ids": j})
    return rows
