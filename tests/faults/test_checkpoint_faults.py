"""Damaged checkpoints, in subprocesses of the real CLI: a resume falls back past a corrupt newest
step (flipped bytes, a truncated file, garbled metadata) with a warning naming it, moves it aside,
and then trains exactly as the uninterrupted run did; a missing item is an error unless reset on
purpose; a resume with another model shape is refused before the workdir changes; a second
trainer on a workdir in use is refused."""
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from cli_runs import EVERY_3 as EVERY
from cli_runs import REPO, env, losses, rows, steps_on_disk, train, train_args, uninterrupted
from jaxtrain.resilience import exit_codes

pytestmark = [pytest.mark.slow, pytest.mark.end_to_end]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("reference") / "run"
    return workdir, uninterrupted(workdir)


def died_after_step_8(reference, tmp_path) -> pathlib.Path:
    """The reference workdir as a run that died after step 8 would leave it: checkpoints 3 and 6,
    metrics rows up to 8 (the rows after the checkpoint are replayed by the resume)."""
    workdir = tmp_path / "run"
    shutil.copytree(reference[0], workdir)
    shutil.rmtree(workdir / "checkpoints" / "9")
    kept = [line for line in (workdir / "metrics.jsonl").read_text().splitlines(keepends=True)
            if '"step": 9,' not in line]
    (workdir / "metrics.jsonl").write_text("".join(kept))
    return workdir


def largest_file(directory: pathlib.Path) -> pathlib.Path:
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def flip_bytes(step_dir):
    path = largest_file(step_dir / "params")
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 64):  # 64 bytes in the middle of the data
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def params_of_another_step(step_dir):
    """The params item replaced by step 3's: every file intact and readable, every value wrong.
    Only the fingerprints in step 6's manifest can tell (a bit flip in a compressed chunk may
    instead fail to decode, depending on where the flip lands)."""
    shutil.rmtree(step_dir / "params")
    shutil.copytree(step_dir.parent / "3" / "params", step_dir / "params")


def truncate(step_dir):
    path = largest_file(step_dir / "params")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def garble_step_metadata(step_dir):
    (step_dir / "_CHECKPOINT_METADATA").write_text('{"item_handlers": {"params": ')


def garble_array_metadata(step_dir):
    (step_dir / "opt_state" / "_METADATA").write_text("\x00\x13 not json")


