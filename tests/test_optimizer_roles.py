"""Optimizer roles are declared by each parameter (models/layers/params.py): they equal the rule
the optimizer used to apply by leaf name, for every family, and AdamW honours them."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.training.optim import OptimizerConfig, make_optimizer
from jaxtrain.training.state import optimizer_roles
from models.family import families
from models.layers.router import RouterConfig


def by_leaf_name(path) -> str:
    """The former name-based rule (independent of the metadata)."""
    name = path[-1]
    return "frozen" if name == "correction_bias" else "no_decay" if name in ("scale", "bias") else "decay"


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
