"""The contract every layer kind keeps for generation: prefill a left-padded prompt, then decode
one token at a time against a preallocated, per-layer cache.

Left padding: a batch of prompts of different lengths is laid out right-aligned in [b, P], so
every row writes its next token at the same cache index; `valid_from[b]` (the row's pad count)
masks the keys before it, and each row's positions count from 0 at its first real token. Pad
tokens carry segment id 0 and real ones 1, so the training forward's packed-sequence masking
(attention) and state restarts (the SSD scan, the causal conv) already keep pads out of every
real token's result: prefill *is* the training forward, returning what it computed for the cache.

A layer kind's cache is a pytree of arrays with a leading batch axis, named with logical axes so
it shards like the weights (kv_heads / heads over `tensor`, batch over `data`):

- grouped-query attention: keys and values [b, max_len, kv_heads, head_dim];
- multi-head latent attention: the normalized latent [b, max_len, kv_lora] and the rotary key
  [b, max_len, qk_rope_head_dim] only (keys/values up-projections absorbed at decode time);
- Mamba-2: the SSM state [b, heads, head_dim, state] and the conv window's last
  conv_kernel - 1 inputs per conv (constant in max_len).

Methods a mixer (and so a layer) provides, beside its training `__call__`:

    init_cache(batch, max_len, dtype) -> cache          zeros, logically constrained
    prefill(x, positions, segment_ids, cache) -> (out, cache)
        x [b, P, embed], the prompt; writes cache entries [0, P)
    decode(x, positions, cache, index, valid_from) -> (out, cache)
        x [b, 1, embed], positions [b, 1]; writes entry `index` (a traced scalar, the same for
        every row) and attends to entries [valid_from[b], index]

Stacks thread caches as scan inputs/outputs stacked on the `layers` axis, like the weights.
"""
from __future__ import annotations

import jax

from jaxtrain.meshes.rules import constrain


class LayerCache:
    """One layer's cache as its decode sees it: read and written in place inside the stack's cache.

    `entries`: {name: array}. With `layer=None` they are the layer's own arrays ([b, max_len, ...]
    or a fixed-size state); with a layer index (a Python int or a traced scalar) they are the whole
    stack's arrays, stacked on a leading layers axis, and every read/write addresses that layer.
    A decode step so writes one entry per layer into the donated stacked buffer (an in-place
    dynamic_update_slice) and reads only the blocks it attends to: slicing the layer's cache out
    and stacking it back would copy every layer's whole cache each step, whatever was filled.
    """

    def __init__(self, entries: dict, layer=None):
        self.entries, self.layer = dict(entries), layer

    @classmethod
    def of(cls, cache) -> "LayerCache":
        return cache if isinstance(cache, LayerCache) else cls(cache)

    def like(self, original):
        """Back in the caller's form: a plain dict for a plain dict, this view for a view."""
        return self if isinstance(original, LayerCache) else self.entries

    def max_len(self, name: str) -> int:
        return self.entries[name].shape[1 if self.layer is None else 2]

    def _prefix(self) -> tuple:
        return () if self.layer is None else (self.layer,)

    def read(self, name: str, start=None, size: int | None = None):
        """The layer's array, or its entries [start, start + size) on the length axis (axis 1)."""
        array = self.entries[name]
        if start is None:
            return array if self.layer is None else jax.lax.dynamic_index_in_dim(array, self.layer, keepdims=False)
        lead = len(self._prefix())
        begin = self._prefix() + (0, start) + (0,) * (array.ndim - lead - 2)
        sizes = (1,) * lead + (array.shape[lead], size) + array.shape[lead + 2:]
        block = jax.lax.dynamic_slice(array, begin, sizes)
        return block[0] if lead else block

    def write(self, name: str, update, start, names=None) -> "LayerCache":
        """`update` [b, n, ...] at entries [start, start + n); `names`: the layer array's logical axes."""
        array = self.entries[name]
        lead = len(self._prefix())
        begin = self._prefix() + (0, start) + (0,) * (array.ndim - lead - 2)
        new = jax.lax.dynamic_update_slice(array, update.astype(array.dtype).reshape((1,) * lead + update.shape), begin)
        return self._with(name, new, names)

    def replace(self, name: str, value, names=None) -> "LayerCache":
        """The layer's whole array (fixed-size caches: a recurrent state, a conv window)."""
        array = self.entries[name]
        value = value.astype(array.dtype)
        new = value if self.layer is None else jax.lax.dynamic_update_index_in_dim(array, value, self.layer, 0)
        return self._with(name, new, names)

    def _with(self, name, new, names) -> "LayerCache":
        if names is not None:
            new = constrain(new, (None,) * len(self._prefix()) + tuple(names))
        return LayerCache({**self.entries, name: new}, self.layer)
