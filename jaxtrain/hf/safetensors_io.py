"""Reading and writing the safetensors files of a local HF model directory, one tensor at a time.

Reading opens a file per read (`safe_open(...).get_slice`) and closes it again, so the file's
memory map never stays resident in this process beyond the slice just read. Writing lays out
every shard's header first and then places each tensor at its offset as it arrives, in any
order, so a sharded export never holds more than one tensor.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Iterable, Sequence

import ml_dtypes
import numpy as np
from safetensors import safe_open

from jaxtrain.hf.errors import HFCheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_CODES = {v: k for k, v in DTYPES.items()}
_SHARD_NAME = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    file: str
    shape: tuple[int, ...]
    dtype: np.dtype


class SafetensorsDir:
    """The tensors of a local HF directory (one `model.safetensors`, or shards listed in
    `model.safetensors.index.json`). Headers are read and checked up front; data on demand."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)
        index_path = os.path.join(self.directory, INDEX_FILE)
        if os.path.exists(index_path):
            with open(index_path) as f:
                try:
                    weight_map = json.load(f)["weight_map"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise HFCheckpointError(f"{index_path}: not a safetensors index ({e})") from e
            files = sorted(set(weight_map.values()))
        elif os.path.exists(os.path.join(self.directory, SINGLE_FILE)):
            weight_map, files = None, [SINGLE_FILE]
        else:
            raise HFCheckpointError(f"{self.directory}: no {SINGLE_FILE} or {INDEX_FILE} found")
        self.tensors: dict[str, TensorInfo] = {}
        for file in files:
            for name, info in _read_header(os.path.join(self.directory, file)).items():
                if weight_map is None or weight_map.get(name) == file:
                    self.tensors[name] = dataclasses.replace(info, file=file)
        if weight_map is not None:
            lost = sorted(n for n, f in weight_map.items() if n not in self.tensors)
            if lost:
                raise HFCheckpointError(f"{index_path} lists tensor(s) not found in their files: {lost[:5]}"
                                        f"{' ...' if len(lost) > 5 else ''}")

    def read(self, name: str, slices: tuple[slice, ...] | None = None) -> np.ndarray:
        info = self.tensors[name]
        path = os.path.join(self.directory, info.file)
        try:
            with safe_open(path, framework="np") as f:
                part = f.get_slice(name)
                return np.asarray(part[slices] if slices else part[:])
        except Exception as e:  # safetensors raises its own error types; keep the file and tensor
            raise HFCheckpointError(f"{path}: cannot read tensor {name!r}: {e}") from e


def _read_header(path: str) -> dict[str, TensorInfo]:
    if not os.path.exists(path):
        raise HFCheckpointError(f"safetensors file {path} is missing")
    try:
        with safe_open(path, framework="np") as f:
            out = {}
            for name in f.keys():
                part = f.get_slice(name)
                code = part.get_dtype()
                if code not in DTYPES:
                    raise HFCheckpointError(f"{path}: tensor {name!r} has unsupported dtype {code}")
                out[name] = TensorInfo(path, tuple(part.get_shape()), DTYPES[code])
            return out
    except HFCheckpointError:
        raise
    except Exception as e:
        raise HFCheckpointError(f"{path}: not a readable safetensors file, truncated or corrupt? ({e})") from e


# ----------------------------------------------------------------------------- writing


@dataclasses.dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


class ShardedWriter:
    """Writes planned tensors into shards of at most `max_shard_bytes` (one file when it fits),
    with the index file HF expects for several. Tensors may be written in any order."""

    def __init__(self, directory: str, planned: Sequence[PlannedTensor], max_shard_bytes: int):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        for old in os.listdir(directory):  # a previous export's shards would confuse loaders
            if old == INDEX_FILE or _SHARD_NAME.fullmatch(old):
                os.remove(os.path.join(directory, old))
        groups: list[list[PlannedTensor]] = [[]]
        size = 0
        for t in sorted(planned, key=lambda t: _natural_key(t.name)):
            if groups[-1] and size + t.nbytes > max_shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append(t)
            size += t.nbytes
        n = len(groups)
        names = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.files = [_ShardFile(os.path.join(directory, name), group) for name, group in zip(names, groups)]
        self.where = {t.name: f for f, group in zip(self.files, groups) for t in group}
        self.planned = {t.name: t for t in planned}
        if n > 1:
            index = {"metadata": {"total_size": sum(t.nbytes for t in planned),
                                  "total_parameters": sum(t.nbytes // t.dtype.itemsize for t in planned)},
                     "weight_map": {t.name: os.path.basename(self.where[t.name].path)
                                    for t in sorted(planned, key=lambda t: _natural_key(t.name))}}
            with open(os.path.join(directory, INDEX_FILE), "w") as f:
                json.dump(index, f, indent=2)

    def write(self, name: str, array: np.ndarray, first_row: int = 0) -> None:
        """Writes `array` as rows first_row, first_row + 1, ... of tensor `name`."""
        self.where[name].write(self.planned[name], array, first_row)

    def close(self, check: bool = True) -> None:
        for f in self.files:
            f.close(check)


class _ShardFile:
    def __init__(self, path: str, tensors: Iterable[PlannedTensor]):
        self.path, self.tensors = path, list(tensors)
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        self.offsets = {}
        for t in self.tensors:
            header[t.name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
            self.offsets[t.name] = offset
            offset += t.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-(8 + len(text)) % 8)  # data starts 8-byte aligned
        self.data_start = 8 + len(text)
        self.missing = {t.name: t.nbytes for t in self.tensors}
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self.fd, len(text).to_bytes(8, "little") + text, 0)
        os.ftruncate(self.fd, self.data_start + offset)

    def write(self, planned: PlannedTensor, array: np.ndarray, first_row: int) -> None:
        rows = array.shape[0] if array.ndim else 1
        if array.shape[1:] != planned.shape[1:] or array.dtype != planned.dtype or (
                planned.shape and first_row + rows > planned.shape[0]):
            raise ValueError(f"tensor {planned.name!r}: rows {first_row}.. of {array.dtype}{list(array.shape)} "
                             f"do not fit {planned.dtype}{list(planned.shape)}")
        row_bytes = planned.nbytes // planned.shape[0] if planned.shape and planned.shape[0] else 0
        data = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        position = self.data_start + self.offsets[planned.name] + first_row * row_bytes
        self.missing[planned.name] -= len(data)
        while data:
            written = os.pwrite(self.fd, data, position)
            data, position = data[written:], position + written

    def close(self, check: bool = True) -> None:
        os.close(self.fd)
        unwritten = sorted(n for n, left in self.missing.items() if left)
        if check and unwritten:
            raise RuntimeError(f"{self.path}: tensors not (fully) written: {unwritten[:5]}")


def _natural_key(name: str):
    """model.layers.2 sorts before model.layers.10."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", name)]
