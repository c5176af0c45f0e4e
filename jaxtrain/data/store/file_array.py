"""A flat array in a file, read by positioned reads (`os.preadv` into a numpy buffer), never
memory-mapped.

Why not a memory map: every page of a file mapping the loader touches stays mapped, and mapped
file pages count in the process's RSS. Random windows read from a memory-mapped store grow
RssFile by megabytes per batch (the kernel maps whole large folios and read-around pages, some
hundreds of KB per 8 KB window; `madvise(MADV_RANDOM)` does not change it), so a run's RSS
climbs towards the corpus's size. A positioned read copies just the slice; the kernel's page
cache still serves repeated reads, but nothing stays in the process. Reads are thread-safe (no
shared file position) and an array pickles as its path (a worker process reopens the file).
"""
from __future__ import annotations

import os
import threading

import numpy as np


class FileArray:
    """`count` items of `dtype` starting at byte `offset` of `path`; `a[i]`, `a[i:j]` and
    `chunks(n)` return numpy copies."""

    def __init__(self, path: str | os.PathLike, dtype, count: int, offset: int = 0):
        self.path, self.dtype, self.count, self.offset = str(path), np.dtype(dtype), int(count), int(offset)
        self._file = None
        self._lock = threading.Lock()  # opening once; seek + read where os.preadv is missing (Windows)

    def __len__(self) -> int:
        return self.count

    @property
    def shape(self) -> tuple[int]:
        return (self.count,)

    def _read_at(self, view: memoryview, at: int) -> int:
        if self._file is None:
            with self._lock:
                if self._file is None:
                    self._file = open(self.path, "rb", buffering=0)
        if hasattr(os, "preadv"):
            return os.preadv(self._file.fileno(), [view], at)
        with self._lock:  # a shared file position: one reader at a time
            self._file.seek(at)
            return self._file.readinto(view)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Items [start, stop) (clipped to the array)."""
        start, stop = max(0, min(start, self.count)), max(0, min(stop, self.count))
        out = np.empty(max(stop - start, 0), self.dtype)
        view, at = memoryview(out).cast("B"), self.offset + start * self.dtype.itemsize
        done = 0
        while done < len(view):
            got = self._read_at(view[done:], at + done)
            if not got:
                raise OSError(f"{self.path}: ended at byte {at + done}, expected {at + len(view)} (truncated?)")
            done += got
        return out

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(self.count)
            if step != 1:
                raise IndexError("FileArray reads contiguous slices only")
            return self.read(start, stop)
        index = int(key) + (self.count if int(key) < 0 else 0)
        if not 0 <= index < self.count:
            raise IndexError(f"{self.path}: index {key} of {self.count}")
        return self.read(index, index + 1)[0]

    def chunks(self, size: int):
        """(start, items) of consecutive pieces of at most `size` items: scans in bounded memory."""
        for start in range(0, self.count, size):
            yield start, self.read(start, start + size)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_file", "_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _file=None, _lock=threading.Lock())
