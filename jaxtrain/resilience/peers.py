"""The other processes of a run, watched through the jax.distributed coordinator's key-value store.

Every process keeps, under `jaxtrain/peers/`:
  host/<i>    its hostname, for messages and the shared-directory check;
  beat/<i>    a counter its watcher thread raises every `period` seconds;
  failed/<i>  one line saying why process i is stopping (`report_failure`, `abort`);
  stopped/<i> one line saying process i stopped on a signal before its first step (`leave_stopped`):
              the others stop too, exit 0;
  gone/<i>    written as process i leaves: "ok" after a normal end, "stopped" after a stop
              before the first step, "failed" otherwise;
and its watcher thread reads that whole directory back every period (one RPC). A peer whose
counter has not moved for `dead_after` seconds is dead; a failure line from a peer ends this
process with exit_codes.PEER, quoting it. Both bounds fit inside `timeout_s`.

Ending a multi-process run other than all together at the normal end needs care, because of how
jax (0.10, CPU, gloo) shuts down:
- jax registers `jax.distributed.shutdown` at exit, a barrier every process must reach; a process
  leaving with `sys.exit` while a peer is gone waits there, then jax aborts it (exit 134, a C++
  stack). Failure exits therefore go through `abort`, which ends with `os._exit`.
- the coordinator lives inside process 0: when process 0 exits, jax's client in every other
  process aborts at once (its error callback cannot be replaced from Python: jaxlib cannot pass
  the status to a Python callable). So on a failure process 0 leaves last: `abort` in process 0
  waits, bounded, until every other process has gone or is dead.
- a peer killed mid-collective makes gloo raise in the main thread at once ("Connection closed by
  peer", no process named); `on_exception` then waits for the watcher to name the dead process.
"""
from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
import traceback

from jaxtrain.resilience import exit_codes
from jaxtrain.resilience.coordination_keys import PREFIX
from jaxtrain.resilience.coordination_keys import one_line as _one_line
from jaxtrain.resilience.exit_codes import RunStopped

# Words in an exception's text that say it may come from another process (a dead peer, a lost
# coordinator) rather than from this process's own work.
_COMMUNICATION_WORDS = ("gloo", "nccl", "connection", "socket", "unavailable", "deadline", "peer",
                        "collective", "coordinat", "barrier", "heartbeat", "timed out", "timeout")


def write_line(text: str) -> None:
    """Writes one line to stderr without Python's buffered stream (safe in signal handlers)."""
    try:
        os.write(2, (text.rstrip("\n") + "\n").encode(errors="replace"))
    except OSError:
        pass


def flush_and_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


