"""A linear map between multi-dimensional feature spaces (e.g. embed -> heads x head_dim)."""
from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
from flax import nnx

from models.layers.params import normal, param, zeros


class Dense(nnx.Module):
    """y[..., out] = x[..., in] @ kernel[in, out] (+ bias[out]); `in`/`out` may span several dims."""

    def __init__(self, in_shape: Sequence[int], out_shape: Sequence[int], *,
                 in_axes: Sequence[str | None], out_axes: Sequence[str | None],
                 rngs: nnx.Rngs, use_bias: bool = False, init_std: float = 0.02,
                 dtype=jnp.float32):
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
        self.dtype = dtype
        self.kernel = param(rngs, normal(init_std), self.in_shape + self.out_shape,
                            tuple(in_axes) + tuple(out_axes))
        self.bias = param(rngs, zeros, self.out_shape, tuple(out_axes), optimizer="no_decay") if use_bias else None

    def __call__(self, x):
        n_in = len(self.in_shape)
        if x.shape[x.ndim - n_in:] != self.in_shape:
            raise ValueError(f"Dense expects trailing dims {self.in_shape}, got {x.shape}")
        y = jnp.tensordot(x.astype(self.dtype), self.kernel[...].astype(self.dtype), axes=n_in)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y
