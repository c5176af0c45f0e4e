"""Grouped-query attention with rotary positions and packed-sequence masking."""
from __future__ import annotations

import math

from flax import nnx

from meshes.rules import constrain
from models.layers.attention_impl import AutoAttention
from models.layers.dense import Dense
from models.layers.rope import apply_rope


class GroupedQueryAttention(nnx.Module):
    """`inv_freq=None`: no rotary embedding (NoPE; in hybrid models the recurrent layers carry
    position)."""

    def __init__(self, embed: int, heads: int, kv_heads: int, head_dim: int, *, inv_freq,
                 rngs: nnx.Rngs, use_bias: bool = False, init_std: float = 0.02, dtype=None,
                 attention=AutoAttention()):
        if heads % kv_heads:
            raise ValueError(f"heads={heads} is not a multiple of kv_heads={kv_heads}")
        kw = dict(rngs=rngs, use_bias=use_bias, init_std=init_std, dtype=dtype)
        self.q = Dense((embed,), (heads, head_dim), in_axes=("embed",), out_axes=("heads", "head_dim"), **kw)
        self.k = Dense((embed,), (kv_heads, head_dim), in_axes=("embed",), out_axes=("kv_heads", "head_dim"), **kw)
        self.v = Dense((embed,), (kv_heads, head_dim), in_axes=("embed",), out_axes=("kv_heads", "head_dim"), **kw)
        self.o = Dense((heads, head_dim), (embed,), in_axes=("heads", "head_dim"), out_axes=("embed",), **kw)
        # static: part of the graph, not state
        self.inv_freq = None if inv_freq is None else tuple(float(f) for f in inv_freq)
        self.scale = 1.0 / math.sqrt(head_dim)
        self.attention = attention  # static: an implementation strategy (models/layers/attention_impl.py)

    def _rope(self, x, positions):
        return x if self.inv_freq is None else apply_rope(x, positions, self.inv_freq)

    def __call__(self, x, positions, segment_ids):
        q = constrain(self._rope(self.q(x), positions), ("batch", "length", "heads", None))
        k = constrain(self._rope(self.k(x), positions), ("batch", "length", "kv_heads", None))
        v = constrain(self.v(x), ("batch", "length", "kv_heads", None))
        return self.o(self.attention(q, k, v, segment_ids, scale=self.scale))
