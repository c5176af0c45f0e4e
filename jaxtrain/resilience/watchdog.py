"""A thread that ends a run whose current step takes far longer than its steps usually do.

The thread acts while the main thread is blocked inside XLA (a hung collective releases the
GIL): it prints one line, dumps every thread's Python stack to stderr (faulthandler) and exits
with exit_codes.HANG, through `peers.abort` when there are several processes (so the others
stop too, quoting it, and process 0, which hosts the coordinator, leaves last).
"""
from __future__ import annotations

import collections
import contextlib
import faulthandler
import statistics
import sys
import threading
import time

from jaxtrain.resilience import exit_codes
from jaxtrain.resilience.peers import flush_and_exit, write_line


class Watchdog:
    """`step_started(step)` / `step_finished(step)` bracket each step as the host sees it; the
    brackets may overlap (the metrics of a step are fetched one step late, after the next step is
    dispatched). A step takes the time between successive `step_finished` calls. When no step has
    finished for longer than `factor` x the median step (of the last `window` steps after the
    first `warmup`, which include compilation and are not timed; never below `min_seconds`) while
    a step is in flight, the thread dumps every thread's stack and exits the process with
    exit_codes.HANG. Until a step after the warm-up has finished there is no limit. Time inside
    `with watchdog.pause():` (saves, evals, restores) is not counted."""

    def __init__(self, *, factor: float = 10.0, min_seconds: float = 60.0, warmup: int = 2, peers=None,
                 window: int = 50, process_index: int | None = None):
        self.factor, self.min_seconds, self.warmup, self.peers = factor, min_seconds, warmup, peers
        self.index = process_index if process_index is not None else (peers.index if peers is not None else 0)
        self._durations = collections.deque(maxlen=window)
        self._finished = 0
        self._in_flight: dict[int, float] = {}  # step -> when it started
        self._since = None  # the last step's finish (or the first start), pauses added
        self._paused_since = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        self.poll_s = min(1.0, max(min_seconds / 20.0, 0.05))

    def start(self) -> "Watchdog":
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="jaxtrain-watchdog", daemon=True)
            self._thread.start()
        return self

    def step_started(self, step: int) -> None:
        with self._lock:
            now = time.monotonic()
            self._in_flight = {s: t for s, t in self._in_flight.items() if s < step}  # a replay restarts
            self._in_flight[step] = now
            if self._since is None:
                self._since = now

    def step_finished(self, step: int) -> None:
        with self._lock:
            if step not in self._in_flight:
                return
            now = time.monotonic()
            self._finished += 1
            if self._finished > self.warmup:
                self._durations.append(now - self._since)
            self._since = now
            self._in_flight = {s: t for s, t in self._in_flight.items() if s > step}

    def limit(self) -> float | None:
        """Seconds without a finished step allowed; None while warming up."""
        if not self._durations:
            return None
        return max(self.min_seconds, self.factor * statistics.median(self._durations))

    @contextlib.contextmanager
    def pause(self):
        """Context manager: work that is not a step (saves, evals) is not timed as one."""
        with self._lock:
            outer = self._paused_since is None
            if outer:
                self._paused_since = time.monotonic()
        try:
            yield
        finally:
            if outer:
                with self._lock:
                    paused = time.monotonic() - self._paused_since
                    self._paused_since = None
                    if self._since is not None:
                        self._since += paused

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                if not self._in_flight or self._paused_since is not None:
                    continue
                steps, since, limit = sorted(self._in_flight), self._since, self.limit()
            elapsed = time.monotonic() - since
            if limit is not None and elapsed > limit and not self._stop.is_set():
                self._hang(steps, elapsed, limit)

    def _hang(self, steps: list[int], elapsed: float, limit: float) -> None:
        median = statistics.median(self._durations)
        flight = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
        message = (f"process {self.index}: hung: no step finished for {elapsed:.0f} s ({flight} in flight), "
                   f"over the limit {limit:.0f} s = max(TrainConfig.hang_min_s={self.min_seconds:g}, "
                   f"hang_factor={self.factor:g} x the median step {median:.3g} s); every thread's stack follows")
        write_line(f"error: {message}")
        try:
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except Exception:  # stderr without a file descriptor (captured): format the frames instead
            import traceback
            for ident, frame in sys._current_frames().items():
                write_line(f"Thread {ident:#x}:\n" + "".join(traceback.format_stack(frame)))
        if self.peers is not None and self.peers.enabled:
            self.peers.abort(exit_codes.HANG, message.split("; every")[0], announce=False)
        flush_and_exit(exit_codes.HANG)

    def stop(self) -> None:
        """Stops the thread. Called from the loop's `finally`: an exception ending the run goes to
        `peers.on_exception` first (with several processes an error may be a peer's death, which
        gloo reports at once and without naming it; jaxtrain/resilience/peers.py)."""
        error = sys.exc_info()[1]
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None
        if error is not None and self.peers is not None:
            self.peers.on_exception(error)
