"""A pytest plugin for benchmarks/gpu_check.sh: one JSON line per test outcome, appended to the
file named by $GPU_CHECK_TESTS_JSONL as each test finishes, so a run stopped at its time limit
still says what passed and what failed. Load it with `-p pytest_jsonl` (benchmarks/ on the path).

Lines: {"kind": "collected", "count"}, {"kind": "collect_error", "path", "message"},
{"kind": "test", "test", "outcome": passed|failed|error|skipped|xfailed|xpassed, "seconds",
"message"}, {"kind": "finished", "exitstatus"}.
"""
from __future__ import annotations

import json
import os


def _write(record: dict) -> None:
    path = os.environ.get("GPU_CHECK_TESTS_JSONL")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _message(report) -> str:
    text = str(report.longrepr or "")
    return text.strip().splitlines()[-1][:300] if text.strip() else ""


def pytest_collectreport(report):
    if report.failed:
        _write({"kind": "collect_error", "path": report.nodeid, "message": _message(report)})


def pytest_collection_finish(session):
    _write({"kind": "collected", "count": len(session.items)})


def pytest_runtest_logreport(report):
    # A test's outcome is its call phase's, unless setup skipped or failed it (then there is no
    # call) or teardown failed after a passing call.
    if report.when == "call":
        outcome = report.outcome
    elif report.when == "setup" and not report.passed:
        outcome = "skipped" if report.skipped else "error"
    elif report.when == "teardown" and report.failed:
        outcome = "error"
    else:
        return
    if hasattr(report, "wasxfail"):
        outcome = "xfailed" if report.skipped else "xpassed"
    record = {"kind": "test", "test": report.nodeid, "outcome": outcome, "when": report.when,
              "seconds": round(report.duration, 3)}
    if outcome in ("failed", "error"):
        record["message"] = _message(report)
    _write(record)


def pytest_sessionfinish(session, exitstatus):
    _write({"kind": "finished", "exitstatus": int(exitstatus)})
