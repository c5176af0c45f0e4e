"""SIGTERM or SIGINT before the first step (while the run restores or compiles) through the real
CLI on a tiny model: exit 0 at once with one line saying the run stopped before its first step on
that signal, and nothing written (no checkpoint, no metrics, no half-written file); with two
processes, the one signalled and the other alike. The restore and the first step are slowed by
injection (tests/faults/peer_faults.py), and the signal sent once the process says it is there."""
import pytest
import os
import pathlib
import re
import signal

from cli_runs import train_args
from live_runs import Live, process_args, reserved_port, running

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.end_to_end, pytest.mark.extended]

STOPPED = ("jaxtrain: process {i}: stopped before its first step on {sig} (received during start-up: restore or "
           "compilation); nothing was saved")
# What start-up may leave: the workdir lock (flock, released at exit), the checkpoint directory
# (empty) and, once the checkpoints are known to fit, the whole config.gin.
MAY_EXIST = {".jaxtrain.lock", "checkpoints", "config.gin"}


def written(workdir) -> list[str]:
    root = pathlib.Path(workdir)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def assert_nothing_written(workdir, config_gin: bool) -> None:
    files = written(workdir)
    assert set(files) <= MAY_EXIST, files
    assert ("config.gin" in files) == config_gin, files
    if config_gin:  # whole: what the CLI keeps is gin's config string, which names the model
        assert "LlamaConfig.embed = 32" in (pathlib.Path(workdir) / "config.gin").read_text()


def stop_in_startup(workdir, fault: dict, sig, marker: str) -> Live:
    with running() as procs:
        procs.append(p := Live(train_args(workdir, "TrainConfig.steps=4"), fault_env=fault))
        p.wait_for(marker, 180)
        p.popen.send_signal(sig)
        assert p.wait(30) == 0, p.stderr[-3000:]
    assert p.ended - p.started < 150  # at once, not after the injected 600 s
    return p


def test_sigterm_during_the_restore_exits_0_at_once_and_writes_nothing(tmp_path):
    workdir = tmp_path / "run"
    p = stop_in_startup(workdir, {"FAULT_HANG_IN": "restore"}, signal.SIGTERM, r"^fault: in restore")
    lines = [line.rstrip() for line in p.err if "stopped before its first step" in line]
    assert lines == [STOPPED.format(i=0, sig="SIGTERM")], p.stderr[-3000:]
    assert p.errors() == [] and "Traceback" not in p.stderr
    assert_nothing_written(workdir, config_gin=False)


def test_sigint_while_the_first_step_compiles_exits_0_at_once_and_writes_nothing(tmp_path):
    workdir = tmp_path / "run"
    p = stop_in_startup(workdir, {"FAULT_FIRST_STEP_S": "600"}, signal.SIGINT, r"^fault: in the first step")
    lines = [line.rstrip() for line in p.err if "stopped before its first step" in line]
    assert lines == [STOPPED.format(i=0, sig="SIGINT")], p.stderr[-3000:]
    assert p.errors() == [] and "Traceback" not in p.stderr
    assert_nothing_written(workdir, config_gin=True)


def test_sigterm_to_one_of_two_processes_during_the_restore_stops_both_with_exit_0(tmp_path):
    workdir = tmp_path / "run"
    with reserved_port() as port, running() as procs:
        bindings = ["TrainConfig.steps=4", "ResilienceConfig.peer_timeout_s=20"]
        fault = {"FAULT_HANG_IN": "restore", "FAULT_PROCESS": "1"}
        procs += [Live(process_args(workdir, bindings, port, i, 2), fault_env=fault) for i in range(2)]
        procs[1].wait_for(r"^fault: in restore", 180)
        procs[1].popen.send_signal(signal.SIGTERM)
        assert [p.wait(60) for p in procs] == [0, 0], [p.stderr[-2000:] for p in procs]
    assert STOPPED.format(i=1, sig="SIGTERM") in procs[1].stderr
    [line] = [x for x in procs[0].stderr.splitlines() if "stopping because" in x]
    assert re.fullmatch(r"jaxtrain: process 0: stopping because process 1 \(.*\) stopped before its first step on "
                        r"SIGTERM \(received during start-up: restore or compilation\); nothing was saved", line), line
    assert all(p.errors() == [] for p in procs), [p.errors() for p in procs]
    files = written(workdir)
    assert set(files) <= MAY_EXIST and not any(f.startswith("checkpoints/") for f in files), files
    assert os.path.exists(workdir)
