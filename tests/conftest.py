"""The suite runs on 16 simulated CPU devices; XLA reads the flags when jax starts. The
compile-speed flags and why they change no result: tests/xla_flags.py."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from xla_flags import COMPILE_FLAGS, DEVICE_COUNT  # noqa: E402
from shared_compiles import CompileLedger, share_compiles_within_the_run  # noqa: E402

os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), DEVICE_COUNT, COMPILE_FLAGS,
                                    # a loaded 2-core machine can leave simulated devices' threads >40 s
                                    # apart at a collective (XLA:CPU's default abort), seen once
                                    "--xla_cpu_collective_call_terminate_timeout_seconds=600"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
share_compiles_within_the_run()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_threefry_partitionable", True)
COMPILES = CompileLedger()
COMPILES.listen()

# Every test module declares its lanes itself, at its top, e.g. `pytestmark = [pytest.mark.fast]`:
# exactly one of LANES, plus any of MARKERS that hold for the whole module (a single test takes
# one as a decorator, `@pytest.mark.end_to_end`). A module that declares no lane is a collection
# error, so a new module never lands silently in the wrong lane. In a fast module, a test that
# compiles a model-size step or starts processes leaves the edit-test lane with its own
# `@pytest.mark.slow` (or `end_to_end`): `make test-fast` selects "fast and not slow and not end_to_end".
LANES = {
    "fast": "checks one piece on tiny inputs, seconds per test (make test-fast, the edit-test loop)",
    "slow": "anything else: whole runs, CLIs, model-size compiles",
}
MARKERS = {
    "end_to_end": "starts real processes of the CLIs, scripts or a Jupyter kernel (make test-e2e)",
    "multiprocess": "starts several jax processes on localhost, jax.distributed + gloo (with end_to_end)",
    "extended": "a process-level run kept out of make test, with its unit-level twin in it (make test-extended)",
    "gpu": "a kernel test benchmarks/gpu_check.sh runs natively on a GPU (interpreted on CPU)",
    "reference_layout": "the 16-device reference layout end to end (make test-reference)",
    "full_size": "compile-only checks of full-size models (make test-full-size)",
}


def declared_markers(module) -> set[str]:
    marks = getattr(module, "pytestmark", [])
    return {m.name for m in (marks if isinstance(marks, (list, tuple)) else [marks])}


def lane_problem(module) -> str | None:
    """Why `module`'s declared markers do not place it in exactly one lane, or None."""
    lanes = sorted(declared_markers(module) & set(LANES))
    if len(lanes) == 1:
        return None
    said = f"declares {' and '.join(lanes)}" if lanes else "declares no lane"
    return (f"{os.path.relpath(module.__file__)}: {said}. Put one line at its top, after the imports:\n"
            f"    pytestmark = [pytest.mark.fast]   # or slow, plus any of the markers below\n"
            + "".join(f"  {name:<17} {why}\n" for name, why in {**LANES, **MARKERS}.items()))


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    if isinstance(collector, pytest.Module) and report.passed:
        problem = lane_problem(collector.obj)
        if problem:
            report.outcome, report.longrepr, report.result = "failed", problem, []
    return report


def pytest_sessionfinish(session):
    COMPILES.write(os.environ.get("PYTEST_XDIST_WORKER", "main"))


def pytest_terminal_summary(terminalreporter):
    line = CompileLedger.summary()
    if line:
        terminalreporter.write_line(line)
