"""Stopping on a signal, and a hang, through the real CLI on a tiny model: SIGTERM or SIGINT in
the middle of a step finishes that step, saves it and exits 0, with one process or with two
(the signal reaching only one of them: both stop at the same step); the resumed run then has the
losses of an uninterrupted one, one metrics row per step. A step that hangs dumps every thread's
stack and exits HANG."""
import re
import signal

import numpy as np
import pytest

from cli_runs import losses, steps_on_disk, train, train_args
from jaxtrain.resilience import exit_codes
from live_runs import Live, process_args, reserved_port, running

# Process-level runs (the suite's budget): `make test-extended`, which CI runs after the suite; the
# parts they put together are tested in tests/faults/test_resilience_parts.py.
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.end_to_end, pytest.mark.extended]

STEPS = 12
SLOW = {"FAULT_STEP_SLEEP": "0.3"}  # every step sleeps first, so a signal lands inside one


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The losses of the uninterrupted run (one process; two processes train the same steps:
    tests/test_multihost.py)."""
    workdir = tmp_path_factory.mktemp("reference") / "run"
    proc = train(workdir, f"TrainConfig.steps={STEPS}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = losses(workdir)
    assert sorted(ref) == list(range(1, STEPS + 1)) and np.isfinite(list(ref.values())).all()
    return ref


def stopped_step(p: Live) -> int:
    return int(re.search(r"stopped by .* after step (\d+); checkpoint saved", p.stdout)[1])


def resumes_as_uninterrupted(workdir, stopped: int, reference, processes: int = 1) -> None:
    assert 3 <= stopped < STEPS and steps_on_disk(workdir) == [stopped]
    assert sorted(losses(workdir)) == list(range(1, stopped + 1))  # no step lost before the stop
    if processes == 1:
        resumed = train(workdir, f"TrainConfig.steps={STEPS}")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"steps {stopped}->{STEPS}" in resumed.stdout
    else:
        with reserved_port() as port, running() as procs:
            procs += [Live(process_args(workdir, [f"TrainConfig.steps={STEPS}"], port, i, processes), wrapper=None)
                      for i in range(processes)]
            assert [p.wait(180) for p in procs] == [0] * processes, [p.stderr[-2000:] for p in procs]
        assert f"steps {stopped}->{STEPS}" in procs[0].stdout
    after = losses(workdir)  # one row per step
    assert sorted(after) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([after[s] for s in sorted(after)], [reference[s] for s in sorted(after)], rtol=1e-5)


# SIGINT takes the same path as SIGTERM (one handler): its run is in `make test-extended` (~20 s).
@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.extended)],
                         ids=["SIGTERM", "SIGINT"])
def test_a_signal_mid_step_saves_that_step_and_the_resume_loses_none(tmp_path, reference, sig):
    workdir = tmp_path / "run"
    with running() as procs:
        procs.append(p := Live(train_args(workdir, f"TrainConfig.steps={STEPS}"), fault_env=SLOW))
        p.wait_for(r"^step 3 \[train\]", 180)
        p.popen.send_signal(sig)
        assert p.wait(60) == 0, p.stderr[-3000:]
    name = signal.Signals(sig).name
    assert f"jaxtrain: process 0: {name} received: finishing the current step, saving it and exiting" in p.stderr
    assert p.errors() == []
    resumes_as_uninterrupted(workdir, stopped_step(p), reference)


def test_sigterm_to_one_of_two_processes_stops_both_at_the_same_saved_step(tmp_path, reference):
    workdir = tmp_path / "run"
    with reserved_port() as port, running() as procs:
        bindings = [f"TrainConfig.steps={STEPS}", "ResilienceConfig.peer_timeout_s=15"]
        procs += [Live(process_args(workdir, bindings, port, i, 2), fault_env=SLOW) for i in range(2)]
        procs[0].wait_for(r"^step 3 \[train\]", 180)
        procs[1].popen.send_signal(signal.SIGTERM)
        assert [p.wait(90) for p in procs] == [0, 0], [p.stderr[-2000:] for p in procs]
    agreed = [int(re.search(r"process \d: stopping at step (\d+) \(process 1: SIGTERM\)", p.stdout)[1]) for p in procs]
    assert agreed[0] == agreed[1] == stopped_step(procs[0]), agreed
    assert "process 1: SIGTERM received" in procs[1].stderr and "received" not in procs[0].stderr
    resumes_as_uninterrupted(workdir, agreed[0], reference, processes=2)


def test_a_hung_step_dumps_every_threads_stack_and_exits_hang(tmp_path):
    with running() as procs:
        procs.append(p := Live(train_args(tmp_path / "run", f"TrainConfig.steps={STEPS}", "ResilienceConfig.hang_min_s=3"),
                               fault_env={"FAULT_HANG_STEP": "6"}))
        p.wait_for(r"^step 4 \[train\]", 180)
        assert p.wait(60) == exit_codes.HANG, p.stderr[-3000:]
    [line] = p.errors()
    assert re.match(r"error: process 0: hung: no step finished for \d+ s \(steps 5-6 in flight\), over the limit 3 s "
                    r"= max\(ResilienceConfig.hang_min_s=3, hang_factor=10 x the median step .* s\); every thread's stack "
                    r"follows$", line), line
    assert "in slow_step" in p.stderr  # where the main thread hangs (tests/faults/peer_faults.py)
    assert "jaxtrain/resilience/watchdog.py" in p.stderr  # the watchdog's own thread too
    assert p.ended - p.started < 120
