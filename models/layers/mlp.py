"""Feed-forward blocks: SwiGLU down(silu(gate(x)) * up(x)) and the plain down(act(up(x)))."""
from __future__ import annotations

import jax
from flax import nnx

from jaxtrain.meshes.rules import constrain
from jaxtrain.models.layers.activations import activation as activation_fn
from jaxtrain.models.layers.dense import Dense


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


class PlainMLP(nnx.Module):
    """Non-gated feed-forward block: down(act(up(x))) (Nemotron-H's squared-ReLU MLP)."""

    def __init__(self, embed: int, hidden: int, *, rngs: nnx.Rngs, activation: str = "relu2", use_bias: bool = False,
                 init_std: float = 0.02, dtype=None):
        kw = dict(rngs=rngs, use_bias=use_bias, init_std=init_std, dtype=dtype)
        activation_fn(activation)  # unknown names fail here, not at the first call
        self.activation = activation
        self.up = Dense((embed,), (hidden,), in_axes=("embed",), out_axes=("mlp",), **kw)
        self.down = Dense((hidden,), (embed,), in_axes=("mlp",), out_axes=("embed",), **kw)

    def __call__(self, x):
        h = constrain(activation_fn(self.activation)(self.up(x)), ("batch", "length", "mlp"))
        return self.down(h)
