"""Megatron-LM indexed datasets (`prefix.bin` + `prefix.idx`, the "MMIDIDX" memory-mapped format),
read as they are, and a writer that produces the same bytes Megatron's `_IndexWriter` does.

`.idx` layout (little-endian), as megatron/core/datasets/indexed_dataset.py writes it:

  9 bytes  magic b"MMIDIDX\\x00\\x00"
  uint64   version, 1
  uint8    dtype code of the .bin tokens (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
           6 float64, 7 float32, 8 uint16)
  uint64   S, the number of sequences
  uint64   D, the number of document-index entries (documents + 1)
  int32    [S] sequence lengths in tokens
  int64    [S] sequence pointers: byte offsets into .bin
  int64    [D] document indices: sequence boundaries of the documents, starting at 0
  (int8    [S] sequence modes, multimodal datasets only: ignored here)

A document is the sequences between two consecutive document indices, read as one run of tokens.
Megatron's `--append-eod` put the end-of-document id into the tokens; we add nothing.
"""
from __future__ import annotations

import json
import os
import pathlib
import struct

import numpy as np

from jaxtrain.data.store.errors import DataInputError
from jaxtrain.data.store.file_array import FileArray

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
               6: np.float64, 7: np.float32, 8: np.uint16}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, document-index entries
_CHUNK = 1 << 24  # tokens scanned at a time for the max id
_INDEX_CHUNK = 1 << 22  # index entries checked at a time at open


def is_megatron_prefix(prefix: str | os.PathLike) -> bool:
    return os.path.isfile(f"{prefix}.bin") and os.path.isfile(f"{prefix}.idx")


def code_of(dtype) -> int:
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == np.dtype(dtype):
            return code
    raise ValueError(f"Megatron indexed datasets cannot hold {np.dtype(dtype)} tokens")


