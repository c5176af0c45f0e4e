"""The typed TrainState and the one restore path (TrainSetup.restore): a checkpoint written as the
plain {"step", "params", "opt_state"} dict the code wrote before TrainState (made here without
it) restores into a TrainState on the run's layout, every leaf equal; parameters alone restore
for eval without making an optimizer state."""
import jax
import numpy as np
import optax
import pytest
from flax import nnx

from helpers import TINY_LLAMA, TINY_OPT, TINY_TRAIN, assert_finite
from jaxtrain.checkpoints.checkpointer import Checkpointer
from jaxtrain.training.parallel_plan import ParallelPlan
from jaxtrain.training.state import TrainState
from jaxtrain.training.train_setup import build_train_setup

pytestmark = [pytest.mark.fast]

STEP = 3


@pytest.fixture(scope="module")
def old_checkpoint(tmp_path_factory, setup):
    """A checkpoint as written before TrainState: a dict tree, Adam moments made non-trivial by
    two updates with random gradients, all on one device."""
    directory = str(tmp_path_factory.mktemp("old") / "checkpoints")
    device = jax.devices()[0]
    params = nnx.to_pure_dict(nnx.state(TINY_LLAMA.build(nnx.Rngs(params=jax.random.key(5)))))
    params = jax.device_put(params, device)
    tx = setup.tx  # the run's optimizer: the checkpoint differs from today's only in how it was made
    opt_state = tx.init(params)
    rng = np.random.default_rng(0)

    @jax.jit
    def update(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for _ in range(2):
        grads = jax.tree.map(lambda p: jax.numpy.asarray(rng.normal(size=p.shape), p.dtype), params)
        params, opt_state = update(params, opt_state, grads)
    checkpointer = Checkpointer(directory, async_save=False)
    checkpointer.save(STEP, {"step": jax.numpy.int32(STEP), "params": params, "opt_state": opt_state})
    checkpointer.wait()
    checkpointer.close()
    return directory, jax.device_get(params), jax.device_get(opt_state)


@pytest.fixture(scope="module")
def setup():
    return build_train_setup(TINY_LLAMA, ParallelPlan().with_spec("data=4,tensor=2"), TINY_TRAIN, TINY_OPT,
                             jax.devices()[:8])


def assert_leaves_equal(got, want):
    got_leaves, want_leaves = jax.tree.leaves(jax.device_get(got)), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves):
        assert_finite(g)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def moments(opt_state):
    """The Adam moments (mu, nu) of an optax state, wherever the chain nests them."""
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
             if isinstance(s, optax.ScaleByAdamState)]
    assert len(found) == 1
    return found[0].mu, found[0].nu


def test_an_old_dict_checkpoint_restores_into_a_train_state_on_the_runs_layout(old_checkpoint, setup):
    directory, params, opt_state = old_checkpoint
    checkpointer = Checkpointer(directory)
    try:
        restored = setup.restore(checkpointer)
    finally:
        checkpointer.close()
    state = restored.state
    assert isinstance(state, TrainState) and restored.step == STEP and int(jax.device_get(state.step)) == STEP
    assert_leaves_equal(state.params, params)
    for got, want in zip(moments(state.opt_state), moments(opt_state)):
        assert_leaves_equal(got, want)
    # born on the run's layout: each leaf carries the sharding the setup gives it
    for leaf, sharding in zip(jax.tree.leaves(state.params), jax.tree.leaves(setup.state.shardings.params)):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
    assert state.checkpoint_items().keys() == {"step", "params", "opt_state"}  # the tree checkpoints hold
    again = TrainState.from_items(state.checkpoint_items())
    assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(state)))


def test_parameters_alone_restore_for_eval_without_an_optimizer_state(old_checkpoint, setup):
    directory, params, _ = old_checkpoint
    checkpointer = Checkpointer(directory)
    try:
        restored = setup.restore(checkpointer, params_only=True, quarantine=False)
    finally:
        checkpointer.close()
    assert restored.state is None and restored.step == STEP
    assert_leaves_equal(restored.params, params)
