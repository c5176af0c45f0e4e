"""The resilience parts on their own, fast: peers, the stop agreement and the shared-directory
check against a real jax coordinator run inside the test process (one client per simulated
process, each in its own thread); the watchdog and a second SIGINT in small subprocesses
without jax; the peer timeout read from gin before jax starts."""
import os
import signal
import subprocess
import sys
import threading
import time
from unittest import mock

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ports import reserved_port  # noqa: E402  (tests/ports.py)
from processes import child_env  # noqa: E402

from jaxtrain.cli import launch  # noqa: E402
from jaxtrain.training.run_configs import ResilienceConfig  # noqa: E402
from jaxtrain.resilience import exit_codes  # noqa: E402
from jaxtrain.resilience.peers import Peers  # noqa: E402
from jaxtrain.resilience.preemption import StopSignals  # noqa: E402
from jaxtrain.resilience.watchdog import Watchdog  # noqa: E402

pytestmark = [pytest.mark.fast, pytest.mark.end_to_end]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def in_threads(fns, timeout=60):
    """Runs one function per simulated process, each in its own thread; their results (or the
    exceptions they raised) in order."""
    out = [None] * len(fns)

    def run(i):
        try:
            out[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a simulated process did not finish"
    return out


@pytest.fixture
def coordinator():
    """A jax coordination service and two connected clients, as two processes would hold."""
    from jax._src.lib import _jax

    with reserved_port() as port:
        service = _jax.get_distributed_runtime_service(f"[::]:{port}", 2, heartbeat_timeout=100,
                                                       shutdown_timeout=10)
        clients = [_jax.get_distributed_runtime_client(f"localhost:{port}", i, init_timeout=20,
                                                       heartbeat_timeout=100, shutdown_timeout=10)
                   for i in range(2)]
        in_threads([c.connect for c in clients])
        try:
            yield clients
        finally:
            in_threads([c.shutdown for c in clients])
            service.shutdown()


class Aborted(Exception):
    pass


def peers_of(clients, timeout_s=6.0):
    """Peers of the simulated processes, whose abort raises instead of ending the test process."""
    peers = [Peers(timeout_s, client=c, process_index=i, process_count=len(clients), watch=False)
             for i, c in enumerate(clients)]
    for p in peers:
        def abort(code, message, **_):
            raise Aborted(code, message)
        p.abort = abort
    return peers


# -- the peer timeout, read before jax starts -----------------------------------------------------
def test_peer_timeout_is_read_from_gin_files_includes_and_params(tmp_path):
    assert launch.DEFAULT_PEER_TIMEOUT_S == ResilienceConfig().peer_timeout_s
    base = tmp_path / "base.gin"
    base.write_text("ResilienceConfig.peer_timeout_s = 25\nTrainConfig.steps = 3\n")
    top = tmp_path / "top.gin"
    top.write_text("include 'base.gin'\nExperiment.model = @LlamaConfig()\n")
    assert launch.peer_timeout_s([str(top)], []) == 25.0
    assert launch.peer_timeout_s([str(top)], ["jaxtrain.ResilienceConfig.peer_timeout_s=7.5"]) == 7.5
    assert launch.peer_timeout_s([str(top)], ["TrainConfig.steps=4"]) == 25.0
    assert launch.peer_timeout_s([launch.DEFAULT_GIN], []) == launch.DEFAULT_PEER_TIMEOUT_S
    assert launch.peer_timeout_s([str(top)], ["ResilienceConfig.peer_timeout_s='x'"]) == launch.DEFAULT_PEER_TIMEOUT_S
    # a saved config.gin from before the split binds the old name: still read, the new one wins
    assert launch.peer_timeout_s([launch.DEFAULT_GIN], ["TrainConfig.peer_timeout_s=9"]) == 9.0
    assert launch.peer_timeout_s([str(top)], ["TrainConfig.peer_timeout_s=9"]) == 25.0


# -- peers ----------------------------------------------------------------------------------------
def test_a_silent_peer_is_dead_after_the_bound_and_a_failure_is_quoted(coordinator):
    peers = Peers(10.0, client=coordinator[0], process_index=0, process_count=2, watch=False)
    peers._hosts[1] = "nodeB"
    assert peers.dead_after + 2 * peers.period <= peers.timeout_s
    t0 = time.monotonic()
    # process 1 has never beaten: it may still be starting, so it gets twice the bound
    assert peers._observe({}, t0 + 1.5 * peers.dead_after) is None
    assert peers._observe({"beat/1": "1"}, t0 + 1.5 * peers.dead_after) is None  # now it has
    assert peers._observe({"beat/1": "2"}, t0 + 2.0 * peers.dead_after) is None
    verdict = peers._observe({"beat/1": "2"}, t0 + 3.01 * peers.dead_after)
    assert verdict and verdict.startswith("process 0: process 1 (nodeB) stopped responding"), verdict
    # a peer that left normally is not waited for; a peer's failure is quoted, naming it
    assert peers._observe({"beat/1": "2", "gone/1": "ok"}, t0 + 9 * peers.dead_after) is None
    verdict = peers._observe({"failed/1": "process 1: checkpoint save of step 4 failed: disk full"}, t0)
    assert verdict == ("process 0: stopping because process 1 (nodeB) failed: "
                       "checkpoint save of step 4 failed: disk full")


def test_the_shared_directory_check_passes_on_one_directory(coordinator, tmp_path):
    peers = peers_of(coordinator)
    assert in_threads([lambda p=p: p.check_shared_directory(str(tmp_path / "ckpt")) for p in peers]) == [None, None]
    assert os.listdir(tmp_path / "ckpt") == []  # the marker is removed


def test_node_local_checkpoint_directories_are_refused_on_every_process(coordinator, tmp_path):
    peers = peers_of(coordinator)
    errors = in_threads([lambda p=p: p.check_shared_directory(str(tmp_path / f"node{p.index}" / "ckpt"))
                         for p in peers])
    for e in errors:
        assert isinstance(e, ValueError), e
        assert f"process 1 (host {peers[1].host}, {tmp_path / 'node1' / 'ckpt'})" in str(e)
        assert f"process 0 (host {peers[0].host})" in str(e)


# -- the stop agreement ---------------------------------------------------------------------------
class Lockstep:
    """Collectives keep processes within a step of each other: a process reaches the boundary
    after step s having fetched step s - 1's metrics, which needs every process to have
    dispatched step s - 1, i.e. to be past boundary s - 1."""

    def __init__(self, n):
        self.done = [0] * n
        self.cond = threading.Condition()

    def finished(self, i, step):
        with self.cond:
            self.done[i] = step
            self.cond.notify_all()

    def may_start(self, i, step):
        with self.cond:
            assert self.cond.wait_for(lambda: min(self.done) >= step - 1, timeout=30)


def run_with_signals(signals, lockstep, i, end, signal_at=None, pace=0.0):
    """A loop as TrainLoop runs it: returns the step it stopped at."""
    for step in range(1, end + 1):
        lockstep.may_start(i, step)
        time.sleep(pace)
        if step == signal_at:
            signals._on_signal(signal.SIGTERM, None)  # what the handler does when the signal arrives
        lockstep.finished(i, step)
        if signals.should_stop(step):
            return step
    return end


@pytest.mark.parametrize("signalled, paces", [(1, (0.0, 0.05)), (0, (0.05, 0.0)), (1, (0.02, 0.02))])
def test_every_process_stops_at_the_same_step_when_one_is_signalled(coordinator, signalled, paces):
    peers = peers_of(coordinator)
    signals = [StopSignals(p, last_step=30) for p in peers]
    lockstep = Lockstep(2)
    stopped = in_threads([lambda i=i: run_with_signals(signals[i], lockstep, i, 30,
                                                       signal_at=6 if i == signalled else None, pace=paces[i])
                          for i in range(2)])
    assert stopped[0] == stopped[1], stopped
    assert 6 <= stopped[0] <= 9, stopped
    assert signals[1 - signalled].request == f"process {signalled}: SIGTERM"


def test_a_request_while_a_peer_finishes_the_run_stops_at_the_last_step(coordinator):
    """Process 0 passes its last boundary without a request, then process 1 is signalled at its
    own boundary 4: it gets process 0's last step instead of waiting for it at boundary 5, and
    the run ends normally (the stop step is past the end)."""
    peers = peers_of(coordinator)
    signals = [StopSignals(p, last_step=5) for p in peers]
    assert [signals[0].should_stop(s) for s in range(1, 6)] == [False] * 5
    signals[1]._on_signal(signal.SIGTERM, None)
    t0 = time.monotonic()
    assert not signals[1].should_stop(4) and not signals[1].should_stop(5)
    assert signals[1].stop_at == 6 and time.monotonic() - t0 < 2


def test_processes_that_see_the_request_at_different_steps_agree_on_the_later_one(coordinator):
    """Process 1 passed boundary 7 before process 0, signalled in step 6, published the request at
    its boundary 6. Process 0 must not wait there for process 1's step: process 1's next boundary
    needs process 0's step 7 (a collective), so waiting would deadlock until the peer timeout.
    Process 1 learns of the request at boundary 8: both stop at 9 = 1 + the later step seen."""
    peers = peers_of(coordinator, timeout_s=3.0)
    signals = [StopSignals(p, last_step=30) for p in peers]
    assert not signals[1].should_stop(7)  # no request yet
    signals[0]._on_signal(signal.SIGTERM, None)
    t0 = time.monotonic()
    assert not signals[0].should_stop(6)  # publishes the request and its step 6, goes on
    assert time.monotonic() - t0 < 1.0, "process 0 waited at a boundary that cannot be the stop step"
    assert not signals[1].should_stop(8)  # sees the request, publishes 8: the stop is at 9
    assert [s.stop_at for s in signals] == [None, 9]
    assert [signals[0].should_stop(step) for step in (7, 8, 9)] == [False, False, True]
    assert signals[1].should_stop(9)
    assert [s.stop_at for s in signals] == [9, 9] and signals[1].request == "process 0: SIGTERM"


def test_a_peer_that_stops_before_its_first_step_stops_this_process_with_exit_0(coordinator):
    peers = Peers(10.0, client=coordinator[0], process_index=0, process_count=2, watch=False)
    peers._hosts[1] = "nodeB"
    message = "process 1: stopped before its first step on SIGTERM (received during start-up: restore or compilation)"
    verdict = peers._observe({"stopped/1": message, "gone/1": "stopped"}, time.monotonic())
    assert verdict == ("process 0: stopping because process 1 (nodeB) stopped before its first step on SIGTERM "
                       "(received during start-up: restore or compilation)")
    left = []
    with mock.patch.object(Peers, "_leave", lambda self, code, how="failed": left.append((code, how))), \
            mock.patch.object(Peers, "abort", lambda self, code, *a, **k: left.append((code, "abort"))):
        peers._end_on(verdict)
    assert left[0] == (exit_codes.OK, "stopped")
    # a peer's failure outranks its stop: exit PEER
    assert peers._observe({"failed/1": "process 1: disk full"}, time.monotonic()).endswith("failed: disk full")
    left.clear()
    with mock.patch.object(Peers, "_leave", lambda self, code, how="failed": left.append((code, how))), \
            mock.patch.object(Peers, "abort", lambda self, code, *a, **k: left.append((code, "abort"))):
        peers._end_on("x")
    assert left[0] == (exit_codes.PEER, "abort")


def test_one_process_stops_at_the_step_the_signal_arrived_in():
    before = signal.getsignal(signal.SIGTERM)
    signals = StopSignals(None).install()
    try:
        assert not signals.should_stop(1)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert signals.requested == "SIGTERM" and signals.should_stop(2) and signals.stop_at == 2
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGTERM) is before