class MegatronIndexedDataset:
    """A `TokenSource` over `prefix.bin`/`prefix.idx`: the index read and checked at open, the
    `.bin` read slice by slice (positioned reads).

    `vocab_size` is None unless given (the files do not say); `pad_id` only fills partial windows
    whose loss is masked, so any id of the vocabulary serves.
    """

    tokenizer_id = None
    has_loss_mask = False

    def __init__(self, prefix: str | os.PathLike, vocab_size: int | None = None, pad_id: int = 0):
        self.prefix = str(prefix)
        self.name = self.prefix
        self.vocab_size, self.pad_id = vocab_size, pad_id
        idx_path, bin_path = pathlib.Path(f"{prefix}.idx"), pathlib.Path(f"{prefix}.bin")
        for path in (idx_path, bin_path):
            if not path.is_file():
                raise DataInputError(f"{path}: missing (a Megatron dataset is prefix.bin + prefix.idx)")
        self._idx_path, self._bin_path = idx_path, bin_path
        size = idx_path.stat().st_size
        with open(idx_path, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < _HEADER.size:
            raise DataInputError(f"{idx_path}: {size} bytes, shorter than the {_HEADER.size}-byte header")
        magic, version, code, sequences, entries = _HEADER.unpack(head)
        if magic != MAGIC:
            raise DataInputError(f"{idx_path}: not a Megatron MMIDIDX index (magic {magic!r})")
        if version != VERSION:
            raise DataInputError(f"{idx_path}: index version {version}, only version {VERSION} is known")
        if code not in DTYPE_CODES:
            raise DataInputError(f"{idx_path}: unknown dtype code {code} (known: 1..8)")
        self.dtype = np.dtype(DTYPE_CODES[code])
        if self.dtype.kind == "f":
            raise DataInputError(f"{idx_path}: dtype {self.dtype} cannot hold token ids")
        needed = _HEADER.size + sequences * (4 + 8) + entries * 8
        if size < needed or entries < 1:
            raise DataInputError(
                f"{idx_path}: {size} bytes, but its header announces {sequences} sequences and "
                f"{entries} document-index entries ({needed} bytes); the index is truncated or corrupt")
        # The index is read into memory (O(sequences)), the .bin by positioned reads (file_array.py:
        # a memory map's touched pages would stay in the process's RSS).
        at = _HEADER.size
        self._doc_index = FileArray(idx_path, np.int64, entries, at + 12 * sequences)[:]
        self._check(sequences, FileArray(idx_path, np.int32, sequences, at),
                    FileArray(idx_path, np.int64, sequences, at + 4 * sequences), bin_path.stat().st_size)
        self._bin = FileArray(bin_path, self.dtype, int(self._starts[-1]))
        self._max_id = None

    def _check(self, sequences: int, lengths: FileArray, pointers: FileArray, bin_bytes: int) -> None:
        """Document indices rise from 0 to the sequence count, lengths are not negative, the
        pointers are the sequences back to back, the .bin holds them all; keeps `_starts`, each
        sequence's first token (the pointers are checked in chunks and not kept)."""
        where = self._idx_path
        doc_index = self._doc_index
        if doc_index[0] != 0 or doc_index[-1] != sequences or np.any(np.diff(doc_index) < 0):
            raise DataInputError(
                f"{where}: document indices must rise from 0 to the sequence count {sequences}; corrupt index")
        self._starts = np.zeros(sequences + 1, np.int64)
        for first, chunk in lengths.chunks(_INDEX_CHUNK):
            if np.any(chunk < 0):
                raise DataInputError(
                    f"{where}: negative sequence length at sequence {first + int(np.argmax(chunk < 0))}")
            np.cumsum(chunk, out=self._starts[first + 1:first + 1 + len(chunk)])
            self._starts[first + 1:first + 1 + len(chunk)] += self._starts[first]
        for first, chunk in pointers.chunks(_INDEX_CHUNK):
            expected = self._starts[first:first + len(chunk)] * self.dtype.itemsize
            bad = np.flatnonzero(chunk != expected)
            if len(bad):
                raise DataInputError(
                    f"{where}: sequence {first + int(bad[0])} points at byte {int(chunk[bad[0]])}, expected "
                    f"{int(expected[bad[0]])} (sequences back to back); corrupt index")
        expected = int(self._starts[-1]) * self.dtype.itemsize
        if bin_bytes != expected:
            raise DataInputError(
                f"{self._bin_path}: {bin_bytes} bytes, the index describes {expected}; the .bin is "
                "truncated or does not belong to this .idx")

    def __len__(self) -> int:
        return len(self._doc_index) - 1

    @property
    def document_lengths(self) -> np.ndarray:
        return self._starts[self._doc_index[1:]] - self._starts[self._doc_index[:-1]]

    def tokens(self, document: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        if not 0 <= document < len(self):
            raise IndexError(f"{self.name}: document {document} of {len(self)}")
        begin = int(self._starts[self._doc_index[document]])
        end = int(self._starts[self._doc_index[document + 1]])
        stop = end - begin if stop is None else min(stop, end - begin)
        return self._bin[begin + max(start, 0):begin + max(stop, start, 0)].astype(np.int32)

    def loss_mask(self, document: int, start: int = 0, stop: int | None = None) -> None:
        return None

    @property
    def max_token_id(self) -> int:
        """The largest token id in .bin: scanned in chunks once, then cached in a sidecar file
        `prefix.max_id.json` (keyed by the files' sizes and mtimes) where the folder is writable."""
        if self._max_id is not None:
            return self._max_id
        key = [[p.stat().st_size, p.stat().st_mtime_ns] for p in (self._idx_path, self._bin_path)]
        sidecar = pathlib.Path(f"{self.prefix}.max_id.json")
        try:
            cached = json.loads(sidecar.read_text())
            if cached.get("key") == key:
                self._max_id = int(cached["max_token_id"])
                return self._max_id
        except (OSError, ValueError, KeyError, AttributeError):
            pass
        top = -1
        for _, chunk in self._bin.chunks(_CHUNK):
            top = max(top, int(chunk.max()))
        self._max_id = top
        try:
            sidecar.write_text(json.dumps({"key": key, "max_token_id": top}))
        except OSError:
            pass  # a read-only dataset folder: scan again next time
        return top

    def __repr__(self) -> str:
        return f"MegatronIndexedDataset({self.prefix!r}: {len(self)} documents, {int(self._starts[-1])} tokens)"


class MegatronWriter:
    """Writes `prefix.bin` + `prefix.idx` byte for byte as Megatron's builder does: one sequence
    per document (`add_document`, `add_batch`), or several (`add_sequences`). Memory stays
    bounded: tokens, sequence lengths and document ends are streamed to temporary files, and the
    index is assembled from them in chunks at `commit`. Both files appear only then (the .idx
    renamed last)."""

    def __init__(self, prefix: str | os.PathLike, dtype=np.uint16):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        code_of(self.dtype)
        self._tmp = f".tmp-{os.getpid()}"
        pathlib.Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(pathlib.Path(self.prefix))
        self._bin = open(f"{self.prefix}.bin{self._tmp}", "wb")
        self._lengths = open(f"{self.prefix}.lengths{self._tmp}", "wb")  # int32 per sequence
        self._doc_ends = open(f"{self.prefix}.docs{self._tmp}", "wb")  # int64 per document
        self._sequences = 0
        self._documents = 0

    def add_sequences(self, sequences) -> None:
        """One document made of these token sequences."""
        for seq in sequences:
            seq = np.asarray(seq)
            self._bin.write(np.ascontiguousarray(seq, self.dtype).tobytes())
            self._lengths.write(np.array([len(seq)], np.int32).tobytes())
            self._sequences += 1
        self._doc_ends.write(np.array([self._sequences], np.int64).tobytes())
        self._documents += 1

    def add_document(self, tokens) -> None:
        self.add_sequences([tokens])

    def add_batch(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Many one-sequence documents at once (concatenated tokens and their lengths)."""
        self._bin.write(np.ascontiguousarray(tokens, self.dtype).tobytes())
        self._lengths.write(np.asarray(lengths, np.int32).tobytes())
        ends = np.arange(self._sequences + 1, self._sequences + len(lengths) + 1, dtype=np.int64)
        self._doc_ends.write(ends.tobytes())
        self._sequences += len(lengths)
        self._documents += len(lengths)

    def commit(self) -> str:
        from jaxtrain.data.store.store_writer import fsync_path

        for handle in (self._bin, self._lengths, self._doc_ends):
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
        lengths_path, ends_path = f"{self.prefix}.lengths{self._tmp}", f"{self.prefix}.docs{self._tmp}"
        idx_tmp = f"{self.prefix}.idx{self._tmp}"
        with open(idx_tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, code_of(self.dtype), self._sequences, self._documents + 1))
            _copy(lengths_path, f)
            at = 0  # byte pointer of the next sequence, carried across chunks
            with open(lengths_path, "rb") as lengths:
                while chunk := lengths.read(4 * _CHUNK):
                    sizes = np.frombuffer(chunk, np.int32).astype(np.int64) * self.dtype.itemsize
                    pointers = at + np.concatenate([[0], np.cumsum(sizes)[:-1]])
                    f.write(pointers.astype(np.int64).tobytes())
                    at += int(sizes.sum())
            f.write(np.zeros(1, np.int64).tobytes())
            _copy(ends_path, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(f"{self.prefix}.bin{self._tmp}", f"{self.prefix}.bin")
        os.replace(idx_tmp, f"{self.prefix}.idx")
        fsync_path(pathlib.Path(self.prefix).parent)
        for path in (lengths_path, ends_path):
            os.unlink(path)
        return self.prefix

    def abort(self) -> None:
        for handle in (self._bin, self._lengths, self._doc_ends):
            handle.close()
        for suffix in (".bin", ".idx", ".lengths", ".docs"):
            pathlib.Path(f"{self.prefix}{suffix}{self._tmp}").unlink(missing_ok=True)


def _remove_stale_temporaries(prefix: pathlib.Path) -> None:
    """Delete the `prefix.<part>.tmp-<pid>` files of writers that died (a killed prepare)."""
    from jaxtrain.data.store.store_writer import pid_alive

    for stale in prefix.parent.glob(f"{prefix.name}.*.tmp-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            stale.unlink(missing_ok=True)


def _copy(path: str, out) -> None:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            out.write(chunk)
