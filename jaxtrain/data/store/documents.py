"""Input files -> a stream of `RawBatch`es of records, read lazily (memory stays bounded).

Kinds of input: `.txt` (documents separated by blank lines, as jaxtrain/data/packing.py reads
them), `.jsonl`, `.jsonl.gz`, `.jsonl.zst` (one JSON object per line), `.parquet`, and folders
written by datasets' `save_to_disk`. `expand_inputs` turns files and globs into paths and checks
them all before anything is read or written. JSON is parsed later, in the tokenizing workers:
a batch carries its lines' numbers so an error still names the file and line.
"""
from __future__ import annotations

import dataclasses
import glob
import gzip
import io
import os
import pathlib
from typing import Iterator, Sequence

from jaxtrain.data.store.errors import DataInputError

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
SUFFIXES = (".txt",) + JSONL_SUFFIXES + (".parquet",)
# The record fields each format reads (text: the --text_field).
FORMAT_FIELDS = {"chat": ("messages",), "prompt_completion": ("prompt", "completion")}
TABLE_BATCH_ROWS = 1024  # rows of a parquet file or datasets folder read at a time


@dataclasses.dataclass
class RawBatch:
    source: int  # index of the input file
    path: str
    kind: str  # "text": items are documents; "json": items are JSON lines (bytes); "rows": dicts
    items: list
    locations: list  # per item: the line ("line 7") or row ("row 7") it came from
    bytes_read: int  # input bytes this batch consumed (for the progress bar's ETA)


def fields_for(data_format: str, text_field: str) -> tuple[str, ...]:
    return FORMAT_FIELDS.get(data_format, (text_field,))


def _suffix(path: pathlib.Path) -> str | None:
    if path.is_dir():
        return "datasets"
    name = path.name
    return next((s for s in SUFFIXES if name.endswith(s)), None)


def expand_inputs(patterns: Sequence[str]) -> list[pathlib.Path]:
    """Files and globs -> existing input paths, in the given order (each glob's matches sorted)."""
    if not patterns:
        raise DataInputError("no --input given")
    paths: list[pathlib.Path] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
            if not matches:
                raise DataInputError(f"{pattern}: the glob matches no file")
            paths += [pathlib.Path(m) for m in matches]
        else:
            path = pathlib.Path(pattern).expanduser()
            if not path.exists():
                raise DataInputError(f"{pattern}: no such file")
            paths.append(path)
    for path in paths:
        if _suffix(path) is None:
            raise DataInputError(
                f"{path}: unsupported input type; use {', '.join(SUFFIXES)} or a save_to_disk folder")
        if path.is_file() and path.stat().st_size == 0:
            raise DataInputError(f"{path}: empty file")
    return paths


def check_input(path: pathlib.Path, data_format: str, text_field: str) -> None:
    """The checks possible before reading: a format that needs records, columns that exist."""
    kind = _suffix(path)
    if kind == ".txt" and data_format != "text":
        raise DataInputError(f"{path}: .txt files hold plain text; --format {data_format} needs JSON records")
    if kind in (".parquet", "datasets"):
        columns = _columns(path, kind)
        missing = [f for f in fields_for(data_format, text_field) if f not in columns]
        if missing:
            raise DataInputError(f"{path}: no column {missing[0]!r} (columns: {columns})")


