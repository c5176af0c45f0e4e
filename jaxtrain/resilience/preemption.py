"""SIGTERM / SIGINT -> a stop at a step every process agrees on, saved, exit 0.

A signal may reach only one process. The agreement goes through the coordinator's key-value
store (`jaxtrain/stop/`), without blocking until it has to:
- the signalled process publishes `request` ("process i: SIGTERM") at its next step boundary;
- at every boundary each process looks for a request with one non-blocking read;
- a process that knows of a request publishes `step/<i>`, the boundary it is at, and goes on;
  the stop is at S = 1 + the largest published step. A process waits for the missing steps
  (at most the peer timeout) only at a boundary that could be S, i.e. >= 1 + the largest it
  knows. Waiting at the first boundary instead deadlocks: a peer one boundary ahead that looked
  before the request was published needs this process's next step to reach another boundary.
  Collectives keep processes within a boundary of each other, so S is at most two steps after
  the boundary where the request was published.
- at its last boundary a process publishes its step even without a request, so that a request
  made while it finishes the run is answered (S past the end: everyone ends normally) instead of
  waited for.

Before the first step (restore, compilation) there is no step to finish and save. With
`exit_in_startup=True` (the CLI installs it before jax starts) a signal then ends the process at
once with exit 0 and one line, writing nothing: a thread woken through `signal.set_wakeup_fd`
acts even while the main thread is inside a long C++ call (compilation, a restore) where Python
handlers cannot run; a file being written (`with signals.writing():`) is finished first. With
several processes the others are told (jaxtrain/resilience/peers.py `leave_stopped`) and stop
too, exit 0; every exit goes through os._exit, process 0 last.

jax's own mechanism (`multihost_utils.reached_preemption_sync_point`) does work on CPU with gloo
(checked on jax 0.10: a SIGTERM to one of two processes stopped both at the same call), but its
notifier is a C++ SIGTERM handler installed at `jax.distributed.initialize`: a Python SIGTERM
handler replaces it (then the sync point is never reached), it knows no SIGINT, counts calls
rather than steps and does nothing with one process. The CLI therefore turns it off
(jaxtrain/cli/launch.py) and this module handles both signals in every case.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

from jaxtrain.resilience import exit_codes
from jaxtrain.resilience.peers import flush_and_exit, write_line

PREFIX = "jaxtrain/stop/"
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Installed for the duration of a run (with `exit_in_startup`, from before jax starts; then
    the loop calls `steps_began()` once its first step is dispatched). `should_stop(step)` is
    called by the loop after each step is dispatched, with the number of completed steps,
    including the run's last step; it returns True on every process at the same step once any process got SIGTERM or SIGINT: with
    one process at the step it is called with, with several within two steps after it. A
    second SIGINT exits at once, without saving (exit code 130). `restore()` puts the previous
    handlers back.

    `peers` (jaxtrain.resilience.peers.Peers) carries the coordinator for several processes;
    `last_step` is the step the run ends at (see the module docstring)."""

    def __init__(self, peers=None, *, last_step: int | None = None, exit_in_startup: bool = False):
        self.last_step = last_step
        self.requested = None  # the signal's name, once one arrived here
        self.request = None  # who asked, once known: "process i: SIGTERM"
        self.stop_at = None  # the agreed step
        self._previous = {}
        self._published_request = self._published_step = False
        self.attach(peers)
        # Start-up: until the first step is dispatched, a signal ends the process (see the module doc).
        self.started = not exit_in_startup
        self._startup_signal = None  # a signal the main thread's handler saw during start-up
        self._state = threading.RLock()  # RLock: the handler runs in the main thread, maybe inside steps_began
        self._writing = threading.Lock()
        self._wakeup = None  # (read end, write end, the previous wakeup fd) while start-up is watched

    def attach(self, peers) -> "StopSignals":
        """The run's processes, once they are known (the CLI installs the handlers before)."""
        self.peers = peers
        self.index = peers.index if peers is not None else 0
        self._multi = peers is not None and peers.enabled
        return self

    def install(self) -> "StopSignals":
        if threading.current_thread() is not threading.main_thread():
            return self  # Python takes signals in the main thread only
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        if not self.started and self._wakeup is None:
            read, write = os.pipe()
            os.set_blocking(write, False)
            self._wakeup = (read, write, signal.set_wakeup_fd(write, warn_on_full_buffer=False))
            threading.Thread(target=self._watch_startup, args=(read,), name="jaxtrain-startup-signals",
                             daemon=True).start()
        return self

    # -- start-up: before the first step ---------------------------------------------------------
    def _watch_startup(self, read: int) -> None:
        """Woken by the C-level signal handler itself, whatever the main thread is doing."""
        while True:
            try:
                data = os.read(read, 64)
            except OSError:
                return
            if not data:  # steps_began or restore closed the pipe
                os.close(read)
                return
            for signum in data:
                if signum in SIGNALS:
                    with self._state:
                        if not self.started:
                            self._stop_before_first_step(signal.Signals(signum).name)

    @contextlib.contextmanager
    def writing(self):
        """A file written during start-up: a stop waits until it is whole."""
        with self._writing:
            yield

    def steps_began(self) -> None:
        """The first step is dispatched (compiled): from now on a signal stops at a step boundary,
        after saving. A signal that arrived before still stops the run before its first step."""
        with self._state:
            if self.started:
                return
            self.started = True
            pending = self._startup_signal
        self._stop_watching_startup()
        if pending is not None:
            self._stop_before_first_step(pending)

    def _stop_before_first_step(self, name: str) -> None:
        with self._writing:  # never returns: the lock is never released
            message = (f"process {self.index}: stopped before its first step on {name} "
                       f"(received during start-up: restore or compilation); nothing was saved")
            write_line(f"jaxtrain: {message}")
            if self._multi:
                self.peers.leave_stopped(message)
            flush_and_exit(exit_codes.OK)

    def _stop_watching_startup(self) -> None:
        if self._wakeup is None or threading.current_thread() is not threading.main_thread():
            return
        read, write, previous = self._wakeup
        self._wakeup = None
        signal.set_wakeup_fd(previous)
        os.close(write)  # the thread reads end-of-file and returns

    def _on_signal(self, signum, frame):
        name = signal.Signals(signum).name
        with self._state:
            if not self.started:  # the start-up thread ends the process (or steps_began, if first)
                self._startup_signal = self._startup_signal or name
                return
        if self.requested is None:
            self.requested = name
            write_line(f"jaxtrain: process {self.index}: {name} received: finishing the current step, "
                       f"saving it and exiting (a second SIGINT exits at once, without saving)")
        elif signum == signal.SIGINT:
            message = f"process {self.index}: second SIGINT: exiting at once, without saving"
            if self._multi:
                self.peers.abort(exit_codes.INTERRUPTED, message)
            write_line(f"error: {message}")
            os._exit(exit_codes.INTERRUPTED)

    def should_stop(self, step: int) -> bool:
        if not self._multi:
            if self.requested is not None and self.stop_at is None:
                self.stop_at, self.request = step, f"process {self.index}: {self.requested}"
            return self.requested is not None
        if self.stop_at is not None:
            return step >= self.stop_at
        client = self.peers.client
        if self.requested is not None and not self._published_request:
            self.request = f"process {self.index}: {self.requested}"
            client.key_value_set(PREFIX + "request", self.request, allow_overwrite=True)
            self._published_request = True
        if self.request is None:
            try:
                self.request = client.key_value_try_get(PREFIX + "request")
            except Exception:  # NOT_FOUND: nobody asked (a lost coordinator is the watcher's business)
                pass
        if self.request is None:
            if self.last_step is not None and step >= self.last_step:
                self._publish_step(step)
            return False
        self._publish_step(step)
        known = self._published()
        if len(known) < self.peers.count:
            if step < max(known.values()) + 1:
                return False  # this cannot be the stop step yet: go on without waiting
            known = self._wait_for_all(known)
        self.stop_at = max(known.values()) + 1
        print(f"jaxtrain: process {self.index}: stopping at step {self.stop_at} ({self.request})", flush=True)
        return step >= self.stop_at

    def _publish_step(self, step: int) -> None:
        if not self._published_step:
            self.peers.client.key_value_set(PREFIX + f"step/{self.index}", str(step), allow_overwrite=True)
            self._published_step = True

    def _published(self) -> dict[int, int]:
        entries = self.peers.client.key_value_dir_get(PREFIX + "step/")
        return {int(k.rsplit("/", 1)[1]): int(v) for k, v in entries}

    def _wait_for_all(self, known: dict[int, int]) -> dict[int, int]:
        """Every process's published step; waits for the missing ones, at most the peer timeout."""
        deadline = time.monotonic() + self.peers.timeout_s
        known = dict(known)
        for j in range(self.peers.count):
            if j in known:
                continue
            left_ms = max(int((deadline - time.monotonic()) * 1000), 1)
            try:
                known[j] = int(self.peers.client.blocking_key_value_get(PREFIX + f"step/{j}", left_ms))
            except Exception:
                self.peers.abort(exit_codes.PEER,
                                 f"process {self.index}: {self.peers.name(j)} did not reach a step boundary "
                                 f"within {self.peers.timeout_s:g} s while the processes agreed on the step "
                                 f"to stop at ({self.request})")
        return known

    def restore(self) -> None:
        self._stop_watching_startup()
        for sig, handler in self._previous.items():
            # None: a handler installed outside Python (jax's C++ SIGTERM notifier); not restorable
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}
