"""One query per row against a growing cache, reading only the blocks that hold its entries.

A decode step's query attends to cache entries [valid_from[b], index]. Attending the whole
[max_len] cache would make every step cost max_len whatever was filled; here a loop walks the
cache in blocks of `block` entries, from the block of the batch's earliest first entry to the
block holding `index`: its trip count is a traced value, so one compile serves every step and
the work grows with the filled length. Softmax is online (flash-style running max and sum) in
float32, so the result equals one softmax over the visible entries.

`block` need not divide max_len: the last block's start is pulled back to max_len - block and its
entries already read by the block before are masked out.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxtrain.models.layers.attention_core import _MASKED

DECODE_BLOCK = 256  # entries read per trip; attention strategies may set their own (`decode_block`)


def decode_block(attention) -> int:
    """The entries a decode step reads per trip under an attention strategy (its `decode_block`)."""
    block = getattr(attention, "decode_block", None)
    if block is None:
        return DECODE_BLOCK
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"{type(attention).__name__}.decode_block must be a whole number >= 1, got {block!r}")
    return block


def filled_blocks(index, valid_from, block: int):
    """(first, end) block numbers holding entries [min(valid_from), index]: the loop's trip range."""
    return jnp.min(valid_from) // block, index // block + 1


def attend_filled(read_block: Callable, combine: Callable, *, max_len: int, index, valid_from, block: int,
                  score_shape: tuple, out_shape: tuple):
    """Online softmax over the filled blocks -> (out [*out_shape] float32, blocks read).

    read_block(start) -> (scores [*score_shape, block] float32, values) for entries
    [start, start + block); combine(probs [*score_shape, block], values) -> [*out_shape]. The
    leading axis of both shapes is the batch (row b sees [valid_from[b], index])."""
    block = min(block, max_len)
    first, end = filled_blocks(index, valid_from, block)
    batch_axes = (1,) * (len(score_shape) - 1)

    def one_block(j, carry):
        top, total, acc, blocks = carry
        start = jnp.minimum(j * block, max_len - block)
        entries = start + jnp.arange(block)
        visible = (entries[None, :] >= jnp.maximum(j * block, valid_from[:, None])) & (entries[None, :] <= index)
        visible = visible.reshape(visible.shape[:1] + batch_axes + visible.shape[1:])
        scores, values = read_block(start)
        scores = jnp.where(visible, scores, _MASKED)
        new_top = jnp.maximum(top, scores.max(axis=-1))
        probs = jnp.where(visible, jnp.exp(scores - new_top[..., None]), 0.0)
        fade = jnp.exp(top - new_top)
        total = total * fade + probs.sum(axis=-1)
        acc = acc * fade.reshape(fade.shape + (1,) * (len(out_shape) - len(score_shape))) + combine(probs, values)
        return new_top, total, acc, blocks + 1

    init = (jnp.full(score_shape, _MASKED, jnp.float32), jnp.zeros(score_shape, jnp.float32),
            jnp.zeros(out_shape, jnp.float32), jnp.int32(0))
    _, total, acc, blocks = jax.lax.fori_loop(first, end, one_block, init)
    # every row sees at least its own new entry (index >= valid_from): total > 0
    return acc / total.reshape(total.shape + (1,) * (len(out_shape) - len(score_shape))), blocks


def grouped_query_decode(q, cache, *, index, valid_from, scale: float, block: int, k="k", v="v"):
    """q [b, 1, heads, d] against a LayerCache's keys/values [b, max_len, kv_heads, d|dv] ->
    ([b, 1, heads, dv] in v's dtype, blocks read)."""
    b, _, heads, d = q.shape
    kv_heads = cache.entries[k].shape[-2]
    dv = cache.entries[v].shape[-1]
    groups = heads // kv_heads
    qg = q.reshape(b, kv_heads, groups, d)

    def read_block(start):
        keys, values = cache.read(k, start, size), cache.read(v, start, size)
        scores = jnp.einsum("bkgd,bskd->bkgs", qg, keys.astype(q.dtype), preferred_element_type=jnp.float32)
        return scores * scale, values

    def combine(probs, values):
        return jnp.einsum("bkgs,bskd->bkgd", probs.astype(q.dtype), values.astype(q.dtype),
                          preferred_element_type=jnp.float32)

    max_len = cache.max_len(k)
    size = min(block, max_len)
    out, blocks = attend_filled(read_block, combine, max_len=max_len, index=index, valid_from=valid_from,
                                block=size, score_shape=(b, kv_heads, groups), out_shape=(b, kv_heads, groups, dv))
    return out.reshape(b, 1, heads, dv).astype(q.dtype), blocks


def latent_decode(q_latent, q_rope, cache, *, index, valid_from, scale: float, block: int):
    """MLA's absorbed decode: queries taken into latent space q_latent [b, heads, kv_lora] and their
    rotary parts q_rope [b, heads, rope] against a LayerCache's "latent" [b, max_len, kv_lora] and
    "k_rope" [b, max_len, rope] -> (the softmax-weighted latent [b, heads, kv_lora] float32, blocks read).
    Per-head keys/values of the context are never formed."""
    b, heads, width = q_latent.shape

    def read_block(start):
        latents, rope_keys = cache.read("latent", start, size), cache.read("k_rope", start, size)
        dtype = q_latent.dtype
        scores = (jnp.einsum("bhc,bkc->bhk", q_latent, latents.astype(dtype), preferred_element_type=jnp.float32)
                  + jnp.einsum("bhr,bkr->bhk", q_rope, rope_keys.astype(dtype), preferred_element_type=jnp.float32))
        return scores * scale, latents

    def combine(probs, latents):
        dtype = q_latent.dtype
        return jnp.einsum("bhk,bkc->bhc", probs.astype(dtype), latents.astype(dtype),
                          preferred_element_type=jnp.float32)

    max_len = cache.max_len("latent")
    size = min(block, max_len)
    return attend_filled(read_block, combine, max_len=max_len, index=index, valid_from=valid_from, block=size,
                         score_shape=(b, heads), out_shape=(b, heads, width))
