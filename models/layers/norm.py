"""RMSNorm, computed in float32 whatever the activation dtype."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.models.layers.params import ones, param


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, rngs: nnx.Rngs, eps: float = 1e-6, axis_name: str = "norm"):
        self.eps = eps
        self.scale = param(rngs, ones, (dim,), (axis_name,), optimizer="no_decay")

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)
