"""The token store on disk, and `TokenStore`, its reader.

A store is a directory written by `python -m jaxtrain.data prepare`:

  tokens.bin      every document's tokens back to back, uint16 (vocabulary <= 65536) or uint32
  offsets.npy     int64 [documents + 1]: document d is tokens[offsets[d]:offsets[d + 1]]
  loss_mask.bin   uint8, one per token (only for chat / prompt_completion data): 1 where the token
                  is trained on as a target
  metadata.json   written last: what the files hold (see `StoreMetadata`); a directory without it
                  is not a store (a prepare that did not finish)

Documents are training-ready: text documents are `[bos] + tokens + [eos]` exactly as
jaxtrain/data/packing.py builds them, chat documents are the chat template's own rendering.
Opening a store reads its metadata and checks sizes and offsets; tokens and masks are read by
positioned reads of the slices asked for (file_array.py: a memory map's touched pages would stay
in the process's RSS), so nothing grows with the corpus but the offsets (8 bytes per document).
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np

from jaxtrain.data.store.errors import DataInputError
from jaxtrain.data.store.file_array import FileArray

FORMAT_NAME = "jaxtrain-token-store"
FORMAT_VERSION = 1
TOKENS_FILE = "tokens.bin"
OFFSETS_FILE = "offsets.npy"
LOSS_MASK_FILE = "loss_mask.bin"
METADATA_FILE = "metadata.json"
DATA_FORMATS = ("text", "chat", "prompt_completion")
_CHECK_CHUNK = 1 << 22  # offsets checked this many at a time: memory stays bounded


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@dataclasses.dataclass(frozen=True)
class StoreMetadata:
    dtype: str  # "uint16" | "uint32"
    tokenizer_id: str  # "bytes" or "<tokenizer dir name>@sha256:<hash of its tokenizer files>"
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int
    documents: int
    tokens: int
    max_token_id: int  # so a model's vocabulary is checked without reading the tokens
    data_format: str  # text | chat | prompt_completion
    has_loss_mask: bool
    sources: tuple[dict, ...]  # {"path", "bytes", "mtime_ns"} of each input file
    text_field: str = "text"
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        fields["sources"] = list(self.sources)
        return json.dumps(fields, indent=1, sort_keys=True) + "\n"

    @classmethod
    def read(cls, path: pathlib.Path) -> "StoreMetadata":
        where = path / METADATA_FILE
        try:
            fields = json.loads(where.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise DataInputError(f"{where}: unreadable token store metadata ({err})") from err
        if not isinstance(fields, dict) or fields.get("format") != FORMAT_NAME:
            raise DataInputError(f"{where}: not a {FORMAT_NAME} metadata file")
        if fields.get("version") != FORMAT_VERSION:
            raise DataInputError(
                f"{where}: store format version {fields.get('version')!r}, this jaxtrain reads "
                f"version {FORMAT_VERSION}; prepare the store again"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(n for n in names if n not in fields and n not in ("text_field",))
        if missing:
            raise DataInputError(f"{where}: metadata lacks {', '.join(missing)}")
        fields = {k: v for k, v in fields.items() if k in names}
        fields["sources"] = tuple(fields["sources"])
        meta = cls(**fields)
        if meta.dtype not in ("uint16", "uint32") or meta.data_format not in DATA_FORMATS:
            raise DataInputError(f"{where}: unknown dtype {meta.dtype!r} or format {meta.data_format!r}")
        return meta


def is_complete_store(path: pathlib.Path) -> bool:
    return (pathlib.Path(path) / METADATA_FILE).is_file()


def _expect_size(path: pathlib.Path, size: int, what: str) -> None:
    if not path.is_file():
        raise DataInputError(f"{path}: missing ({what})")
    actual = path.stat().st_size
    if actual != size:
        raise DataInputError(
            f"{path}: {actual} bytes, the metadata says {size} ({what}); the store is truncated or "
            "corrupt: prepare it again"
        )


def check_offsets(offsets: np.ndarray, tokens: int, where: pathlib.Path) -> None:
    """offsets start at 0, end at the token count, and never decrease (checked in chunks)."""
    if len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != tokens:
        raise DataInputError(
            f"{where}: document offsets must run from 0 to the token count {tokens}; the store is corrupt"
        )
    for start in range(0, len(offsets) - 1, _CHECK_CHUNK):
        chunk = np.asarray(offsets[start:start + _CHECK_CHUNK + 1])
        bad = np.flatnonzero(np.diff(chunk) < 0)
        if len(bad):
            raise DataInputError(
                f"{where}: document offsets decrease at document {start + int(bad[0])}; the store is corrupt"
            )


class TokenStore:
    """A `TokenSource` (jaxtrain/data/store/source.py) over a store directory, read by positioned reads."""

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        self.name = str(path)
        if not self.path.is_dir():
            raise DataInputError(f"{self.path}: no such token store directory")
        if not is_complete_store(self.path):
            raise DataInputError(
                f"{self.path}: not a complete token store (no {METADATA_FILE}: a prepare that did "
                "not finish?); run prepare again"
            )
        meta = self.metadata = StoreMetadata.read(self.path)
        dtype = np.dtype(meta.dtype)
        _expect_size(self.path / TOKENS_FILE, meta.tokens * dtype.itemsize, "tokens")
        offsets_path = self.path / OFFSETS_FILE
        if not offsets_path.is_file():
            raise DataInputError(f"{offsets_path}: missing (document offsets)")
        self._offsets = _npy_array(offsets_path, np.dtype(np.int64), meta.documents + 1)
        check_offsets(self._offsets, meta.tokens, offsets_path)
        self._tokens = FileArray(self.path / TOKENS_FILE, dtype, meta.tokens)
        self._mask = None
        if meta.has_loss_mask:
            _expect_size(self.path / LOSS_MASK_FILE, meta.tokens, "loss mask")
            self._mask = FileArray(self.path / LOSS_MASK_FILE, np.uint8, meta.tokens)
        self.vocab_size = meta.vocab_size
        self.tokenizer_id = meta.tokenizer_id
        self.pad_id = meta.pad_id
        self.bos_id, self.eos_id = meta.bos_id, meta.eos_id
        self.has_loss_mask = meta.has_loss_mask
        self._lengths = None

    def __len__(self) -> int:
        return self.metadata.documents

    @property
    def document_lengths(self) -> np.ndarray:
        if self._lengths is None:  # (in chunks: the offsets are not held as well)
            lengths = np.empty(len(self), np.int64)
            for start in range(0, len(self), _CHECK_CHUNK):
                lengths[start:start + _CHECK_CHUNK] = np.diff(self._offsets[start:start + _CHECK_CHUNK + 1])
            self._lengths = lengths
        return self._lengths

    def _span(self, document: int, start: int, stop: int | None) -> tuple[int, int]:
        if not 0 <= document < len(self):
            raise IndexError(f"{self.name}: document {document} of {len(self)}")
        begin, end = (int(x) for x in self._offsets[document:document + 2])
        stop = end - begin if stop is None else min(stop, end - begin)
        return begin + max(start, 0), begin + max(stop, start, 0)

    def tokens(self, document: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        lo, hi = self._span(document, start, stop)
        return self._tokens[lo:hi].astype(np.int32)

    def loss_mask(self, document: int, start: int = 0, stop: int | None = None) -> np.ndarray | None:
        if self._mask is None:
            return None
        lo, hi = self._span(document, start, stop)
        return self._mask[lo:hi]

    @property
    def max_token_id(self) -> int:
        """The largest id in the store (recorded by prepare): checked against a model's vocabulary."""
        return self.metadata.max_token_id

    def __repr__(self) -> str:
        return f"TokenStore({self.name!r}: {len(self)} documents, {self.metadata.tokens} tokens)"


def _npy_array(path: pathlib.Path, dtype: np.dtype, count: int) -> FileArray:
    """The 1-D `.npy` array at `path`, checked to be `count` items of `dtype`, read by positioned
    reads (its header parsed here; the data starts where the header ends)."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, _, found = read_header(f)
            start = f.tell()
    except (ValueError, OSError) as err:
        raise DataInputError(f"{path}: unreadable document offsets ({err})") from err
    if found != dtype or shape != (count,):
        raise DataInputError(f"{path}: {found} {shape}, expected {dtype} ({count},); the store is corrupt")
    _expect_size(path, start + count * dtype.itemsize, "document offsets")
    return FileArray(path, dtype, count, offset=start)
