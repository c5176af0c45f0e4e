"""Saves that die or fail, in subprocesses of the real CLI: kill -9 before, during and after the
commit of a step leaves no step that looks complete, and the resume trains on as the
uninterrupted run did; a full disk ends the run with exit 4 and one line soon after the failed
save (not a checkpoint interval later), keeping the checkpoints already written."""
import contextlib
import signal
import subprocess

import numpy as np
import pytest

from cli_runs import EVERY_3 as EVERY
from cli_runs import losses, rows, steps_on_disk, train, uninterrupted
from jaxtrain.resilience import exit_codes

pytestmark = [pytest.mark.slow, pytest.mark.end_to_end]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return uninterrupted(tmp_path_factory.mktemp("reference") / "run")


# "during" stays in the suite; the other two points run in `make test-extended` (time budget).
@pytest.mark.parametrize("point, survivor", [pytest.param("before", 3, marks=pytest.mark.extended), ("during", 3),
                                             pytest.param("after", 6, marks=pytest.mark.extended)])
def test_kill_9_at_a_save_loses_nothing_that_was_committed(tmp_path, reference, point, survivor):
    workdir = tmp_path / "run"
    killed = train(workdir, "TrainConfig.steps=9", *EVERY, wrapper="save_faults.py",
                   fault_env={"FAULT_SAVE_STEP": "6", "FAULT_KILL": point})
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-3000:])
    assert steps_on_disk(workdir) == [3, 6][: [3, 6].index(survivor) + 1]  # step 6 complete only if committed
    resumed = train(workdir, "TrainConfig.steps=9", *EVERY)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"steps {survivor}->9" in resumed.stdout and "warning" not in resumed.stderr
    after = losses(workdir)  # one row per step
    assert sorted(after) == list(range(1, 10))
    np.testing.assert_allclose([after[s] for s in range(1, 10)], [reference[s] for s in range(1, 10)], rtol=1e-6)


@contextlib.contextmanager
def small_disk(path, size: str):
    """A tmpfs of `size` mounted at `path` (None when this machine does not allow mounting)."""
    path.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_disk_full_ends_the_run_at_once_with_one_line(tmp_path):
    workdir = tmp_path / "run"
    with small_disk(workdir / "checkpoints", "900k") as mounted:  # room for a checkpoint or two
        fault = {} if mounted else {"FAULT_SAVE_STEP": "4", "FAULT_NO_SPACE": "1"}
        proc = train(workdir, "TrainConfig.steps=40", "CheckpointConfig.checkpoint_every=2",
                     wrapper=None if mounted else "save_faults.py", fault_env=fault)
        assert proc.returncode == exit_codes.CHECKPOINT, proc.stderr[-3000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("error: process 0: saving step ") and "No space left on device" in last, last
        assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) < 20, proc.stderr[-3000:]
        failed = int(last.split("saving step ")[1].split(" ")[0])
        # it stopped within a step or two of the failed save, not a checkpoint interval later
        assert max(r["step"] for r in rows(workdir)) <= failed + 2
        assert steps_on_disk(workdir) and max(steps_on_disk(workdir)) < failed
