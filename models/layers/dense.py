"""A linear map between multi-dimensional feature spaces (e.g. embed -> heads x head_dim)."""
from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
from flax import nnx

from jaxtrain.meshes.weight_gather import contract
from jaxtrain.models.layers.params import logical_axes, normal, param, zeros


class Dense(nnx.Module):
    """y[..., out] = x[..., in] @ kernel[in, out] (+ bias[out]); `in`/`out` may span several dims.

    `adapter`, when a model transform sets one (models/lora.py), adds its own term to y: the
    base contraction stays as it is."""

    adapter = None

    def __init__(self, in_shape: Sequence[int], out_shape: Sequence[int], *,
                 in_axes: Sequence[str | None], out_axes: Sequence[str | None],
                 rngs: nnx.Rngs, use_bias: bool = False, init_std: float = 0.02,
                 dtype=jnp.float32):
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
        self.dtype = dtype
        self.kernel = param(rngs, normal(init_std), self.in_shape + self.out_shape,
                            tuple(in_axes) + tuple(out_axes))
        self.bias = param(rngs, zeros, self.out_shape, tuple(out_axes), optimizer="no_decay") if use_bias else None

    def weight(self):
        """The kernel as this Dense applies it: with an adapter, kernel + its low-rank delta. For
        callers that use the weight itself rather than calling the Dense (MLA's latent attention
        up-projects inside its kernel); equal to calling, since the adapter's term is linear in x."""
        kernel = self.kernel[...]
        return kernel if self.adapter is None else kernel + self.adapter.delta(len(self.in_shape)).astype(kernel.dtype)

    def __call__(self, x):
        n_in = len(self.in_shape)
        if x.shape[x.ndim - n_in:] != self.in_shape:
            raise ValueError(f"Dense expects trailing dims {self.in_shape}, got {x.shape}")
        kernel = self.kernel[...]
        # the weight's own names (a stacked layer's variable also names its leading `layers`)
        names = logical_axes(self.kernel)[-kernel.ndim:]
        y = contract(x, kernel, n_in, self.dtype, names)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        if self.adapter is not None:
            y = y + self.adapter(x, n_in, self.dtype)
        return y
