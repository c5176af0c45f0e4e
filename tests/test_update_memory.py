"""The update phase's temp memory (issue 26.4): the non-finite guard checks before it updates,
so the new state is never held next to the old one. Compile-only (XLA's memory analysis of the
update alone, train state donated as in the step) against the "update, then select old or new"
formulation it replaced, written out here as the reference."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain.training.config import TrainConfig
from jaxtrain.training.optim import OptimizerConfig
from jaxtrain.training.parallel_plan import ParallelPlan
from jaxtrain.training.step import make_update
from jaxtrain.training.train_setup import build_train_setup
from jaxtrain.meshes.rules import get_rule_set, use_rules
from jaxtrain.models.llama import LlamaConfig

pytestmark = [pytest.mark.fast]

MODEL = LlamaConfig(vocab_size=512, embed=128, layers=2, heads=4, kv_heads=4, mlp=512)


def _item(tree, key):  # a dict or a TrainState
    return tree[key] if isinstance(tree, dict) else getattr(tree, key)


def _select_after_update(tx):
    """The reference: the whole new state computed, then old or new kept by the finite check."""
    def update(state, grads):
        params, opt = _item(state, "params"), _item(state, "opt_state")
        updates, new_opt = tx.update(grads, opt, params)
        new_params = optax.apply_updates(params, updates)
        finite = jnp.isfinite(optax.tree.norm(new_params)) & jnp.isfinite(optax.tree.norm(grads))
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        return {"params": keep(new_params, params), "opt_state": keep(new_opt, opt)}
    return update


def _temp_and_moment(layout: str):
    setup = build_train_setup(MODEL, ParallelPlan.parse(layout), TrainConfig(global_batch=16, seq_len=16),
                              OptimizerConfig())
    abstract, shardings = setup.state.abstract, setup.state.shardings
    update = make_update(setup.state.graphdef, setup.tx, setup.lr_schedule, rules=setup.rules,
                         opt_state_shardings=_item(shardings, "opt_state"), params_shardings=_item(shardings, "params"))
    replicated = NamedSharding(setup.mesh, PartitionSpec())
    scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated)
    grads = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32, sharding=p.sharding),
                         _item(abstract, "params"))

    def lean(state, grads, nll, tokens):
        with use_rules(setup.mesh, setup.rules):
            return update(state, grads, (nll, nll, nll), {}, tokens, {})

    lean_temp = jax.jit(lean, out_shardings=(shardings, replicated), donate_argnums=(0,)).lower(
        abstract, grads, scalar, scalar).compile().memory_analysis().temp_size_in_bytes
    reference_shardings = {"params": _item(shardings, "params"), "opt_state": _item(shardings, "opt_state")}
    reference_temp = jax.jit(_select_after_update(setup.tx), out_shardings=reference_shardings,
                             donate_argnums=(0,)).lower(abstract, grads).compile().memory_analysis().temp_size_in_bytes
    moment = sum(math.prod(p.sharding.shard_shape(p.shape)) * 4 for p in jax.tree.leaves(
        _item(abstract, "opt_state"), is_leaf=lambda x: hasattr(x, "mu")) if hasattr(p, "mu")
        for p in jax.tree.leaves(p.mu))
    return lean_temp, reference_temp, moment


@pytest.mark.parametrize("layout", ["data=4,tensor=4,rules=zero1", "data=16,rules=fsdp"])
def test_the_guarded_update_holds_at_most_two_moments_of_temp(layout):
    lean, reference, moment = _temp_and_moment(layout)
    assert moment > 0
    print(f"{layout}: update temp {lean / moment:.2f} moments (select after update: {reference / moment:.2f})")
    assert lean <= 2 * moment, (layout, lean / moment)
    assert lean <= reference - moment, (layout, lean / moment, reference / moment)


def test_the_guarded_update_equals_adamw_then_select():
    """Against the reference formulation: on a finite step the new state (to float32 rounding:
    the two programs fuse the same arithmetic differently), on one whose loss is not finite the
    old state bit for bit."""
    from jaxtrain.training.optim import make_optimizer

    rng = np.random.default_rng(11)
    params = {"w": rng.normal(size=(8, 5)).astype(np.float32), "b": rng.normal(size=(5,)).astype(np.float32)}
    grads = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()}  # norm > clip
    tx, schedule = make_optimizer(OptimizerConfig(learning_rate=3e-2, warmup_steps=0), total_steps=10)
    update = make_update(None, tx, schedule, rules=get_rule_set("dp"), opt_state_shardings=None)
    opt = tx.init(params)
    opt = jax.tree.map(lambda x: x + 0.01 * jnp.ones_like(x) if x.ndim else x, opt)  # non-trivial moments
    for nll in (12.5, np.nan):
        state = _state(params, opt)
        new, metrics = jax.jit(lambda s, g: update(s, g, (jnp.float32(nll), 0.0, 3.0), {}, jnp.float32(8.0), {}))(
            state, grads)
        want = jax.jit(_select_after_update(tx))({"params": params, "opt_state": opt}, grads)
        if not np.isfinite(nll):
            want = {"params": params, "opt_state": opt}
        got = [np.asarray(x) for x in jax.tree.leaves((_item(new, "params"), _item(new, "opt_state")))]
        assert all(np.isfinite(x).all() for x in got)
        for a, b in zip(got, jax.tree.leaves((want["params"], want["opt_state"]))):
            if np.isfinite(nll):
                np.testing.assert_allclose(a, np.asarray(b), rtol=1e-6, atol=1e-7)
            else:
                np.testing.assert_array_equal(a, np.asarray(b))
        assert float(metrics["nonfinite"]) == float(not np.isfinite(nll))


def _state(params, opt):
    from jaxtrain.training import state as state_module
    if hasattr(state_module, "TrainState"):
        return state_module.TrainState(step=jnp.int32(0), params=jax.tree.map(jnp.asarray, params), opt_state=opt)
    return {"step": jnp.int32(0), "params": jax.tree.map(jnp.asarray, params), "opt_state": opt}
