"""Gated RMSNorm over groups of heads, the Mamba-2 output norm.

y * silu(z) is normalized per group of heads (each group's heads and head dims together), then
scaled. Gating before normalizing is Mamba-2's `norm_before_gate=False`. Grouping matches the B/C
groups, so with heads and groups split over the same mesh axis every group's statistics stay
on one device.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.models.layers.params import ones, param


class GatedGroupRMSNorm(nnx.Module):
    def __init__(self, heads: int, head_dim: int, groups: int, *, rngs: nnx.Rngs, eps: float = 1e-5,
                 axes: tuple[str, str] = ("ssm_heads", "ssm_head_dim")):
        if heads % groups:
            raise ValueError(f"{heads} heads do not split into {groups} groups")
        self.groups, self.eps = groups, eps
        self.scale = param(rngs, ones, (heads, head_dim), axes, optimizer="no_decay")

    def __call__(self, y, z):
        """y, z: [..., heads, head_dim] -> [..., heads, head_dim] in y's dtype (math in float32)."""
        gated = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
        *lead, h, p = gated.shape
        grouped = gated.reshape(*lead, self.groups, (h // self.groups) * p)
        grouped = grouped * jax.lax.rsqrt(jnp.mean(grouped * grouped, axis=-1, keepdims=True) + self.eps)
        return (grouped.reshape(gated.shape) * self.scale[...].astype(jnp.float32)).astype(y.dtype)
