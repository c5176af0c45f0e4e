"""Text corpora -> packed token windows -> grain iterators of numpy batches.

Packing (concat-then-split): each document becomes `[bos] + tokens + [eos]`; the documents are
concatenated (in a seeded shuffled order for training) into one int32 stream, held in memory,
which is cut into windows of `seq_len + 1` tokens with stride `seq_len` (consecutive windows
share one token, so every token but the first is a target exactly once). The last, partial
window is filled with `pad_id`. Window `w` gives one example:

  inputs, targets  int32 [L]  window[:-1], window[1:]
  segment_ids      int32 [L]  1, 2, ... numbering the documents within the row; 0 = padding
  positions        int32 [L]  0, 1, ... restarting at each segment (also at the row start)
  loss_mask      float32 [L]  1 where the target is in the input token's document, else 0

Training batch `s` of the global batch size G is `order[e][t*G:(t+1)*G]` with
`e, t = divmod(s, steps_per_epoch)` and `order[e]` a permutation of the windows seeded by
(seed, e); process `p` of `P` takes rows `p::P` of it. So each step's global batch is the same
whatever the process count, and the iterator state is just the step count.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import re
import sys
from typing import Sequence

import grain
import numpy as np

from jaxtrain.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]  # jaxtrain/data/ -> the repo
_DOC_ORDER_STREAM = 0  # separate seeded random streams for the document and window orders
_WINDOW_ORDER_STREAM = 1
_BLANK_LINES = re.compile(r"\n\s*\n")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    # Relative paths are looked up in the CWD, then in the repo root (the folder holding jaxtrain/).
    train_files: tuple[str, ...] = ("data/tiny_corpus/train.txt",)
    eval_files: tuple[str, ...] = ("data/tiny_corpus/valid.txt",)
    tokenizer: str = "bytes"  # "bytes" or a local Hugging Face tokenizer directory
    text_field: str = "text"  # the document field of .jsonl lines and datasets columns
    shuffle: bool = True  # shuffle document order once and window order every epoch

    def __post_init__(self):
        # Config systems hand over lists, and a lone string would iterate as characters.
        for name in ("train_files", "eval_files"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))


# ----------------------------------------------------------------------------- reading files


def resolve_path(path: str | os.PathLike) -> pathlib.Path:
    """`path` as given if it exists (absolute or from the CWD), else under the repo root."""
    given = pathlib.Path(path).expanduser()
    if given.exists():
        return given.resolve()
    if not given.is_absolute() and (REPO_ROOT / given).exists():
        return (REPO_ROOT / given).resolve()
    where = "" if given.is_absolute() else f" (looked in {os.getcwd()} and {REPO_ROOT})"
    raise FileNotFoundError(f"corpus file not found: {path}{where}")


def read_documents(path: pathlib.Path, text_field: str = "text") -> list[str]:
    """The non-empty, stripped documents of one .txt, .jsonl or `save_to_disk` folder."""
    if path.is_dir():
        docs = _read_datasets_folder(path, text_field)
    elif path.suffix == ".txt":
        docs = _BLANK_LINES.split(_read_utf8(path))
    elif path.suffix == ".jsonl":
        docs = _read_jsonl(path, text_field)
    else:
        raise ValueError(
            f"{path}: unsupported corpus file type {path.suffix!r}; "
            "use .txt, .jsonl or a folder written by datasets' save_to_disk"
        )
    return [doc.strip() for doc in docs if doc.strip()]


def _read_utf8(path: pathlib.Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not valid UTF-8 ({err})") from err


def _read_jsonl(path: pathlib.Path, text_field: str) -> list[str]:
    docs = []
    for line_number, line in enumerate(_read_utf8(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{line_number}: not valid JSON ({err.msg})") from err
        if not isinstance(record, dict) or text_field not in record:
            raise ValueError(f"{path}:{line_number}: no {text_field!r} field in this JSON line")
        if not isinstance(record[text_field], str):
            raise ValueError(f"{path}:{line_number}: field {text_field!r} is not a string")
        docs.append(record[text_field])
    return docs


def _read_datasets_folder(path: pathlib.Path, text_field: str) -> list[str]:
    try:
        import datasets  # optional: only needed for save_to_disk folders
    except ImportError as err:
        raise ImportError(
            f"reading the datasets folder {path} needs the `datasets` package: pip install datasets"
        ) from err
    dataset = datasets.load_from_disk(str(path))
    if isinstance(dataset, datasets.DatasetDict):
        raise ValueError(
            f"{path} holds several splits {sorted(dataset)}; name one split's folder instead"
        )
    if text_field not in dataset.column_names:
        raise ValueError(f"{path}: no column {text_field!r} (columns: {dataset.column_names})")
    docs = list(dataset[text_field])
    if not all(isinstance(doc, str) for doc in docs):
        raise ValueError(f"{path}: column {text_field!r} does not hold only strings")
    return docs


# ----------------------------------------------------------------------------- tokenizing


def _encode_to_array(tokenizer: Tokenizer, text: str) -> np.ndarray:
    if isinstance(tokenizer, ByteTokenizer):  # the UTF-8 bytes are the ids: skip the Python list
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
    return np.asarray(tokenizer.encode(text), dtype=np.int32)


def tokenize_text_stream(path: str | os.PathLike, tokenizer: Tokenizer | str) -> np.ndarray:
    """A whole raw text file as one int32 token stream: no paragraph splitting, no specials."""
    if isinstance(tokenizer, str):
        tokenizer = load_tokenizer(tokenizer)
    return _encode_to_array(tokenizer, _read_utf8(resolve_path(path)))


@dataclasses.dataclass(frozen=True)
class PackedStream:
    """All documents back to back; `doc_ids[i]` says which document token `i` belongs to."""

    tokens: np.ndarray  # int32 [N]
    doc_ids: np.ndarray  # int32 [N], 0, 1, ... in stream order
    pad_id: int


def pack_documents(documents: Sequence[str], tokenizer: Tokenizer) -> PackedStream:
    """`[bos] + tokens + [eos]` for each document, in the given order, concatenated."""
    bos, eos = np.int32(tokenizer.bos_id), np.int32(tokenizer.eos_id)
    pieces = [np.concatenate([[bos], _encode_to_array(tokenizer, doc), [eos]]) for doc in documents]
    lengths = [len(piece) for piece in pieces]
    tokens = np.concatenate(pieces).astype(np.int32)
    doc_ids = np.repeat(np.arange(len(pieces), dtype=np.int32), lengths)
    return PackedStream(tokens, doc_ids, int(tokenizer.pad_id))


def _file_key(path: pathlib.Path) -> tuple[str, int, int]:
    stat = path.stat()  # so an edited file is read again rather than served from the cache
    return str(path), stat.st_mtime_ns, stat.st_size


@functools.lru_cache(maxsize=4)
def _cached_stream(
    file_keys: tuple[tuple[str, int, int], ...],
    tokenizer_spec: str,
    text_field: str,
    doc_seed: int | None,
) -> PackedStream:
    paths = [pathlib.Path(key[0]) for key in file_keys]
    documents = [doc for path in paths for doc in read_documents(path, text_field)]
    if not documents:
        raise ValueError(f"empty corpus: {', '.join(map(str, paths)) or '(no files given)'}")
    if doc_seed is not None:
        order = np.random.default_rng([_DOC_ORDER_STREAM, doc_seed]).permutation(len(documents))
        documents = [documents[i] for i in order]
    stream = pack_documents(documents, load_tokenizer(tokenizer_spec))
    stream.tokens.flags.writeable = False  # shared by every caller of the cache
    stream.doc_ids.flags.writeable = False
    return stream


def load_stream(
    files: Sequence[str], tokenizer_spec: str, text_field: str, doc_seed: int | None
) -> PackedStream:
    """The packed stream of `files`, documents shuffled by `doc_seed` (None: file order)."""
    keys = tuple(_file_key(resolve_path(f)) for f in files)
    return _cached_stream(keys, tokenizer_spec, text_field, doc_seed)


# ----------------------------------------------------------------------------- windows


class PackedWindows:
    """The stream cut into windows of `seq_len + 1` tokens, stride `seq_len`, last one padded."""

    def __init__(self, stream: PackedStream, seq_len: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.seq_len = seq_len
        self.pad_id = stream.pad_id
        n = len(stream.tokens)
        self.count = max(1, -(-(n - 1) // seq_len))
        padded = self.count * seq_len + 1
        self._tokens = np.full(padded, stream.pad_id, np.int32)
        self._tokens[:n] = stream.tokens
        self._doc_ids = np.full(padded, -1, np.int32)  # -1 marks padding
        self._doc_ids[:n] = stream.doc_ids

    def examples(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """One example per entry of `rows` (window indices); a negative index is an all-padding row."""
        rows = np.asarray(rows, np.int64)
        length = self.seq_len
        span = np.maximum(rows, 0)[:, None] * length + np.arange(length + 1)
        tokens, doc = self._tokens[span], self._doc_ids[span]
        tokens[rows < 0] = self.pad_id
        doc[rows < 0] = -1
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
            "loss_mask": (real & (doc_out == doc_in)).astype(np.float32),
        }


def _local_batch(batch: int, process_index: int, process_count: int) -> int:
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"bad process_index {process_index} for process_count {process_count}")
    if batch < 1:
        raise ValueError(f"batch size must be positive, got {batch}")
    if batch % process_count:
        raise ValueError(f"global batch {batch} is not divisible by process count {process_count}")
    return batch // process_count


# ----------------------------------------------------------------------------- iterators


class _TrainBatchAtStep:
    """step -> this process's batch; a pure function of the step, so grain can checkpoint it."""

    def __init__(self, windows, global_batch, seed, shuffle, process_index, process_count):
        self.windows = windows
        self.global_batch = global_batch
        self.steps_per_epoch = windows.count // global_batch
        self.seed, self.shuffle = seed, shuffle
        self.process_index, self.process_count = process_index, process_count
        self._last_order = (-1, None)  # (epoch, order): a plain tuple keeps this picklable

    def _epoch_order(self, epoch: int) -> np.ndarray:
        cached_epoch, order = self._last_order  # one read, so a racing thread can't mix entries
        if cached_epoch == epoch:
            return order
        if self.shuffle:
            rng = np.random.default_rng([_WINDOW_ORDER_STREAM, self.seed, epoch])
            order = rng.permutation(self.windows.count)
        else:
            order = np.arange(self.windows.count)
        self._last_order = (epoch, order)
        return order

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        epoch, step_in_epoch = divmod(int(step), self.steps_per_epoch)
        start = step_in_epoch * self.global_batch
        global_rows = self._epoch_order(epoch)[start:start + self.global_batch]
        return self.windows.examples(global_rows[self.process_index::self.process_count])