def input_size(path: pathlib.Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*.arrow"))
    return path.stat().st_size


def read_batches(paths: Sequence[pathlib.Path], data_format: str, text_field: str,
                 batch_documents: int, batch_bytes: int = 1 << 22) -> Iterator[RawBatch]:
    """Every input's records, in order, in batches of at most `batch_documents` records (or about
    `batch_bytes` of input): the batches depend only on the inputs, never on the worker count."""
    fields = fields_for(data_format, text_field)
    for number, path in enumerate(paths):
        kind = _suffix(path)
        if kind == ".txt":
            records = _txt_documents(path)
        elif kind in JSONL_SUFFIXES:
            records = _json_lines(path, kind)
        elif kind == ".parquet":
            records = _parquet_rows(path, fields)
        else:
            records = _datasets_rows(path, fields)
        record_kind = {".txt": "text", ".parquet": "rows", "datasets": "rows"}.get(kind, "json")
        batch = RawBatch(number, str(path), record_kind, [], [], 0)
        size = 0
        for item, location, consumed in records:
            batch.items.append(item)
            batch.locations.append(location)
            batch.bytes_read = consumed
            size += len(item) if isinstance(item, (bytes, str)) else 64
            if len(batch.items) >= batch_documents or size >= batch_bytes:
                yield batch
                batch, size = RawBatch(number, str(path), record_kind, [], [], consumed), 0
        if batch.items:
            yield batch


# Each reader yields (record, location, input bytes consumed so far in this file).


def _open_text(path: pathlib.Path):
    try:
        return open(path, encoding="utf-8")
    except OSError as err:
        raise DataInputError(f"{path}: cannot read ({err})") from err


def _txt_documents(path: pathlib.Path):
    """Documents separated by lines holding only whitespace (packing.py's blank-line split)."""
    lines: list[str] = []
    consumed = 0
    with _open_text(path) as f:
        try:
            for line in f:
                consumed += len(line)  # characters: an estimate of bytes, good enough for an ETA
                if line.strip():
                    lines.append(line)
                elif lines:
                    yield "".join(lines).strip(), f"paragraph ending before byte ~{consumed}", consumed
                    lines = []
        except UnicodeDecodeError as err:
            raise DataInputError(f"{path}: not valid UTF-8 ({err})") from err
    if lines:
        yield "".join(lines).strip(), "last paragraph", consumed


def _open_binary(path: pathlib.Path, kind: str):
    """(line-readable stream of the decompressed bytes, the raw file whose position is progress)."""
    raw = open(path, "rb")
    if kind == ".jsonl":
        return raw, raw
    if kind == ".jsonl.gz":
        return gzip.GzipFile(fileobj=raw), raw
    try:
        import zstandard  # optional

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw)), raw
    except ImportError:
        import pyarrow  # installed with datasets; reads zstd natively

        return pyarrow.CompressedInputStream(pyarrow.PythonFile(raw, mode="r"), "zstd"), raw


def _json_lines(path: pathlib.Path, kind: str):
    stream, raw = _open_binary(path, kind)
    with raw:
        try:
            for number, line in enumerate(_lines(stream), start=1):
                if line.strip():
                    yield line, f"line {number}", raw.tell()
        except (OSError, EOFError, ValueError) as err:
            if isinstance(err, DataInputError):
                raise
            raise DataInputError(f"{path}: cannot decompress or read ({err})") from err


def _lines(stream, chunk: int = 1 << 20):
    """Lines of a binary stream, read in chunks (pyarrow's zstd stream cannot readline)."""
    rest = b""
    while data := stream.read(chunk):
        parts = (rest + data).split(b"\n")
        rest = parts.pop()
        yield from parts
    if rest:
        yield rest


def _columns(path: pathlib.Path, kind: str) -> list[str]:
    if kind == ".parquet":
        import pyarrow.parquet as pq

        try:
            return list(pq.ParquetFile(path).schema_arrow.names)
        except Exception as err:  # pyarrow raises several kinds for a bad file
            raise DataInputError(f"{path}: not a readable parquet file ({err})") from err
    return list(_load_dataset(path).column_names)


def _rows(columns: dict, fields, start: int, consumed):
    values = [columns[f] for f in fields]
    for offset, row in enumerate(zip(*values)):
        yield dict(zip(fields, row)), f"row {start + offset}", consumed


def _parquet_rows(path: pathlib.Path, fields):
    import pyarrow.parquet as pq

    handle = pq.ParquetFile(path)
    total_rows, size, start = max(handle.metadata.num_rows, 1), path.stat().st_size, 0
    for batch in handle.iter_batches(batch_size=TABLE_BATCH_ROWS, columns=list(fields)):
        columns = batch.to_pydict()
        start += batch.num_rows
        yield from _rows(columns, fields, start - batch.num_rows, size * start // total_rows)


def _load_dataset(path: pathlib.Path):
    import datasets

    try:
        dataset = datasets.load_from_disk(str(path))
    except Exception as err:  # datasets raises FileNotFoundError and others for a non-dataset folder
        raise DataInputError(f"{path}: not a folder written by datasets' save_to_disk ({err})") from err
    if isinstance(dataset, datasets.DatasetDict):
        raise DataInputError(f"{path} holds several splits {sorted(dataset)}; name one split's folder")
    return dataset


def _datasets_rows(path: pathlib.Path, fields):
    dataset = _load_dataset(path).select_columns(list(fields))
    total_rows, size = max(dataset.num_rows, 1), input_size(path)
    for start in range(0, dataset.num_rows, TABLE_BATCH_ROWS):
        columns = dataset[start:start + TABLE_BATCH_ROWS]
        stop = min(start + TABLE_BATCH_ROWS, dataset.num_rows)
        yield from _rows(columns, fields, start, size * stop // total_rows)