def run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = child_env(PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_a_second_sigint_exits_at_once_without_saving():
    proc = run_python(
        "import os, signal, time\n"
        "from jaxtrain.resilience.preemption import StopSignals\n"
        "s = StopSignals().install()\n"
        "os.kill(os.getpid(), signal.SIGINT); time.sleep(0.1)\n"
        "assert s.should_stop(3)\n"
        "os.kill(os.getpid(), signal.SIGINT); time.sleep(5)\n"
        "print('not reached')\n")
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr
    assert "not reached" not in proc.stdout
    assert "process 0: SIGINT received: finishing the current step" in proc.stderr
    assert "error: process 0: second SIGINT: exiting at once, without saving" in proc.stderr


# -- the watchdog ---------------------------------------------------------------------------------
def test_the_hang_limit_follows_the_median_step_after_the_warmup():
    w = Watchdog(factor=10, min_seconds=0.5, first_steps_s=7.0, warmup=2)
    t = [100.0]
    with mock.patch.object(time, "monotonic", lambda: t[0]):
        w.step_started(1)
        for step, seconds in enumerate([3.0, 2.0, 0.01, 0.2, 0.01], start=1):
            w.step_started(step + 1)  # dispatched before the previous step's metrics are fetched
            t[0] += seconds
            w.step_finished(step)
            assert w.warming_up == (step <= 2)
            assert (w.limit() == 7.0) == (step <= 2)  # the first steps (compilation) have their own bound
        assert w.limit() == pytest.approx(0.5)  # 10 x median(0.01, 0.2, 0.01) = 0.1 < min_seconds
        w._durations.extend([0.2, 0.2, 0.2])
        assert w.limit() == pytest.approx(2.0)
        before = w._since
        with w.phase("save"):  # a phase's time is not step time
            t[0] += 30
        assert w._since == before + 30
        w.step_started(4)  # a replay after a rollback restarts the steps from 4
        assert sorted(w._in_flight) == [4]


def test_each_part_of_the_run_has_its_own_bound():
    """The first steps from the start, then restores, saves and evals (nested too), each against
    its own bound; the line names the part and the bound's knob."""
    w = Watchdog(factor=10, min_seconds=1.0, first_steps_s=50.0, bounds={"restore": 40.0, "save": 20.0, "eval": 30.0})
    t = [0.0]
    with mock.patch.object(time, "monotonic", lambda: t[0]):
        assert w._overdue(1e6) is None  # nothing in flight: nothing to time
        with w.phase("restore", "the restore"):
            assert w._overdue(40.0) is None
            assert w._overdue(40.5) == ("process 0: hung: the restore has not finished after 40 s, over the bound "
                                        "ResilienceConfig.hang_restore_s=40")
        t[0] = 100.0
        w.step_started(1)  # compiles first: no measured steps yet, the first-steps bound
        assert w._overdue(150.0) is None
        assert "(step 1 in flight, among the first 2 steps, compilation included), over the bound " \
               "ResilienceConfig.hang_first_steps_s=50" in w._overdue(150.5)
        with w.phase("save", "the save of step 1"):
            with w.phase("eval", "the eval at step 1"):  # nested: each keeps its own bound
                assert w._overdue(100.0 + 20.5).startswith("process 0: hung: the save of step 1 has not finished")
                t[0] = 131.0  # both over: the inner one, where the time goes, is named
                assert w._overdue(131.0) == ("process 0: hung: the eval at step 1 has not finished after 31 s, "
                                             "over the bound ResilienceConfig.hang_eval_s=30")
            assert w._overdue(105.0) is None  # while a part runs, the step's time stands still
        assert w._since == 131.0  # the 31 s spent in the save and eval moved the step's start
        assert w._overdue(131.0 + 50.5) is not None and w._overdue(131.0 + 49.5) is None
        with pytest.raises(ValueError, match="unknown watchdog phase 'compile'"):
            with w.phase("compile"):
                pass


def test_a_hung_step_dumps_every_threads_stack_and_exits_hang():
    proc = run_python(
        "import time\n"
        "from jaxtrain.resilience.watchdog import Watchdog\n"
        "w = Watchdog(factor=5, min_seconds=1.0, warmup=1).start()\n"
        "w.step_started(1)\n"
        "for step in range(1, 6):\n"
        "    w.step_started(step + 1); time.sleep(0.02); w.step_finished(step)\n"
        "def a_step_that_never_ends():\n"
        "    time.sleep(60)\n"
        "w.step_started(7)\n"
        "a_step_that_never_ends()\n")
    assert proc.returncode == exit_codes.HANG, proc.stderr
    assert "error: process 0: hung: no step finished for 1 s (steps 6-7 in flight), over the limit 1 s" in proc.stderr
    assert "every thread's stack follows" in proc.stderr
    assert "a_step_that_never_ends" in proc.stderr and "Thread" in proc.stderr  # the main thread's stack
    assert "jaxtrain/resilience/watchdog.py" in proc.stderr  # and the watchdog's own thread
