"""Writes a token store atomically: everything goes into `STORE.tmp-<pid>/`, is fsynced, gets its
metadata.json last, and only then is renamed to `STORE`. A killed writer leaves only a `.tmp-<pid>`
directory (removed by the next prepare of the same store), never a directory that looks complete.
Memory is bounded: tokens, masks and offsets are appended to files as they come.
"""
from __future__ import annotations

import os
import pathlib
import shutil

import numpy as np

from jaxtrain.data.store import store_format as fmt
from jaxtrain.data.store.errors import DataInputError

_COPY_CHUNK = 1 << 24


def fsync_path(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(final: pathlib.Path) -> list[pathlib.Path]:
    """Delete `final.tmp-<pid>` / `final.old-<pid>` directories left by writers that died."""
    removed = []
    for stale in final.parent.glob(f"{final.name}.tmp-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
            removed.append(stale)
    return removed


def check_output_free(final: pathlib.Path, overwrite: bool, complete) -> None:
    """Refuse to replace a complete output unless `overwrite`; never replace anything else (a
    folder that is not a store is the user's: --overwrite does not delete it)."""
    if complete(final):
        if not overwrite:
            raise DataInputError(f"{final}: already exists (a complete store); pass --overwrite to replace it")
        return
    if final.exists() and not (final.is_dir() and not any(final.iterdir())):
        raise DataInputError(f"{final}: exists and is not a token store; choose another --out")


def replace_atomically(temporary: pathlib.Path, final: pathlib.Path) -> None:
    """Rename `temporary` to `final`; an old `final` is moved aside first and deleted after."""
    old = None
    if final.exists() or final.is_symlink():
        old = final.with_name(f"{final.name}.old-{os.getpid()}")
        os.rename(final, old)
    os.rename(temporary, final)
    fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() else old.unlink()


class StoreWriter:
    """`add(tokens, lengths, mask)` batches of documents, then `commit(...)` (or `abort()`)."""

    def __init__(self, final: str | os.PathLike, vocab_size: int, has_loss_mask: bool):
        self.final = pathlib.Path(final)
        self.dtype = fmt.token_dtype(vocab_size)
        self.has_loss_mask = has_loss_mask
        remove_stale_temporaries(self.final)
        self.dir = self.final.with_name(f"{self.final.name}.tmp-{os.getpid()}")
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        self._tokens = open(self.dir / fmt.TOKENS_FILE, "wb")
        self._ends = open(self.dir / "offsets.raw", "wb")  # becomes offsets.npy at commit
        self._mask = open(self.dir / fmt.LOSS_MASK_FILE, "wb") if has_loss_mask else None
        self.documents = 0
        self.token_count = 0
        self.max_token_id = -1

    def add(self, tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Documents of `lengths` tokens, their tokens concatenated (and their masks, if any)."""
        if len(tokens) != int(np.sum(lengths)) or (self.has_loss_mask and (mask is None or len(mask) != len(tokens))):
            raise ValueError("tokens, lengths and mask of a batch disagree")
        if len(tokens):
            self.max_token_id = max(self.max_token_id, int(tokens.max()))
            if self.max_token_id > np.iinfo(self.dtype).max or int(tokens.min()) < 0:
                raise DataInputError(f"{self.final}: token id {self.max_token_id} does not fit {self.dtype}")
        self._tokens.write(np.ascontiguousarray(tokens, self.dtype).tobytes())
        if self._mask is not None:
            self._mask.write(np.ascontiguousarray(mask, np.uint8).tobytes())
        ends = self.token_count + np.cumsum(np.asarray(lengths, np.int64))
        self._ends.write(ends.astype(np.int64).tobytes())
        self.documents += len(lengths)
        self.token_count += len(tokens)

    def _write_offsets(self) -> None:
        raw = self.dir / "offsets.raw"
        header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.int64)), "fortran_order": False,
                  "shape": (self.documents + 1,)}
        with open(self.dir / fmt.OFFSETS_FILE, "wb") as out, open(raw, "rb") as ends:
            np.lib.format.write_array_header_1_0(out, header)
            out.write(np.zeros(1, np.int64).tobytes())
            while chunk := ends.read(_COPY_CHUNK):
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        raw.unlink()

    def _close_files(self) -> None:
        for handle in (self._tokens, self._ends, self._mask):
            if handle is not None and not handle.closed:
                handle.flush()
                os.fsync(handle.fileno())
                handle.close()

    def commit(self, **metadata) -> pathlib.Path:
        """Write offsets and metadata.json (last), fsync, and rename into place."""
        self._close_files()
        self._write_offsets()
        meta = fmt.StoreMetadata(
            dtype=self.dtype.name, documents=self.documents, tokens=self.token_count,
            max_token_id=self.max_token_id, has_loss_mask=self.has_loss_mask, **metadata)
        if meta.vocab_size <= self.max_token_id:
            raise DataInputError(f"{self.final}: token id {self.max_token_id} >= vocab_size {meta.vocab_size}")
        path = self.dir / fmt.METADATA_FILE
        path.write_text(meta.to_json(), encoding="utf-8")
        fsync_path(path)
        fsync_path(self.dir)
        replace_atomically(self.dir, self.final)
        return self.final

    def abort(self) -> None:
        for handle in (self._tokens, self._ends, self._mask):
            if handle is not None:
                handle.close()
        shutil.rmtree(self.dir, ignore_errors=True)