@pytest.mark.parametrize("damage, says", [
    # two kinds of damage run in `make test-extended` (time budget); flip_bytes keeps the data case here
    pytest.param(params_of_another_step, "fingerprint mismatch", marks=pytest.mark.extended),
    (flip_bytes, "step 6:"),  # a fingerprint mismatch, or a chunk that no longer decodes
    pytest.param(truncate, "step 6:", marks=pytest.mark.extended),
    (garble_step_metadata, "step 6: unreadable step metadata"),
    (garble_array_metadata, "step 6: cannot be read"),
])
def test_corrupt_newest_step_falls_back_and_trains_on_identically(reference, tmp_path, damage, says):
    workdir = died_after_step_8(reference, tmp_path)
    damage(workdir / "checkpoints" / "6")
    proc = train(workdir, "TrainConfig.steps=9", *EVERY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warning = [line for line in proc.stderr.splitlines() if line.startswith("warning: checkpoint")]
    assert len(warning) == 1 and says in warning[0] and "falling back" in warning[0], proc.stderr[-3000:]
    assert "steps 3->9" in proc.stdout
    quarantined = list((workdir / "checkpoints_corrupt").iterdir())
    assert [p.name.split("-")[0] for p in quarantined] == ["6"]  # moved aside, not deleted
    assert steps_on_disk(workdir) == [3, 6, 9]
    resumed = losses(workdir)  # one row per step (the replayed rows 4..8 were rewritten)
    assert sorted(resumed) == list(range(1, 10))
    np.testing.assert_allclose([resumed[s] for s in range(4, 10)], [reference[1][s] for s in range(4, 10)],
                               rtol=1e-6)


def test_strict_restore_exits_with_one_line_and_moves_nothing(reference, tmp_path):
    workdir = died_after_step_8(reference, tmp_path)
    params_of_another_step(workdir / "checkpoints" / "6")
    proc = train(workdir, "TrainConfig.steps=9", "CheckpointConfig.strict_restore=True", *EVERY)
    assert proc.returncode == exit_codes.CHECKPOINT, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: step 6: ")
    assert "fingerprint mismatch" in proc.stderr and "Traceback" not in proc.stderr
    assert steps_on_disk(workdir) == [3, 6] and not (workdir / "checkpoints_corrupt").exists()


@pytest.mark.parametrize("item", ["opt_state", pytest.param("data", marks=pytest.mark.extended)])
def test_missing_item_is_an_error_unless_reset_on_purpose(reference, tmp_path, item):
    workdir = died_after_step_8(reference, tmp_path)
    shutil.rmtree(workdir / "checkpoints" / "6" / item)
    proc = train(workdir, "TrainConfig.steps=9", *EVERY)
    assert proc.returncode == exit_codes.CHECKPOINT, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert f"has no {item} item" in last and f"reset_on_resume=('{item}',)" in last, last
    assert steps_on_disk(workdir) == [3, 6]

    proc = train(workdir, "TrainConfig.steps=9", f"CheckpointConfig.reset_on_resume=('{item}',)", *EVERY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "steps 6->9" in proc.stdout
    resumed = losses(workdir)
    assert np.isfinite(list(resumed.values())).all()
    if item == "opt_state":  # step 7's loss uses step 6's params; fresh Adam moments change step 8 on
        np.testing.assert_allclose(resumed[7], reference[1][7], rtol=1e-6)
        assert abs(resumed[8] - reference[1][8]) > 1e-4
    else:  # the data stream restarts at batch 0: step 7 sees another batch
        assert abs(resumed[7] - reference[1][7]) > 1e-4


def test_resume_with_another_model_shape_is_refused_before_the_workdir_changes(reference, tmp_path):
    workdir = died_after_step_8(reference, tmp_path)
    before = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file() and p.name != ".jaxtrain.lock"}
    proc = train(workdir, "TrainConfig.steps=9", "LlamaConfig.embed=48", "LlamaConfig.mlp=96", *EVERY)
    assert proc.returncode == exit_codes.BAD_INPUT, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "LlamaConfig.embed 32 -> 48" in last and "LlamaConfig.mlp 64 -> 96" in last, last
    assert "Traceback" not in proc.stderr
    after = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file() and p.name != ".jaxtrain.lock"}
    assert after == before  # config.gin, metrics and checkpoints untouched


