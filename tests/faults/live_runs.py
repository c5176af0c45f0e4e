"""Train CLI subprocesses that a test watches while they run (to signal or kill them mid-run),
alone or as several processes of one run on localhost (gloo), on cli_runs' tiny model and
shared compilation cache. Every wait is bounded; `running()` kills whatever is left."""
from __future__ import annotations

import contextlib
import pathlib
import re
import subprocess
import sys
import threading
import time

from cli_runs import REPO, env, train_args

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from ports import reserved_port  # noqa: E402,F401  (tests/ports.py: the coordinator's port, race-free)


class Live:
    """One CLI process; its stdout and stderr lines are collected as they come."""

    def __init__(self, args: list[str], fault_env: dict | None = None, wrapper: str | None = "peer_faults.py"):
        entry = [str(HERE / wrapper)] if wrapper else ["-m", "jaxtrain.cli.train"]
        self.started = time.monotonic()
        self.popen = subprocess.Popen([sys.executable, *entry, *args], cwd=REPO, env={**env(), **(fault_env or {})},
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.out, self.err = [], []
        self.ended = None
        self._readers = [threading.Thread(target=self._read, args=(s, lines), daemon=True)
                         for s, lines in ((self.popen.stdout, self.out), (self.popen.stderr, self.err))]
        for r in self._readers:
            r.start()

    @staticmethod
    def _read(stream, lines):
        for line in stream:
            lines.append(line)

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def errors(self) -> list[str]:
        """Its `error: ...` lines."""
        return [line.strip() for line in self.err if line.startswith("error: ")]

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """Waits until a stdout line matches `pattern`; fails (with the output) if it exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.out):
                m = re.search(pattern, line)
                if m:
                    return m
            if self.popen.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r} (exit {self.popen.poll()}):\n"
                             f"{self.stdout[-2000:]}\n{self.stderr[-3000:]}")

    def wait(self, timeout: float) -> int:
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            raise AssertionError(f"still running after {timeout} s:\n{self.stdout[-2000:]}\n{self.stderr[-3000:]}")
        self.ended = time.monotonic()
        for r in self._readers:
            r.join(5)
        return code

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)


def process_args(workdir, bindings, port: int, i: int, n: int) -> list[str]:
    return [*train_args(workdir, *bindings), f"--coordinator_address=localhost:{port}", f"--num_processes={n}",
            f"--process_id={i}"]


@contextlib.contextmanager
def running():
    """Collects the Live processes a test starts; kills any still running at the end."""
    started: list[Live] = []
    try:
        yield started
    finally:
        for p in started:
            p.kill()
