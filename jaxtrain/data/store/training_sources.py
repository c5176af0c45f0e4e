"""What `DataConfig` names -> `TokenSource`s, checked before a run touches its workdir.

An entry is a raw corpus file (`.txt`, `.jsonl`, a `save_to_disk` folder: tokenized in memory at
start, `[bos] + tokens + [eos]` per document), a token store folder (`python -m jaxtrain.data
prepare`), or a Megatron-LM prefix (`prefix.bin` + `prefix.idx`; naming either file also works).
Raw files of one list form one source, in the order given; stores and prefixes are read slice
by slice from their files.
"""
from __future__ import annotations

import pathlib
from typing import Sequence

import numpy as np

from jaxtrain.data.store.memory_source import text_files_source
from jaxtrain.data.store.reopening_source import ReopeningSource
from jaxtrain.data.text_files import BUNDLED_ROOT, resolve_path

_DATASETS_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # save_to_disk folders


def _open_store(path: str, tokenizer: str):
    """A token store or Megatron prefix; Megatron files record no vocabulary or pad id, so they
    take DataConfig.tokenizer's."""
    from jaxtrain.data.store.readers import open_source
    from jaxtrain.data.tokenizer import load_tokenizer

    if pathlib.Path(path).is_dir():
        source = ReopeningSource(open_source, path)
    else:
        ids = load_tokenizer(tokenizer)
        source = ReopeningSource(open_source, path, vocab_size=ids.vocab_size, pad_id=ids.pad_id)
    len(source)  # opened here, so a bad file is reported before anything else
    return source


def _locate(entry: str) -> tuple[str, str]:
    """('raw' | 'store', path) of one DataConfig entry; raw paths as resolve_path finds them."""
    for base in (pathlib.Path.cwd(), BUNDLED_ROOT):
        given = pathlib.Path(entry).expanduser()
        full = given if given.is_absolute() else base / given
        if full.suffix in (".bin", ".idx") and full.with_suffix(".idx").exists():
            return "store", str(full.with_suffix(""))  # a Megatron file named instead of its prefix
        if not full.exists() and full.with_name(full.name + ".idx").exists():
            return "store", str(full)  # a Megatron prefix
        if full.is_dir() and not any((full / m).exists() for m in _DATASETS_MARKERS):
            return "store", str(full)
    return "raw", str(resolve_path(entry))  # raises FileNotFoundError naming the entry


class ConcatSource:
    """Several sources' documents one after another, as one source."""

    def __init__(self, parts: Sequence):
        self.parts = list(parts)
        self.name = ", ".join(p.name for p in self.parts)
        first = self.parts[0]
        self.vocab_size = max((p.vocab_size or 0 for p in self.parts), default=0) or None
        self.tokenizer_id, self.pad_id = first.tokenizer_id, first.pad_id
        self.has_loss_mask = any(p.has_loss_mask for p in self.parts)
        self._first_doc = np.cumsum([0] + [len(p) for p in self.parts])
        self.document_lengths = np.concatenate([np.asarray(p.document_lengths, np.int64) for p in self.parts])

    def __len__(self) -> int:
        return int(self._first_doc[-1])

    def _part(self, document: int):
        k = int(np.searchsorted(self._first_doc, document, side="right")) - 1
        return self.parts[k], document - int(self._first_doc[k])

    def tokens(self, document: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        part, local = self._part(document)
        return part.tokens(local, start, stop)

    @property
    def max_token_id(self) -> int:
        from jaxtrain.data.store.readers import _max_token_id

        return max(_max_token_id(p) for p in self.parts)

    def loss_mask(self, document: int, start: int = 0, stop: int | None = None):
        part, local = self._part(document)
        mask = part.loss_mask(local, start, stop)
        if mask is None and self.has_loss_mask:  # a maskless part: every token counts
            length = (int(part.document_lengths[local]) if stop is None else stop) - start
            mask = np.ones(length, np.uint8)
        return mask


def corpus_source(entries: Sequence[str], tokenizer: str, text_field: str):
    """One source from a DataConfig file list (raw files together, stores/prefixes each)."""
    if not entries:
        raise ValueError("empty corpus: (no files given)")
    parts, raw = [], []  # consecutive raw files form one in-memory part; the order is kept
    for kind, path in [_locate(e) for e in entries] + [("end", None)]:
        if kind == "raw":
            raw.append(path)
            continue
        if raw:
            parts.append(text_files_source(raw, tokenizer, text_field))
            raw = []
        if kind == "store":
            parts.append(_open_store(path, tokenizer))
    source = parts[0] if len(parts) == 1 else ConcatSource(parts)
    check_source(source, tokenizer)
    return source


def parse_blend(blend: Sequence) -> list[tuple[float, str]]:
    """DataConfig.blend (`weight, path, weight, path, ...`, as Megatron's --data-path) -> pairs."""
    items = list(blend)
    if len(items) % 2:
        raise ValueError(f"DataConfig.blend must alternate weights and sources (weight, path, ...), got "
                         f"{len(items)} items: {items}")
    pairs = []
    for weight, path in zip(items[0::2], items[1::2]):
        try:
            value = float(weight)
        except (TypeError, ValueError):
            raise ValueError(f"DataConfig.blend: {weight!r} (before {path!r}) is not a weight; write "
                             f"weight, path pairs") from None
        if not isinstance(path, str):
            raise ValueError(f"DataConfig.blend: {path!r} (after weight {weight!r}) is not a path")
        if not np.isfinite(value) or value <= 0:
            raise ValueError(f"{path}: blend weight {weight!r} must be a positive number")
        pairs.append((value, path))
    return pairs


def check_source(source, tokenizer: str) -> None:
    """An empty source, or one tokenized with another tokenizer than DataConfig.tokenizer: one
    line naming it."""
    if len(source) == 0 or int(np.asarray(source.document_lengths).sum()) == 0:
        raise ValueError(f"{source.name}: empty source (no tokens)")
    if source.tokenizer_id is not None and source.tokenizer_id != tokenizer_identity(tokenizer):
        raise ValueError(f"{source.name}: tokenized with {source.tokenizer_id!r}, but DataConfig.tokenizer is "
                         f"{tokenizer!r}: bind DataConfig.tokenizer to the store's tokenizer")


def tokenizer_identity(spec: str) -> str:
    """How stores record a tokenizer (jaxtrain/data/store/tokenizer_identity.py)."""
    from jaxtrain.data.store.tokenizer_identity import tokenizer_identity as identity

    return identity(spec)


def check_fits_vocabulary(sources: Sequence, vocab_size: int) -> None:
    """Every id a source holds must have an embedding row (an id past the table embeds as NaN):
    stores answer from their recorded maximum id, Megatron data from one cached scan."""
    from jaxtrain.data.store.readers import check_fits_vocabulary as check_one

    for source in sources:
        check_one(source, vocab_size)
