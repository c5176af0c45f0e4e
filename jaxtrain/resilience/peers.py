"""The other processes of a run, through the jax.distributed coordinator (stub: one process)."""
from __future__ import annotations


class Peers:
    """One process per host. All methods are no-ops (or trivially true) with one process."""

    def __init__(self, timeout_s: float = 60.0):
        self.timeout_s = timeout_s

    def report_failure(self, message: str) -> None:
        """Tell every peer this process is stopping because of `message` (then the caller exits)."""

    def check_shared_directory(self, path: str) -> None:
        """Raise ValueError naming the hosts unless every process sees the same directory `path`."""
