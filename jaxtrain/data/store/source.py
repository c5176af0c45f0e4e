"""What training reads from: a `TokenSource` is a collection of tokenized documents, read by
index and slice from files (positioned reads), never held whole.

Every kind of source gives the same view: a token store written by `python -m jaxtrain.data
prepare` (jaxtrain/data/store/), a Megatron-LM indexed dataset (`prefix.bin` + `prefix.idx`), or
raw text files tokenized in memory (small corpora). Documents are training-ready: whatever the
source adds around a document (bos/eos for text, the chat template's own specials) is already in
its tokens, so packing never adds tokens of its own.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np


class TokenSource(Protocol):
    name: str  # how messages and metrics name the source (a path or prefix)
    vocab_size: int | None  # the tokenizer's vocabulary, None where the format does not say (Megatron)
    tokenizer_id: str | None  # the tokenizer's identity as the store recorded it, None if unknown
    pad_id: int  # the id packing fills partial windows with
    has_loss_mask: bool  # whether documents carry a per-token loss mask (chat, prompt_completion)

    def __len__(self) -> int:
        """The number of documents."""

    @property
    def document_lengths(self) -> np.ndarray:
        """int64 [documents]: each document's length in tokens."""

    def tokens(self, document: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """int32 copy of tokens [start, stop) of one document."""

    def loss_mask(self, document: int, start: int = 0, stop: int | None = None) -> np.ndarray | None:
        """uint8 [stop - start]: 1 where the token is trained on as a target, None when the
        source has no mask (every token counts)."""
