"""A file-backed source that pickles as its path: a copy sent to a worker process (grain's
workers, multiprocessing) opens the store or prefix again there, lazily, instead of receiving
what the parent opened by value (an index read at open, or, for a memory map, the whole corpus)."""
from __future__ import annotations


class ReopeningSource:
    """`opener(path, **options)` -> the TokenSource, called once per process on first use."""

    def __init__(self, opener, path: str, **options):
        self._opener, self._path, self._options = opener, path, options
        self._source = None

    def _open(self):
        if self._source is None:
            self._source = self._opener(self._path, **self._options)
        return self._source

    def __getattr__(self, name):  # name, vocab_size, tokens, loss_mask, document_lengths, ...
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._open(), name)

    def __len__(self) -> int:
        return len(self._open())

    def __getstate__(self) -> dict:
        return {"_opener": self._opener, "_path": self._path, "_options": self._options, "_source": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"ReopeningSource({self._open()!r})"
