"""Two processes of one run on localhost (gloo), through the real CLI: a process that never
joins, a worker killed with SIGKILL mid-training, a save failing in one process, checkpoint
directories that are not shared. Every survivor ends within the peer timeout with one error
line saying which process and what; none waits silently or dies in a C++ stack dump."""
import pytest
import socket
import time

from cli_runs import steps_on_disk
from jaxtrain.resilience import exit_codes
from live_runs import Live, process_args, reserved_port, running

# Process-level runs (the suite's budget): `make test-extended`, which CI runs after the suite; the
# parts they put together are tested in tests/faults/test_resilience_parts.py.
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.end_to_end, pytest.mark.extended]

T = 15  # ResilienceConfig.peer_timeout_s for these runs
HOST = socket.gethostname()


def no_crash_dump(p: Live) -> None:
    assert "Check failure stack trace" not in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]


def start_two(procs, workdirs, bindings, port, fault_env=None):
    procs += [Live(process_args(workdirs[i], [*bindings, f"ResilienceConfig.peer_timeout_s={T}"], port, i, 2),
                   fault_env=fault_env) for i in range(2)]
    return procs


def test_a_process_that_never_joins_ends_the_started_one_within_the_timeout(tmp_path):
    """Process 0 alone waits for process 1 at the coordinator; process 1 alone (on another port)
    finds none."""
    timeout = 8
    bindings = ["TrainConfig.steps=3", f"ResilienceConfig.peer_timeout_s={timeout}"]
    with reserved_port() as port, reserved_port() as unserved, running() as procs:
        procs += [Live(process_args(tmp_path / f"run{i}", bindings, (port, unserved)[i], i, 2), wrapper=None)
                  for i in range(2)]
        codes = [p.wait(timeout + 60) for p in procs]
    assert codes == [exit_codes.PEER] * 2, [p.stderr[-2000:] for p in procs]
    assert procs[0].errors() == [f"error: process 0: not all 2 processes joined the coordinator at localhost:{port} "
                                 f"within {timeout} s (ResilienceConfig.peer_timeout_s)"]
    assert procs[1].errors() == [f"error: process 1: cannot reach the coordinator at localhost:{unserved} (is process "
                                 f"0 running there?) within {timeout} s (ResilienceConfig.peer_timeout_s)"]
    for i, p in enumerate(procs):
        assert timeout <= p.ended - p.started < timeout + 30  # jax's start-up, then the bound
        no_crash_dump(p)
        assert not (tmp_path / f"run{i}").exists()


def test_a_worker_killed_mid_training_ends_the_other_within_the_timeout(tmp_path):
    with reserved_port() as port, running() as procs:
        start_two(procs, [tmp_path / "run"] * 2, ["TrainConfig.steps=500"], port, {"FAULT_STEP_SLEEP": "0.2"})
        procs[0].wait_for(r"^step 3 \[train\]", 180)
        procs[1].popen.kill()
        killed = time.monotonic()
        code = procs[0].wait(T + 60)
    assert code == exit_codes.PEER, procs[0].stderr[-3000:]
    assert procs[0].ended - killed <= T + 2  # the bound, plus scheduling on a loaded machine
    [line] = procs[0].errors()
    assert line.startswith(f"error: process 0: process 1 ({HOST}) stopped responding: no heartbeat"), line
    no_crash_dump(procs[0])


def test_a_save_failing_in_one_process_ends_both_naming_it(tmp_path):
    with reserved_port() as port, running() as procs:
        start_two(procs, [tmp_path / "run"] * 2, ["TrainConfig.steps=10", "CheckpointConfig.checkpoint_every=2"], port,
                  {"FAULT_PROCESS": "1", "FAULT_SAVE_FAILS": "4"})
        codes = [p.wait(180) for p in procs]
    assert codes == [exit_codes.PEER, exit_codes.CHECKPOINT], [p.stderr[-2000:] for p in procs]
    [failure] = procs[1].errors()
    assert failure.startswith("error: process 1: saving step 4 to ") and "No space left on device" in failure
    what = failure[len("error: process 1: "):]
    assert procs[0].errors() == [f"error: process 0: stopping because process 1 ({HOST}) failed: {what}"]
    assert abs(procs[0].ended - procs[1].ended) < T
    assert steps_on_disk(tmp_path / "run") == [2]
    for p in procs:
        no_crash_dump(p)


def test_node_local_checkpoint_directories_end_both_before_training(tmp_path):
    """Node-local disks, simulated by giving the two processes different workdirs: process 1's
    checkpoint directory is not the one process 0 writes to."""
    workdirs = [tmp_path / "node0" / "run", tmp_path / "node1" / "run"]
    with reserved_port() as port, running() as procs:
        start_two(procs, workdirs, ["TrainConfig.steps=3"], port)
        codes = [p.wait(120) for p in procs]
    assert codes == [exit_codes.BAD_INPUT] * 2, [p.stderr[-2000:] for p in procs]
    for i, p in enumerate(procs):
        [line] = p.errors()
        assert line.startswith(f"error: process {i}: the checkpoint directory is not one directory shared by every "
                               f"process: process 1 (host {HOST}, {workdirs[1] / 'checkpoints'}) cannot see the marker "
                               f"that process 0 (host {HOST}) wrote in {workdirs[0] / 'checkpoints'}"), line
        assert "[train]" not in p.stdout
        assert steps_on_disk(workdirs[i]) == [] and not (workdirs[i] / "metrics.jsonl").exists()
        assert not [f for f in (workdirs[i] / "checkpoints").iterdir()]  # the marker is gone too