class Peers:
    """One process per host. Everything is a no-op (or trivially true) with one process.

    Constructed with the coordinator's client (default: jax.distributed's), it publishes this
    process's hostname and starts the watcher thread at once, so that heartbeats run through
    checkpoint restore and compilation. `close()` (also run at exit) stops it."""

    def __init__(self, timeout_s: float = 60.0, *, client=None, process_index: int | None = None,
                 process_count: int | None = None, coordinator_address: str | None = None,
                 watch: bool = True):
        self.timeout_s = float(timeout_s)
        if client is None:
            from jax._src.distributed import global_state
            client, process_index, process_count = (global_state.client, global_state.process_id,
                                                    global_state.num_processes)
            coordinator_address = coordinator_address or global_state.coordinator_address
        self.client = client
        self.index = int(process_index or 0)
        self.count = int(process_count or 1) if client is not None else 1
        self.enabled = self.client is not None and self.count > 1
        self.coordinator_address = coordinator_address or "the coordinator"
        self.host = socket.gethostname()
        # Heartbeat period and the silence after which a peer is dead: a death is noticed within
        # dead_after + 2 periods (the last beat's age, one poll) <= timeout_s.
        self.period = min(max(self.timeout_s / 10.0, 0.2), 5.0)
        self.dead_after = max(self.timeout_s - 3 * self.period, 3 * self.period)
        self._hosts: dict[int, str] = {self.index: self.host}
        self._beats: dict[int, tuple[str | None, float]] = {}  # peer -> (last counter, when it changed)
        self._gone: dict[int, str] = {}
        self._failures: dict[int, str] = {}
        self._stopped: dict[int, str] = {}  # peers that stopped on a signal before their first step
        self._reported = False
        self._exit_code = None
        self._aborting = threading.Lock()
        self._state_lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = None
        self._checks = 0
        if not self.enabled:
            return
        start = time.monotonic()
        self._beats = {j: (None, start) for j in range(self.count) if j != self.index}
        self._set(f"host/{self.index}", self.host)
        self._set(f"beat/{self.index}", "0")
        if watch:
            self._thread = threading.Thread(target=self._watch, name="jaxtrain-peers", daemon=True)
            self._thread.start()
            atexit.register(self._at_exit)  # runs before jax's distributed shutdown (registered earlier)

    # -- names ----------------------------------------------------------------------------------
    def name(self, j: int) -> str:
        """'process j (host)' once the host is known."""
        host = self._hosts.get(j)
        return f"process {j} ({host})" if host else f"process {j}"

    def _own(self, message: str) -> str:
        """Prefixes `message` with 'process i: ' unless it already names this process."""
        return message if message.startswith(f"process {self.index}") else f"process {self.index}: {message}"

    # -- key-value helpers ----------------------------------------------------------------------
    def _set(self, key: str, value: str) -> None:
        self.client.key_value_set(PREFIX + key, value, allow_overwrite=True)

    def _read(self) -> dict[str, str]:
        return {k[len(PREFIX):]: v for k, v in self.client.key_value_dir_get(PREFIX)}

    def _observe(self, entries: dict[str, str], now: float) -> str | None:
        """Takes in one reading of the directory; returns the line to exit with, or None."""
        with self._state_lock:  # the watcher thread and the main thread (_blame_peers) both read
            return self._judge(entries, now)

    def _judge(self, entries: dict[str, str], now: float) -> str | None:
        for key, value in entries.items():
            kind, _, j = key.partition("/")
            if not j.isdigit():
                continue
            j = int(j)
            if kind == "host":
                self._hosts[j] = value
            elif kind == "gone" and j != self.index:
                self._gone[j] = value
            elif kind == "failed" and j != self.index:
                self._failures[j] = value
            elif kind == "stopped" and j != self.index:
                self._stopped[j] = value
            elif kind == "beat" and j in self._beats and self._beats[j][0] != value:
                self._beats[j] = (value, now)
        if self._failures:
            j = min(self._failures)
            what = self._failures[j]
            for prefix in (f"process {j}: ", f"process {j} "):
                if what.startswith(prefix):
                    what = what[len(prefix):]
                    break
            return f"process {self.index}: stopping because {self.name(j)} failed: {what}"
        if self._stopped:  # it never reached its first step, so neither can this process
            j = min(self._stopped)
            what = self._stopped[j].removeprefix(f"process {j}: ")
            return f"process {self.index}: stopping because {self.name(j)} {what}"
        for j, (counter, changed) in sorted(self._beats.items()):
            if j in self._gone:
                continue
            silent = now - changed
            # a peer not seen yet may still be starting (restoring, tokenizing): twice the bound
            if silent >= (self.dead_after if counter is not None else 2 * self.dead_after):
                return (f"process {self.index}: {self.name(j)} stopped responding: no heartbeat through "
                        f"the coordinator for {silent:.0f} s (killed, crashed or its machine is down; "
                        f"ResilienceConfig.peer_timeout_s={self.timeout_s:g})")
        return None

    # -- the watcher thread ---------------------------------------------------------------------
    def _watch(self) -> None:
        beats, unreachable_since, last_poll = 0, None, time.monotonic()
        while not self._stop.wait(self.period):
            beats += 1
            now = time.monotonic()
            if now - last_poll > 3 * self.period:  # this process was not running (suspended, starved):
                with self._state_lock:  # its peers' silence over the gap was not observed
                    self._beats = {j: (c, max(t, now - self.period)) for j, (c, t) in self._beats.items()}
            last_poll = now
            try:
                self._set(f"beat/{self.index}", str(beats))
                entries = self._read()
            except Exception as e:  # the coordinator (in process 0) does not answer
                if self._stop.is_set():
                    return
                unreachable_since = unreachable_since or now
                if now - unreachable_since >= self.dead_after:
                    self.abort(exit_codes.PEER,
                               f"process {self.index}: the coordinator at {self.coordinator_address} "
                               f"(in process 0) has not answered for {now - unreachable_since:.0f} s: "
                               f"{_one_line(e, 200)}", tell_peers=False)
                continue
            unreachable_since = None
            verdict = self._observe(entries, time.monotonic())
            if verdict and not self._stop.is_set():
                self._end_on(verdict)

    def _end_on(self, verdict: str) -> None:
        """Ends this process on a verdict about its peers: exit 0 when a peer stopped on a signal
        before its first step (and none failed), exit PEER otherwise."""
        if self._stopped and not self._failures:
            write_line(f"jaxtrain: {verdict}")
            self._aborting.acquire()
            self._leave(exit_codes.OK, "stopped")
        self.abort(exit_codes.PEER, verdict, tell_peers=not self._failures)

    def leave_stopped(self, message: str) -> None:
        """Ends this process with exit 0 after a stop on a signal before its first step (`message`,
        printed already): the peers learn of it and stop too (exit 0); process 0 leaves last."""
        if not self.enabled:
            flush_and_exit(exit_codes.OK)
        self._aborting.acquire()
        self._stop.set()
        try:
            self._set(f"stopped/{self.index}", _one_line(self._own(message)))
        except Exception:
            pass
        self._leave(exit_codes.OK, "stopped")

    def close(self) -> None:
        """Stops watching and tells the peers this process left normally. Idempotent."""
        if not self.enabled or self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.period + 5)
        try:
            self._set(f"gone/{self.index}", "failed" if self._reported else "ok")
        except Exception:
            pass

    def _at_exit(self) -> None:
        """At interpreter exit, before jax's shutdown barrier: a process that reported a failure
        cannot pass that barrier (its peers leave through os._exit), so it leaves here, with the
        exit code given to report_failure (or seen by on_exception; else 1), process 0 last."""
        if not self._reported:
            self.close()
            return
        self._leave(self._exit_code if self._exit_code is not None else 1)

    def _leave(self, code: int, how: str = "failed") -> None:
        """Marks this process gone (after a failure, or a stop before the first step) and exits;
        process 0 (the coordinator's host) waits, bounded, for the others first."""
        self._stop.set()
        try:
            self._set(f"gone/{self.index}", how)
        except Exception:
            pass
        if self.index == 0:
            self._wait_for_others_to_leave()
        flush_and_exit(code)

    # -- failures -------------------------------------------------------------------------------
    def report_failure(self, message: str, exit_code: int | None = None) -> None:
        """Tells every peer this process is stopping because of `message` ('process i: what';
        the prefix is added if missing); each of them then exits with exit_codes.PEER and one line
        quoting it. Then end the process: `abort(code, message)` does both at once; after
        report_failure alone, a normal interpreter exit (sys.exit, an exception) ends with
        `exit_code` at exit, skipping jax's shutdown barrier, which cannot complete any more."""
        if not self.enabled:
            return
        self._blame_peers(message)  # a failure caused by a peer's is that peer's: exits PEER then
        if exit_code is not None:
            self._exit_code = exit_code
        self._publish_failure(message)

    def _publish_failure(self, message: str) -> None:
        self._reported = True
        try:
            self._set(f"failed/{self.index}", _one_line(self._own(message)))
        except Exception as e:
            write_line(f"jaxtrain: process {self.index}: could not report the failure to the other "
                       f"processes: {_one_line(e, 200)}")

    def abort(self, code: int, message: str, *, tell_peers: bool = True, announce: bool = True):
        """Ends this process with `code` after printing `error: <message>`; with several processes,
        first reports the failure (unless it came from a peer) and, in process 0, which hosts the
        coordinator, waits (at most about timeout_s) until the other processes are gone. Never
        returns (with one process, in the main thread, it raises SystemExit so cleanups run).
        `announce=False`: the caller printed the line already."""
        if not self.enabled:
            if announce:
                write_line(f"error: {message}")
            if threading.current_thread() is threading.main_thread():
                raise SystemExit(code)
            flush_and_exit(code)
        self._aborting.acquire()  # the first caller ends the process; any later one waits for that
        if announce:
            write_line(f"error: {message}")
        self._stop.set()
        if tell_peers:
            self._publish_failure(message)
        self._leave(code)

    def _wait_for_others_to_leave(self) -> None:
        deadline = time.monotonic() + self.dead_after + 2 * self.period
        while time.monotonic() < deadline:
            try:
                self._observe(self._read(), time.monotonic())
            except Exception:
                return
            now = time.monotonic()
            with self._state_lock:
                waiting = [j for j, (_, changed) in self._beats.items()
                           if j not in self._gone and now - changed < self.dead_after]
            if not waiting:
                return
            time.sleep(min(0.1, self.period))

    def on_exception(self, exc: BaseException) -> None:
        """Called with an exception about to end the run (Watchdog.stop does, from the loop's
        `finally`). With several processes it never returns for an unexpected error: it waits (at
        most timeout_s) for the watcher to name a dead or failed peer when the error may come from
        one (exit PEER), and otherwise prints the traceback, reports this process's failure and
        exits 1. A RunStopped or SystemExit is a decided stop and passes through (every process
        reaches a non-finite halt together), unless this process reported a failure: then its
        peers are leaving, nothing collective (a checkpoint manager's closing barrier) can finish,
        and a RunStopped ends the process here, with its code and line. A KeyboardInterrupt
        passes through."""
        if not self.enabled:
            return
        if isinstance(exc, (RunStopped, SystemExit)):
            code = getattr(exc, "code", None)
            if self._reported and isinstance(code, int) and self._exit_code is None:
                self._exit_code = code
            if self._reported and isinstance(exc, RunStopped):
                self.abort(exc.code, str(exc), tell_peers=False)
            return
        if not isinstance(exc, Exception):
            return
        text = f"{type(exc).__name__}: {_one_line(exc, 300)}"
        self._blame_peers(text)
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        self.abort(1, f"process {self.index}: {text}")

    def _blame_peers(self, text: str) -> None:
        """Before this process reports an error of its own: if a peer failed, left or died, that
        is the cause (a collective or a save with it breaks here too): exits PEER naming it. A
        peer's report is read at once; an error that may come from a peer waits (at most
        timeout_s) for the watcher to tell whether one is dead. Returns if none is to blame."""
        def verdict():
            try:
                line = self._observe(self._read(), time.monotonic())
            except Exception:  # the coordinator is gone: the watcher says so
                line = None
            gone = sorted(self._gone)
            if line is None and gone:
                j = gone[0]
                line = (f"process {self.index}: {self.name(j)} left the run while this process still "
                        f"needed it ({text})")
            if line is not None:
                self._end_on(line)

        verdict()
        if not any(word in text.lower() for word in _COMMUNICATION_WORDS):
            return
        write_line(f"jaxtrain: process {self.index}: {text}; checking the other processes "
                   f"(up to {self.timeout_s:g} s)")
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            time.sleep(self.period)
            verdict()

    # -- the shared checkpoint directory ---------------------------------------------------------
    def check_shared_directory(self, path: str) -> None:
        """Raises ValueError on every process when `path` is not one directory all of them see
        (jaxtrain/resilience/shared_directory.py). Call it before restoring, from every process."""
        from jaxtrain.resilience.shared_directory import check_shared_directory

        check_shared_directory(self, path)
