"""SIGTERM / SIGINT -> a stop request that every process agrees on (stub: single process)."""
from __future__ import annotations

import signal


class StopSignals:
    """Installed for the duration of a run. `should_stop(step)` is called by the loop after each
    step is dispatched; it returns True on every process at the same step once any process got
    SIGTERM or SIGINT. `restore()` puts the previous handlers back."""

    def __init__(self, peers=None):
        self.peers = peers
        self.requested = None  # the signal's name, once one arrived
        self._previous = {}

    def install(self) -> "StopSignals":
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum, frame):
        self.requested = signal.Signals(signum).name

    def should_stop(self, step: int) -> bool:
        return self.requested is not None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
