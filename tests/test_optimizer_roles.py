"""Optimizer roles are declared by each parameter (models/layers/params.py): they equal a rule by
leaf name (the optimizer's former one, plus no decay for Mamba-2's A_log, D and dt_bias, as in
mamba_ssm and Megatron), for every family, and AdamW honours them."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.training.optim import OptimizerConfig, make_optimizer
from jaxtrain.training.state import optimizer_roles
from jaxtrain.models.family import families
from jaxtrain.models.layers.router import RouterConfig

pytestmark = [pytest.mark.fast]


SSM_NO_DECAY = ("A_log", "D", "dt_bias")  # Mamba-2's per-head dynamics: never decayed


def by_leaf_name(path) -> str:
    """The rule by name, independent of the metadata."""
    name = path[-1]
    if name == "correction_bias":
        return "frozen"
    return "no_decay" if name in ("scale", "bias", *SSM_NO_DECAY) else "decay"


def configs():
    for family in families().values():
        cfg = family.config_class()
        if hasattr(cfg, "router"):  # exercise the correction bias and biases too
            cfg = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, correction_bias=True))
        yield family.name, cfg
    yield "llama_biases", dataclasses.replace(families()["llama"].config_class(), attention_bias=True, mlp_bias=True)


@pytest.mark.parametrize("name, cfg", list(configs()), ids=lambda x: x if isinstance(x, str) else "")
def test_roles_equal_the_leaf_name_rule(name, cfg):
    roles = optimizer_roles(cfg)
    assert roles == {path: by_leaf_name(path) for path in roles}
    assert len(set(roles.values())) >= 2


def test_adamw_decays_frozen_and_no_decay_leaves_as_declared():
    params = {"w": jnp.ones((3,)), "scale": jnp.ones((3,)), "bias": jnp.ones((3,))}
    roles = {("w",): "decay", ("scale",): "no_decay", ("bias",): "frozen"}
    cfg = OptimizerConfig(learning_rate=0.1, warmup_steps=0, decay="constant", weight_decay=0.5, clip_norm=None)
    tx, _ = make_optimizer(cfg, 10, roles)
    grads = {"w": jnp.zeros(3), "scale": jnp.zeros(3), "bias": jnp.full((3,), 5.0)}
    updates, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], -0.1 * 0.5 * 1.0, rtol=1e-6)  # decay only (zero gradient)
    np.testing.assert_allclose(updates["scale"], 0.0)  # no decay, zero gradient: no move
    np.testing.assert_allclose(updates["bias"], 0.0)  # frozen despite its gradient
    plain, _ = make_optimizer(cfg, 10)  # no roles: every leaf decays, same state structure
    assert jax.tree.structure(plain.init(params)) == jax.tree.structure(tx.init(params))


@pytest.mark.slow  # a model-size compile or a whole run: out of the edit-test lane
@pytest.mark.parametrize("family", ["mamba2", "nemotron_h"])
def test_adamw_leaves_ssm_dynamics_undecayed(family):
    """One AdamW step with zero gradients on a real Mamba-2 / Nemotron-H parameter tree: the only
    move is weight decay, -lr * wd * p, so A_log, D and dt_bias stay put and weights shrink."""
    from flax import nnx

    from jaxtrain.training.state import abstract_model
    from jaxtrain.meshes.tree_paths import path_keys

    def by_path(tree) -> dict:
        return {path_keys(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}

    cfg = families()[family].config_class()
    roles = optimizer_roles(cfg)
    ssm = [p for p in roles if p[-1] in SSM_NO_DECAY]
    assert len(ssm) >= 3 and all(roles[p] == "no_decay" for p in ssm)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape), jnp.float32),
                          nnx.to_pure_dict(abstract_model(cfg)[1]))
    lr, wd = 0.1, 0.5
    opt = OptimizerConfig(learning_rate=lr, warmup_steps=0, decay="constant", weight_decay=wd, clip_norm=None)
    tx, _ = make_optimizer(opt, 10, roles)
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    updates, params = by_path(updates), by_path(params)
    assert set(updates) == set(roles)
    for path, got in updates.items():
        want = -lr * wd * params[path].astype(np.float64) if roles[path] == "decay" else np.zeros(got.shape)
        assert np.isfinite(got).all(), path
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=str(path))
