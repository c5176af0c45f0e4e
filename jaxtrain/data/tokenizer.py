"""Tokenizers with one small interface: `encode`, `decode`, `bos_id`, `eos_id`, `pad_id`, `vocab_size`.

`ByteTokenizer` needs no files (UTF-8 bytes are the ids); `HFTokenizer` wraps a tokenizer saved
in a local directory with `transformers` (never downloads). `load_tokenizer(spec)` picks one.
"""
from __future__ import annotations

import os
from typing import Protocol, Sequence


class Tokenizer(Protocol):
    bos_id: int
    eos_id: int
    pad_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes 0..255 are ids 0..255; three special ids follow them."""

    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens."""
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of each text."""
        return [list(text.encode("utf-8")) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; special ids are skipped, broken UTF-8 becomes U+FFFD."""
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (`save_pretrained` output)."""

    def __init__(self, path: str):
        from jaxtrain.extras import require

        # imported here: transformers is slow to import and an optional extra
        AutoTokenizer = require("transformers", f"the Hugging Face tokenizer at {path!r}").AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as err:  # transformers raises many kinds; keep the path in the message
            raise ValueError(f"cannot load a Hugging Face tokenizer from {path!r}: {err}") from err
        self.path = path
        if self._tok.eos_token_id is None:
            raise ValueError(
                f"tokenizer at {path!r} has no eos token; packing needs one to end documents"
            )
        self.eos_id = int(self._tok.eos_token_id)
        # Many causal LM tokenizers (GPT-2 style) have no separate bos/pad: reuse eos.
        bos, pad = self._tok.bos_token_id, self._tok.pad_token_id
        self.bos_id = self.eos_id if bos is None else int(bos)
        self.pad_id = self.eos_id if pad is None else int(pad)
        self.vocab_size = len(self._tok)  # counts added tokens, unlike `.vocab_size`

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without the special tokens the tokenizer might add."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of each text, by the Rust tokenizer's batch call when there is one (fast)."""
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is None:
            return [self.encode(text) for text in texts]
        batch_call = getattr(backend, "encode_batch_fast", backend.encode_batch)  # fast: no offsets
        return [encoding.ids for encoding in batch_call(list(texts), add_special_tokens=False)]

    @property
    def hf_tokenizer(self):
        """The transformers tokenizer itself (chat templates, offsets)."""
        return self._tok

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, skipping special tokens."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r})"


def load_tokenizer(spec: str) -> Tokenizer:
    """`"bytes"` gives the byte tokenizer; an existing directory gives its HF tokenizer."""
    if spec == "bytes":
        return ByteTokenizer()
    if os.path.isdir(spec):
        return HFTokenizer(spec)
    raise ValueError(
        f"unknown tokenizer {spec!r}: use 'bytes' or a local directory holding a "
        "Hugging Face tokenizer (from save_pretrained)"
    )
