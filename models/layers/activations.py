"""Pointwise activations by config name (MLPs, experts)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": jax.nn.gelu,
    # squared ReLU (Primer; Nemotron-H). Not jax.nn.relu: its custom_jvp, batched by a pipeline's
    # vmap(spmd_axis_name=...) inside the experts' shard_map, fails jax 0.10's varying-axes check.
    # The gradient is the same (2·max(x, 0), zero at 0 either way).
    "relu2": lambda x: jnp.square(jnp.maximum(x, 0)),
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; choose one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]
