"""A `TokenSource` held in memory: documents given as int arrays (tests, small corpora), and the
adapter that turns raw text files into one (each document `[bos] + tokens + [eos]`, the framing
a token store's text documents get too (formats.py), so raw files and a store pack the same windows).

Raw files are tokenized at every start and held whole; corpora beyond a few hundred MB belong in
a token store (`python -m jaxtrain.data prepare`), which training reads slice by slice.
"""
from __future__ import annotations

import functools
import os
import pathlib
from typing import Sequence

import numpy as np

from jaxtrain.data.text_files import encode_to_array, read_documents, resolve_path


class MemorySource:
    """Documents back to back in one int32 array, with their offsets (and optional masks)."""

    def __init__(self, documents: Sequence[np.ndarray], masks: Sequence[np.ndarray] | None = None, *,
                 name: str = "memory", vocab_size: int | None = None, tokenizer_id: str | None = None,
                 pad_id: int = 0):
        lengths = np.array([len(d) for d in documents], np.int64)
        if masks is not None and [len(m) for m in masks] != lengths.tolist():
            raise ValueError(f"{name}: every document needs a loss mask of its own length")
        self.name, self.vocab_size, self.tokenizer_id, self.pad_id = name, vocab_size, tokenizer_id, int(pad_id)
        self._lengths = lengths
        self._offsets = np.concatenate([[0], np.cumsum(lengths)])
        self._tokens = np.concatenate([np.asarray(d, np.int32) for d in documents]) if len(documents) else \
            np.zeros(0, np.int32)
        self._masks = None if masks is None else np.concatenate([np.asarray(m, np.uint8) for m in masks])
        for array in (self._lengths, self._offsets, self._tokens, self._masks):
            if array is not None:
                array.flags.writeable = False  # shared by every reader (and the cache below)
        self.has_loss_mask = masks is not None
        self._max_token_id = int(self._tokens.max()) if len(self._tokens) else -1

    def __len__(self) -> int:
        return len(self._lengths)

    @property
    def document_lengths(self) -> np.ndarray:
        return self._lengths

    @property
    def max_token_id(self) -> int:
        """The largest id any document holds: checked against the model's vocabulary before a run."""
        return self._max_token_id

    def _span(self, document: int, start: int, stop: int | None) -> slice:
        begin = self._offsets[document]
        stop = self._lengths[document] if stop is None else stop
        return slice(int(begin + start), int(begin + stop))

    def tokens(self, document: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        return self._tokens[self._span(document, start, stop)].copy()

    def loss_mask(self, document: int, start: int = 0, stop: int | None = None) -> np.ndarray | None:
        if self._masks is None:
            return None
        return self._masks[self._span(document, start, stop)].copy()

    def __repr__(self) -> str:
        return f"MemorySource({self.name!r}, {len(self)} documents, {len(self._tokens)} tokens)"


# ----------------------------------------------------------------------------- raw text files


def _file_key(path: pathlib.Path) -> tuple[str, int, int]:
    stat = path.stat()  # so an edited file is read again rather than served from the cache
    return str(path), stat.st_mtime_ns, stat.st_size


def text_files_source(files: Sequence[str | os.PathLike], tokenizer_spec: str,
                      text_field: str = "text") -> MemorySource:
    """The documents of raw `.txt`/`.jsonl`/`save_to_disk` files, in file order, each framed as
    `[bos] + tokens + [eos]` with `tokenizer_spec`'s ids (cached while the files are unchanged)."""
    keys = tuple(_file_key(resolve_path(f)) for f in files)
    return _cached_text_source(keys, tokenizer_spec, text_field)


@functools.lru_cache(maxsize=4)
def _cached_text_source(file_keys: tuple[tuple[str, int, int], ...], tokenizer_spec: str,
                        text_field: str) -> MemorySource:
    from jaxtrain.data.tokenizer import load_tokenizer

    paths = [pathlib.Path(key[0]) for key in file_keys]
    texts = [doc for path in paths for doc in read_documents(path, text_field)]
    name = ", ".join(map(str, paths)) or "(no files given)"
    if not texts:
        raise ValueError(f"empty corpus: {name}")
    tokenizer = load_tokenizer(tokenizer_spec)
    bos, eos = np.int32(tokenizer.bos_id), np.int32(tokenizer.eos_id)
    documents = [np.concatenate([[bos], encode_to_array(tokenizer, text), [eos]]) for text in texts]
    # (no tokenizer_id: these tokens come from DataConfig.tokenizer itself)
    return MemorySource(documents, name=name, vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id)
