"""SwiGLU feed-forward block: down(silu(gate(x)) * up(x))."""
from __future__ import annotations

import jax
from flax import nnx

from meshes.rules import constrain
from models.layers.dense import Dense


class SwiGLU(nnx.Module):
    def __init__(self, embed: int, hidden: int, *, rngs: nnx.Rngs, use_bias: bool = False,
                 init_std: float = 0.02, dtype=None, hidden_axis: str = "mlp", embed_axis: str = "embed"):
        kw = dict(rngs=rngs, use_bias=use_bias, init_std=init_std, dtype=dtype)
        self.gate = Dense((embed,), (hidden,), in_axes=(embed_axis,), out_axes=(hidden_axis,), **kw)
        self.up = Dense((embed,), (hidden,), in_axes=(embed_axis,), out_axes=(hidden_axis,), **kw)
        self.down = Dense((hidden,), (embed,), in_axes=(hidden_axis,), out_axes=(embed_axis,), **kw)

    def __call__(self, x):
        h = jax.nn.silu(self.gate(x)) * self.up(x)
        h = constrain(h, ("batch", "length", "mlp"))
        return self.down(h)
