"""Grouped-query attention with rotary positions and packed-sequence masking, and its key/value
cache for generation (the contract: models/layers/decode_cache.py)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.meshes.rules import constrain
from jaxtrain.models.layers.attention_impl import AutoAttention
from jaxtrain.models.layers.decode_attention import decode_block, grouped_query_decode
from jaxtrain.models.layers.decode_cache import LayerCache
from jaxtrain.models.layers.dense import Dense
from jaxtrain.models.layers.rope import apply_rope

KV_CACHE = ("batch", None, "kv_heads", None)  # [b, max_len, kv_heads, head_dim], sharded like k/v


def write_cache(cache, update, index):
    """cache [b, max_len, ...] with `update` [b, n, ...] written at entries [index, index + n)."""
    start = (0, index) + (0,) * (cache.ndim - 2)
    return jax.lax.dynamic_update_slice(cache, update.astype(cache.dtype), start)


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
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.attention = attention  # static: an implementation strategy (models/layers/attention_impl.py)

    def _rope(self, x, positions):
        return x if self.inv_freq is None else apply_rope(x, positions, self.inv_freq)

    def __call__(self, x, positions, segment_ids):
        q, k, v = self._qkv(x, positions)
        return self.o(self.attention(q, k, v, segment_ids, scale=self.scale))

    def _qkv(self, x, positions):
        q = constrain(self._rope(self.q(x), positions), ("batch", "length", "heads", None))
        k = constrain(self._rope(self.k(x), positions), ("batch", "length", "kv_heads", None))
        v = constrain(self.v(x), ("batch", "length", "kv_heads", None))
        return q, k, v

    def init_cache(self, batch: int, max_len: int, dtype):
        zeros = lambda: constrain(jnp.zeros((batch, max_len, self.kv_heads, self.head_dim), dtype), KV_CACHE)
        return {"k": zeros(), "v": zeros()}

    def prefill(self, x, positions, segment_ids, cache):
        """The training attention over the prompt; its keys/values fill cache entries [0, P)."""
        q, k, v = self._qkv(x, positions)
        out = self.o(self.attention(q, k, v, segment_ids, scale=self.scale))
        return out, {"k": constrain(write_cache(cache["k"], k, 0), KV_CACHE),
                     "v": constrain(write_cache(cache["v"], v, 0), KV_CACHE)}

    def decode(self, x, positions, cache, index, valid_from):
        """One token per row: its key/value go to entry `index`, its query attends to the row's
        entries [valid_from, index], reading only the cache blocks that hold them
        (models/layers/decode_attention.py). `cache`: the layer's dict, or a LayerCache view of it
        inside a stack's stacked cache (written in place)."""
        q, k, v = self._qkv(x, positions)
        view = LayerCache.of(cache).write("k", k, index, KV_CACHE).write("v", v, index, KV_CACHE)
        out, _ = grouped_query_decode(q, view, index=index, valid_from=valid_from, scale=self.scale,
                                      block=decode_block(self.attention))
        out = constrain(out, ("batch", "length", "heads", None))
        return self.o(out), view.like(cache)
