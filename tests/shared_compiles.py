"""One compile per distinct program in a test run.

Tests build fresh jitted functions all the time (a new Trainer, a new model, a new CLI process)
whose programs equal ones already compiled in the run. jax's in-memory cache is keyed by the
function object and misses them; its persistent cache is keyed by the program itself (HLO,
compile options, devices, jax version) and hits. The suite points that cache at a directory made
for this run: the pytest process makes it before its xdist workers start, they and every process
a test starts inherit it through the environment, and the process that made it removes it at exit,
so no run reads another run's entries. A user who sets JAX_COMPILATION_CACHE_DIR keeps their own.

A cache hit still passes through jax's backend-compile event, so compile counts
(`jaxtrain.generate.compiles.count_compiles`) are the same with or without it.
"""
from __future__ import annotations

import atexit
import collections
import json
import os
import pathlib
import shutil
import tempfile

CACHE_DIR = "JAX_COMPILATION_CACHE_DIR"
# Below this, writing and reading an entry costs about what compiling does.
MIN_COMPILE_SECONDS = "0.2"
HIT_EVENT = "/jax/compilation_cache/compile_time_saved_sec"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# Tracing to a jaxpr and lowering it to StableHLO: Python time before every compile request.
TRACE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")


def share_compiles_within_the_run() -> None:
    """Before jax is imported: the run's cache directory and thresholds, in the environment."""
    if CACHE_DIR not in os.environ:
        path = tempfile.mkdtemp(prefix="jaxtrain-test-compiles-")
        os.environ[CACHE_DIR] = path
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", MIN_COMPILE_SECONDS)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


class CompileLedger:
    """This process's compile requests and the compile seconds the cache saved, so a run's
    summary says what sharing bought."""

    def __init__(self) -> None:
        self.totals: collections.Counter = collections.Counter()

    def listen(self) -> None:
        import jax

        def listener(event: str, duration: float, **kwargs) -> None:
            if event == COMPILE_EVENT:
                self.totals["requests"] += 1
                self.totals["request_seconds"] += duration
            elif event in TRACE_EVENTS:
                self.totals["trace_seconds"] += duration
            elif event == HIT_EVENT:
                self.totals["hits"] += 1
                self.totals["saved_seconds"] += max(duration, 0.0)

        jax.monitoring.register_event_duration_secs_listener(listener)

    def write(self, name: str) -> None:
        path = pathlib.Path(os.environ[CACHE_DIR]) / f"ledger-{name}-{os.getpid()}.json"
        path.write_text(json.dumps(dict(self.totals)))

    @staticmethod
    def summary() -> str | None:
        """One line over every ledger this run's processes wrote, or None when there are none."""
        totals: collections.Counter = collections.Counter()
        for path in pathlib.Path(os.environ[CACHE_DIR]).glob("ledger-*.json"):
            totals.update(json.loads(path.read_text()))
        if not totals:
            return None
        return (f"compiles shared within the run: {totals['hits']:.0f} of {totals['requests']:.0f} compile "
                f"requests were cache hits, saving {totals['saved_seconds']:.0f} s of "
                f"{totals['request_seconds'] + totals['saved_seconds']:.0f} s of compiling; "
                f"{totals['trace_seconds']:.0f} s tracing and lowering")