def make_train_iterator(
    cfg: DataConfig,
    *,
    seq_len: int,
    global_batch: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
) -> grain.DatasetIterator:
    """Endless iterator of this process's `global_batch // process_count` rows per step.

    Supports `get_state()` / `set_state()` (and so grain.checkpoint.CheckpointSave/Restore).
    Windows left over after the last full global batch of an epoch are skipped that epoch.
    """
    _local_batch(global_batch, process_index, process_count)
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    doc_seed = seed if cfg.shuffle else None
    stream = load_stream(cfg.train_files, cfg.tokenizer, cfg.text_field, doc_seed)
    windows = PackedWindows(stream, seq_len)
    if windows.count < global_batch:
        raise ValueError(
            f"training corpus {', '.join(cfg.train_files)} has only {windows.count} windows of "
            f"{seq_len + 1} tokens, fewer than the global batch {global_batch}"
        )
    batch_at_step = _TrainBatchAtStep(
        windows, global_batch, seed, cfg.shuffle, process_index, process_count
    )
    dataset = grain.MapDataset.range(sys.maxsize).map(batch_at_step)
    # One thread prepares the next batches while the accelerator runs the current step.
    read_options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)
    return iter(dataset.to_iter_dataset(read_options))


def make_eval_batches(
    cfg: DataConfig,
    *,
    seq_len: int,
    batch_size: int,
    max_batches: int | None,
    process_index: int = 0,
    process_count: int = 1,
) -> list[dict[str, np.ndarray]]:
    """Every window of `eval_files` in order, in batches of `batch_size // process_count` rows.

    Batch `t` covers windows `t*batch_size ... (t+1)*batch_size - 1`, process `p` taking every
    `process_count`-th of them from `p`. Rows past the last window are padding (loss_mask 0), so
    all batches, on all processes, have the same shape and count.
    """
    _local_batch(batch_size, process_index, process_count)
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"max_batches must be positive or None, got {max_batches}")
    stream = load_stream(cfg.eval_files, cfg.tokenizer, cfg.text_field, doc_seed=None)
    windows = PackedWindows(stream, seq_len)
    count = -(-windows.count // batch_size)
    if max_batches is not None:
        count = min(count, max_batches)
    batches = []
    for t in range(count):
        rows = np.arange(t * batch_size + process_index, (t + 1) * batch_size, process_count)
        batches.append(windows.examples(np.where(rows < windows.count, rows, -1)))
    return batches
