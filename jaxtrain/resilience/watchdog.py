"""A thread that ends a run which stopped making progress (stub)."""
from __future__ import annotations


class Watchdog:
    """`step_started(step)` / `step_finished(step)` bracket each step as the host sees it (the
    metrics of a step are fetched one step late); a step taking longer than `factor` x the median
    step (after `warmup` steps, never below `min_seconds`) dumps every thread's stack and exits
    the process non-zero. Also watches the peers (jaxtrain/resilience/peers.py)."""

    def __init__(self, *, factor: float = 10.0, min_seconds: float = 60.0, warmup: int = 2, peers=None):
        self.factor, self.min_seconds, self.warmup, self.peers = factor, min_seconds, warmup, peers

    def start(self) -> "Watchdog":
        return self

    def step_started(self, step: int) -> None:
        pass

    def step_finished(self, step: int) -> None:
        pass

    def pause(self):
        """Context manager: work that is not a step (saves, evals) is not timed as one."""
        import contextlib
        return contextlib.nullcontext()

    def stop(self) -> None:
        pass
