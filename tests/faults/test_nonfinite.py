"""Non-finite steps under each ResilienceConfig.nonfinite policy, in subprocesses of the real CLI: a
diverging learning rate and a poisoned batch (a token id past the vocabulary, which embeds as
NaN). Halt exits 3 naming the step and the first non-finite gradient and writes no checkpoint
past the last finite step; Skip and Rollback train on exactly as a run that never had the
poisoned batch; no checkpoint of a non-finite state is ever written or rotates a good one out.
The step's own finite check is tested directly too: an update whose new parameters alone are not
finite is dropped."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cli_runs import EVERY_3, losses, rows, steps_on_disk, train
from jaxtrain.resilience import exit_codes
from jaxtrain.training.state import TrainState

# Process-level runs (the suite's budget): `make test-extended`, which CI runs after the suite; the
# parts they put together are tested in tests/faults/test_resilience_parts.py.
pytestmark = [pytest.mark.slow, pytest.mark.end_to_end, pytest.mark.extended]

POISONED = 4  # batch 4 (0-based) is step 5's
EVERY = EVERY_3


def poisoned_run(workdir, *bindings):
    return train(workdir, "TrainConfig.steps=9", *EVERY, *bindings, wrapper="data_faults.py",
                 fault_env={"FAULT_POISON_BATCH": str(POISONED)})


@pytest.fixture(scope="module")
def without_poisoned_batch(tmp_path_factory):
    """The losses of a run whose data never had batch 4 (later batches move up)."""
    workdir = tmp_path_factory.mktemp("dropped") / "run"
    proc = train(workdir, "TrainConfig.steps=9", *EVERY, wrapper="data_faults.py",
                 fault_env={"FAULT_DROP_BATCH": str(POISONED)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = losses(workdir)
    assert np.isfinite(list(ref.values())).all()
    return ref


def test_poisoned_batch_halts_naming_step_and_gradient_and_saves_nothing_after(tmp_path):
    proc = poisoned_run(tmp_path / "run", "CheckpointConfig.checkpoint_every=1")
    assert proc.returncode == exit_codes.NON_FINITE, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: step 5 (batch 4) is not finite: loss nan"), last
    assert "first non-finite gradient embed/table" in last and "halting, nothing saved" in last, last
    assert "Traceback" not in proc.stderr
    # Checkpoints 1..4 were finite; step 5 and the step in flight behind it were never saved.
    assert steps_on_disk(tmp_path / "run")[-1] == 4


def test_skip_drops_the_batch_and_trains_on_as_if_it_never_was(tmp_path, without_poisoned_batch):
    workdir = tmp_path / "run"
    proc = poisoned_run(workdir, "ResilienceConfig.nonfinite=@Skip()")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 5 (batch 4) is not finite" in proc.stdout and "skip" in proc.stdout
    [logged] = rows(workdir, "nonfinite")
    assert logged["step"] == 5 and logged["batch"] == POISONED
    skipped = losses(workdir)
    assert sorted(skipped) == [1, 2, 3, 4, 6, 7, 8, 9] and np.isfinite(list(skipped.values())).all()
    ref = without_poisoned_batch
    np.testing.assert_allclose([skipped[s] for s in (1, 2, 3, 4)], [ref[s] for s in (1, 2, 3, 4)], rtol=1e-6)
    # the dropped update leaves params and Adam state as they were: step s+1 here is step s there
    np.testing.assert_allclose([skipped[s + 1] for s in (5, 6, 7, 8)], [ref[s] for s in (5, 6, 7, 8)], rtol=1e-6)


def test_rollback_restores_the_checkpoint_and_replays_past_the_batch(tmp_path, without_poisoned_batch):
    workdir = tmp_path / "run"
    proc = poisoned_run(workdir, "ResilienceConfig.nonfinite=@Rollback()")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rolled back to step 3" in proc.stdout
    rolled = losses(workdir)  # one row per step: the replayed steps 4.. were rewritten
    assert sorted(rolled) == list(range(1, 10)) and np.isfinite(list(rolled.values())).all()
    ref = without_poisoned_batch
    np.testing.assert_allclose([rolled[s] for s in range(1, 10)], [ref[s] for s in range(1, 10)], rtol=1e-6)
    # a later resume skips the batch too: the checkpoints record it
    resumed = train(workdir, "TrainConfig.steps=10", *EVERY, wrapper="data_faults.py",
                    fault_env={"FAULT_POISON_BATCH": str(POISONED)})
    assert resumed.returncode == 0 and "not finite" not in resumed.stdout, resumed.stderr[-3000:]


def test_rollback_gives_up_when_every_step_diverges(tmp_path):
    proc = train(tmp_path / "run", "TrainConfig.steps=12", *EVERY, "OptimizerConfig.learning_rate=1e6",
                 "ResilienceConfig.nonfinite=@Rollback()", "Rollback.max_rollbacks=2")
    assert proc.returncode == exit_codes.NON_FINITE, proc.stderr[-3000:]
    assert "still non-finite after 2 rollbacks" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.extended  # ~30 s of CLI runs; test_poisoned_batch_halts_... (nothing saved after a non-finite step) stays
def test_diverging_run_resumed_from_a_good_one_keeps_the_good_checkpoints(tmp_path):
    workdir = tmp_path / "run"
    good = train(workdir, "TrainConfig.steps=4", "CheckpointConfig.checkpoint_every=1", "CheckpointConfig.keep_checkpoints=2")
    assert good.returncode == 0, good.stderr[-3000:]
    assert steps_on_disk(workdir) == [3, 4]
    bad = train(workdir, "TrainConfig.steps=40", "CheckpointConfig.checkpoint_every=1", "CheckpointConfig.keep_checkpoints=2",
                "OptimizerConfig.learning_rate=1e6")
    assert bad.returncode == exit_codes.NON_FINITE, bad.stderr[-3000:]
    last = bad.stderr.strip().splitlines()[-1]
    assert "is not finite" in last, last
    nonfinite_step = int(last.split("step ")[1].split(" ")[0])
    on_disk = steps_on_disk(workdir)
    assert on_disk and max(on_disk) == nonfinite_step - 1  # every checkpoint is of a finite step
    finite = losses(workdir)
    assert all(np.isfinite(finite[s]) for s in on_disk)


def test_skip_halts_when_the_run_keeps_diverging(tmp_path):
    proc = train(tmp_path / "run", "TrainConfig.steps=12", *EVERY, "OptimizerConfig.learning_rate=1e6",
                 "ResilienceConfig.nonfinite=@Skip()", "Skip.max_consecutive=3")
    assert proc.returncode == exit_codes.NON_FINITE, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "4 non-finite steps in a row (Skip.max_consecutive=3)" in last, last
    assert len(rows(tmp_path / "run", "nonfinite")) == 4


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # 1e39 in float32, on purpose
def test_the_step_drops_an_update_whose_new_parameters_alone_are_not_finite():
    """Loss and gradients finite, the learning rate past float32's range (1e39 -> inf): only the
    new parameters are not finite, and the step's finite check must see it from them (the next
    step's loss would be NaN, one step too late: that state would have been kept). With a usual
    learning rate the same update equals AdamW's first step computed in float64."""
    from jaxtrain.training.optim import OptimizerConfig, make_optimizer
    from jaxtrain.training.step import make_update
    from jaxtrain.meshes.rules import get_rule_set

    rng = np.random.default_rng(7)
    params = {"w": rng.normal(size=(4, 3)).astype(np.float32), "b": rng.normal(size=(3,)).astype(np.float32)}
    grads = {k: (0.1 * rng.normal(size=v.shape)).astype(np.float32) for k, v in params.items()}  # norm < clip
    sums, tokens = (jnp.float32(12.5), jnp.float32(0.0), jnp.float32(3.0)), jnp.float32(8.0)
    for lr in (1e-2, 1e39):
        cfg = OptimizerConfig(learning_rate=lr, decay="constant", warmup_steps=0)
        tx, schedule = make_optimizer(cfg, total_steps=10)
        update = make_update(None, tx, schedule, rules=get_rule_set("dp"), opt_state_shardings=None)
        state = TrainState(step=jnp.int32(0), params=jax.tree.map(jnp.asarray, params), opt_state=tx.init(params))
        new, metrics = jax.jit(lambda s, g: update(s, g, sums, {}, tokens, {}))(state, grads)
        metrics = jax.device_get(metrics)
        assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"]), metrics
        if lr == 1e39:
            assert not np.isfinite(metrics["param_norm"]) and metrics["nonfinite"] == 1.0, metrics
            for k in params:  # the old state is kept, bit for bit
                np.testing.assert_array_equal(np.asarray(new.params[k]), params[k])
            for a, b in zip(jax.tree.leaves(new.opt_state), jax.tree.leaves(state.opt_state)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            continue
        assert metrics["nonfinite"] == 0.0 and np.isfinite(metrics["param_norm"]), metrics
        for k, p in params.items():  # AdamW's first step: m_hat = g, v_hat = g^2
            p64, g64 = p.astype(np.float64), grads[k].astype(np.float64)
            expected = p64 - lr * (g64 / (np.abs(g64) + cfg.eps) + cfg.weight_decay * p64)
            got = np.asarray(new.params[k])
            assert np.isfinite(got).all()
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
