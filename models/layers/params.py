"""Parameters carry their logical axis names as metadata; meshes/rules.py turns names into shardings."""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

LOGICAL_AXES = "logical_axes"
# How the optimizer treats a parameter, declared where the parameter is made:
#   "decay"     AdamW with weight decay (weight matrices; the default)
#   "no_decay"  AdamW without weight decay (norm scales, biases)
#   "frozen"    no gradient update: state the train step sets by its own rule (the MoE router's
#               correction bias, after_update in models/layers/moe.py)
#   "untrained" not trained at all: no gradient is computed for it and it has no optimizer state
#               (the base weights under adapters, models/lora.py)
OPTIMIZER = "optimizer"
OPTIMIZER_ROLES = ("decay", "no_decay", "frozen", "untrained")


def param(rngs: nnx.Rngs, init: Callable, shape: Sequence[int], axes: Sequence[str | None],
          dtype=jnp.float32, optimizer: str = "decay") -> nnx.Param:
    if len(axes) != len(shape):
        raise ValueError(f"parameter of shape {tuple(shape)} named with {len(axes)} axes {tuple(axes)}")
    if optimizer not in OPTIMIZER_ROLES:
        raise ValueError(f"optimizer role {optimizer!r}: choose one of {OPTIMIZER_ROLES}")
    return nnx.Param(init(rngs.params(), tuple(shape), dtype), **{LOGICAL_AXES: tuple(axes), OPTIMIZER: optimizer})


def optimizer_role(variable: nnx.Variable) -> str:
    return variable.get_metadata().get(OPTIMIZER, "decay")


def normal(std: float) -> Callable:
    return lambda key, shape, dtype: std * jax.random.normal(key, shape, dtype)


def zeros(key, shape, dtype):
    return jnp.zeros(shape, dtype)


def ones(key, shape, dtype):
    return jnp.ones(shape, dtype)


def logical_axes(variable: nnx.Variable) -> tuple[str | None, ...]:
    names = variable.get_metadata().get(LOGICAL_AXES)
    if names is None:
        raise ValueError(f"variable of shape {variable.shape} has no logical axis names")
    return tuple(names)
