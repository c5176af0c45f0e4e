"""A thread that ends a run stuck anywhere: in a step, in the first steps' compilation, or in a
restore, a save or an eval, each with its own bound.

The thread acts while the main thread is blocked inside XLA, Orbax or I/O (a hung collective
releases the GIL): it prints one line naming the phase and the bound, dumps every thread's Python
stack to stderr (faulthandler) and exits with exit_codes.HANG, through `peers.abort` when there
are several processes (so the others stop too, quoting it, and process 0, which hosts the
coordinator, leaves last).
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

# Work that is not a step, each bounded by ResilienceConfig.hang_<phase>_s.
PHASES = ("restore", "save", "eval")


class Watchdog:
    """Steps: `step_started(step)` / `step_finished(step)` bracket each step as the host sees it;
    the brackets may overlap (the metrics of a step are fetched one step late, after the next step
    is dispatched). A step takes the time between successive `step_finished` calls. Each of the
    first `warmup` steps (they include compilation) may take `first_steps_s`; after them, a step
    may take `factor` x the median step (of the last `window` steps after the warm-up), never less
    than `min_seconds`.

    Phases: `with watchdog.phase("save", "save of step 6"):` bounds the work inside by
    `bounds["save"]` seconds; step time stops while a phase runs. Phases may nest: each keeps
    its own bound.

    Past a bound the thread dumps every thread's stack and exits the process with
    exit_codes.HANG."""

    def __init__(self, *, factor: float = 10.0, min_seconds: float = 60.0, first_steps_s: float = 3600.0,
                 bounds: dict[str, float] | None = None, warmup: int = 2, peers=None, window: int = 50,
                 process_index: int | None = None):
        self.factor, self.min_seconds, self.warmup, self.peers = factor, min_seconds, warmup, peers
        self.first_steps_s = first_steps_s
        self.bounds = {name: 3600.0 for name in PHASES} | dict(bounds or {})
        self.index = process_index if process_index is not None else (peers.index if peers is not None else 0)
        self._durations = collections.deque(maxlen=window)
        self._finished = 0
        self._in_flight: dict[int, float] = {}  # step -> when it started
        self._since = None  # the last step's finish (or the first start), phases' time added
        self._phases: list[tuple[str, str, float]] = []  # (name, what, started), outermost first
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        self.poll_s = min(1.0, max(min(min_seconds, first_steps_s, *self.bounds.values()) / 20.0, 0.05))

    @classmethod
    def for_run(cls, train_config, peers=None) -> "Watchdog":
        """The watchdog a run's TrainConfig asks for (its hang_* fields)."""
        t = train_config
        return cls(factor=t.hang_factor, min_seconds=t.hang_min_s, first_steps_s=t.hang_first_steps_s,
                   bounds={name: getattr(t, f"hang_{name}_s") for name in PHASES}, peers=peers)

    def start(self) -> "Watchdog":
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="jaxtrain-watchdog", daemon=True)
            self._thread.start()
        return self

    # -- steps ----------------------------------------------------------------------------------
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

    @property
    def warming_up(self) -> bool:
        return not self._durations

    def limit(self) -> float:
        """Seconds without a finished step allowed now."""
        if self.warming_up:
            return self.first_steps_s
        return max(self.min_seconds, self.factor * statistics.median(self._durations))

    # -- phases ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str, what: str | None = None):
        """Context manager: `name` (one of PHASES) bounded by its own limit, not timed as a step."""
        if name not in self.bounds:
            raise ValueError(f"unknown watchdog phase {name!r}; known: {sorted(self.bounds)}")
        entry = (name, what or name, time.monotonic())
        with self._lock:
            self._phases.append(entry)
        try:
            yield
        finally:
            with self._lock:
                self._phases.remove(entry)
                if not self._phases and self._since is not None:  # step time stood still meanwhile
                    self._since += time.monotonic() - entry[2]

    # -- the thread -----------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            verdict = self._overdue(time.monotonic())
            if verdict is not None and not self._stop.is_set():
                self._hang(verdict)

    def _overdue(self, now: float) -> str | None:
        """The line to exit with if something has run past its bound, else None."""
        with self._lock:
            phases, steps = list(self._phases), sorted(self._in_flight)
            since, limit, warming = self._since, self.limit(), self.warming_up
            median = None if warming else statistics.median(self._durations)
        for name, what, started in reversed(phases):  # the innermost first: it is where the time goes
            bound = self.bounds[name]
            if now - started > bound:
                return (f"process {self.index}: hung: {what} has not finished after {now - started:.0f} s, over "
                        f"the bound ResilienceConfig.hang_{name}_s={bound:g}")
        if phases or not steps or now - since <= limit:
            return None
        flight = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
        if warming:
            return (f"process {self.index}: hung: no step finished for {now - since:.0f} s ({flight} in flight, "
                    f"among the first {self.warmup} steps, compilation included), over the bound "
                    f"ResilienceConfig.hang_first_steps_s={limit:g}")
        return (f"process {self.index}: hung: no step finished for {now - since:.0f} s ({flight} in flight), "
                f"over the limit {limit:.0f} s = max(ResilienceConfig.hang_min_s={self.min_seconds:g}, "
                f"hang_factor={self.factor:g} x the median step {median:.3g} s)")

    def _hang(self, message: str) -> None:
        write_line(f"error: {message}; every thread's stack follows")
        try:
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except Exception:  # stderr without a file descriptor (captured): format the frames instead
            import traceback
            for ident, frame in sys._current_frames().items():
                write_line(f"Thread {ident:#x}:\n" + "".join(traceback.format_stack(frame)))
        if self.peers is not None and self.peers.enabled:
            self.peers.abort(exit_codes.HANG, message, announce=False)
        flush_and_exit(exit_codes.HANG)

    def stop(self, *, blame: bool = True) -> None:
        """Stops the thread. Called from the loop's `finally`: an exception ending the run goes to
        `peers.on_exception` first (with several processes an error may be a peer's death, which
        gloo reports at once and without naming it; jaxtrain/resilience/peers.py). `blame=False`:
        only stop the thread (the run's start-up failed; its error goes its usual way)."""
        error = sys.exc_info()[1]
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None
        if blame and error is not None and self.peers is not None:
            self.peers.on_exception(error)