def test_second_trainer_on_the_same_workdir_is_refused(tmp_path):
    workdir = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "jaxtrain.cli.train",
                              *train_args(workdir, "TrainConfig.steps=400", "CheckpointConfig.checkpoint_every=0")],
                             cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in first.stdout:  # wait until the first trainer holds the workdir
            if line.startswith("jaxtrain:"):
                break
        second = train(workdir, "TrainConfig.steps=3")
        assert second.returncode == exit_codes.BAD_INPUT, second.stderr[-3000:]
        last = second.stderr.strip().splitlines()[-1]
        assert "is in use by another trainer" in last and f"pid {first.pid}" in last, last
        assert first.poll() is None  # the first one goes on undisturbed
    finally:
        first.kill()
        first.wait()
    # the kernel dropped the dead trainer's lock: a new one may start
    proc = train(workdir, "TrainConfig.steps=2", "CheckpointConfig.checkpoint_every=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in rows(workdir)] == [1, 2]


def test_a_parameters_only_save_restores_without_optimizer_or_data(tmp_path):
    """A params-only checkpoint (an imported model to fine-tune) is marked so: restoring it with a
    data iterator and optimizer state wanted is not the missing-item error."""
    import jax

    from helpers import TINY_LLAMA_BYTES, TINY_OPT
    from jaxtrain.checkpoints.checkpointer import Checkpointer
    from jaxtrain.data.packing import DataConfig, make_train_iterator
    from jaxtrain.training.optim import make_optimizer
    from jaxtrain.training.state import init_state, state_shardings
    from jaxtrain.meshes.mesh import MeshConfig, build_mesh
    from jaxtrain.meshes.rules import get_rule_set

    tx, _ = make_optimizer(TINY_OPT, 3)
    _, abstract, shardings = state_shardings(TINY_LLAMA_BYTES, tx, build_mesh(MeshConfig(data=16)), get_rule_set("dp"))
    state = init_state(TINY_LLAMA_BYTES, tx, shardings, seed=0)
    checkpointer = Checkpointer(str(tmp_path / "checkpoints"), async_save=False)
    checkpointer.save(0, {"params": state.params})
    iterator = make_train_iterator(DataConfig(), seq_len=32, global_batch=16, seed=0)
    step, restored, manifest = checkpointer.restore_latest(abstract.checkpoint_items(), iterator)
    checkpointer.close()
    assert step == 0 and set(restored) == {"params"} and manifest["kind"] == "converted"
    np.testing.assert_array_equal(jax.device_get(restored["params"]["embed"]["table"]),
                                  jax.device_get(state.params["embed"]["table"]))


# -- config changes are not corruption; unverifiable steps are not trained on ----------------------------

def files_of(workdir) -> dict:
    return {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file() and p.name != ".jaxtrain.lock"}


@pytest.mark.extended
def test_resume_with_other_clipping_and_roles_carries_the_optimizer_state_over_with_one_line_each(reference, tmp_path):
    """Clipping off: the chain's positions move, the Adam moments fit. Two parameters switched to
    no_decay (as Mamba-2's A_log/D/dt_bias were): named in one line."""
    workdir = died_after_step_8(reference, tmp_path)
    proc = train(workdir, "TrainConfig.steps=9", "OptimizerConfig.clip_norm=None", *EVERY,
                 wrapper="optimizer_faults.py", fault_env={"FAULT_NO_DECAY": "head/kernel,mlp/up/kernel"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = [line for line in proc.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 2, proc.stderr[-3000:]
    assert notes[0].startswith("note: step 6: opt_state carried over"), notes
    assert notes[1] == ("note: optimizer roles changed since step 6 was saved (2 parameters): head/kernel "
                        "decay -> no_decay, stacks/blocks/layers/mlp/up/kernel decay -> no_decay"), notes
    assert "steps 6->9" in proc.stdout and not (workdir / "checkpoints_corrupt").exists()
    resumed = losses(workdir)
    assert np.isfinite(list(resumed.values())).all()
    np.testing.assert_allclose(resumed[7], reference[1][7], rtol=1e-6)  # step 6's params, not a fresh start


@pytest.mark.extended
def test_resume_with_an_optimizer_of_another_structure_is_refused_and_moves_nothing(reference, tmp_path):
    workdir = died_after_step_8(reference, tmp_path)
    before = files_of(workdir)
    proc = train(workdir, "TrainConfig.steps=9", *EVERY, wrapper="optimizer_faults.py",
                 fault_env={"FAULT_MOMENTUM_TRACE": "1"})
    assert proc.returncode == exit_codes.BAD_INPUT, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: step 6 in ") and "the saved opt_state does not fit" in last, last
    assert "(leaves only now: 12 (1/trace/embed/table, 1/trace/final_norm/scale, " in last, last
    assert "only saved" not in last, last
    assert "Traceback" not in proc.stderr and "warning: checkpoint" not in proc.stderr
    assert files_of(workdir) == before and not (workdir / "checkpoints_corrupt").exists()

    proc = train(workdir, "TrainConfig.steps=9", *EVERY)  # the config that wrote it: resumes, not restarts
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "steps 6->9" in proc.stdout
    resumed = losses(workdir)
    assert np.isfinite([resumed[s] for s in range(7, 10)]).all()
    np.testing.assert_allclose([resumed[s] for s in range(7, 10)], [reference[1][s] for s in range(7, 10)],
                               rtol=1e-6)


@pytest.mark.extended
def test_a_step_without_manifest_is_refused_unless_allowed(reference, tmp_path):
    workdir = died_after_step_8(reference, tmp_path)
    (workdir / "checkpoints" / "6" / "_CHECKPOINT_METADATA").unlink()
    params_of_another_step(workdir / "checkpoints" / "6")  # what was trained on silently before
    proc = train(workdir, "TrainConfig.steps=9", *EVERY)
    assert proc.returncode == exit_codes.CHECKPOINT, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: step 6 in ") and "has no manifest" in last, last
    assert "CheckpointConfig.allow_unverified_restore=True" in last and "Traceback" not in proc.stderr
    assert steps_on_disk(workdir) == [3, 6] and not (workdir / "checkpoints_corrupt").exists()

    proc = train(workdir, "TrainConfig.steps=9", "CheckpointConfig.allow_unverified_restore=True", *EVERY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "step 6" in warnings[0] and "WITHOUT verification" in warnings[0], warnings
    assert "steps 6->9" in proc.stdout
