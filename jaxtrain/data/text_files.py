"""Raw corpus files: where a path points (the CWD, then the repo root), the documents of one .txt,
.jsonl or `save_to_disk` folder, and text -> int32 token ids. Below both the stores (which read raw
files as one source) and packing (which builds its sources from the stores), so neither imports the
other for these.
"""
from __future__ import annotations

import json
import os
import pathlib
import re

import numpy as np

from jaxtrain.data.tokenizer import ByteTokenizer, Tokenizer

from jaxtrain.bundled import ROOT as BUNDLED_ROOT
_BLANK_LINES = re.compile(r"\n\s*\n")


def resolve_path(path: str | os.PathLike) -> pathlib.Path:
    """`path` as given if it exists (absolute or from the CWD), else under the repo root."""
    given = pathlib.Path(path).expanduser()
    if given.exists():
        return given.resolve()
    if not given.is_absolute() and (BUNDLED_ROOT / given).exists():
        return (BUNDLED_ROOT / given).resolve()
    where = "" if given.is_absolute() else f" (looked in {os.getcwd()} and {BUNDLED_ROOT})"
    raise FileNotFoundError(f"corpus file not found: {path}{where}")


def read_documents(path: pathlib.Path, text_field: str = "text") -> list[str]:
    """The non-empty, stripped documents of one .txt, .jsonl or `save_to_disk` folder."""
    if path.is_dir():
        docs = _read_datasets_folder(path, text_field)
    elif path.suffix == ".txt":
        docs = _BLANK_LINES.split(read_utf8(path))
    elif path.suffix == ".jsonl":
        docs = _read_jsonl(path, text_field)
    else:
        raise ValueError(
            f"{path}: unsupported corpus file type {path.suffix!r}; "
            "use .txt, .jsonl or a folder written by datasets' save_to_disk"
        )
    return [doc.strip() for doc in docs if doc.strip()]


def read_utf8(path: pathlib.Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not valid UTF-8 ({err})") from err


def _read_jsonl(path: pathlib.Path, text_field: str) -> list[str]:
    docs = []
    for line_number, line in enumerate(read_utf8(path).splitlines(), start=1):
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


def encode_to_array(tokenizer: Tokenizer, text: str) -> np.ndarray:
    if isinstance(tokenizer, ByteTokenizer):  # the UTF-8 bytes are the ids: skip the Python list
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
    return np.asarray(tokenizer.encode(text), dtype=np.int32)
