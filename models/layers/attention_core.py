"""Causal dot-product attention over packed sequences (shared by GQA and MLA)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.meshes.rules import constrain

_MASKED = -1e30  # finite, so fully masked rows (padding) give uniform weights, not NaN


def attention_mask(segment_ids_q, segment_ids_k, places_q=None, places_k=None):
    """[b, q, k] boolean: causal within the row and never across packed documents. `places_*`:
    the tokens' places in the row (default: array order; a context layout may permute them)."""
    q_len, k_len = segment_ids_q.shape[1], segment_ids_k.shape[1]
    if places_q is None:
        places_q = jnp.arange(q_len) + (k_len - q_len)
    if places_k is None:
        places_k = jnp.arange(k_len)
    causal = places_q[:, None] >= places_k[None, :]
    same_doc = segment_ids_q[:, :, None] == segment_ids_k[:, None, :]
    return causal[None] & same_doc


def dot_product_attention(q, k, v, mask, *, scale: float):
    """q[b, l, heads, d], k[b, s, kv_heads, d], v[b, s, kv_heads, dv] -> [b, l, heads, dv].

    Query heads are grouped over the kv heads (GQA); softmax runs in float32.
    """
    b, q_len, heads, d = q.shape
    kv_heads = k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} kv heads")
    q = q.reshape(b, q_len, kv_heads, heads // kv_heads, d)
    scores = jnp.einsum("blkgd,bskd->bkgls", q, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgls,bskd->blkgd", probs, v)
    out = out.reshape(b, q_len, heads, v.shape[-1])
    return constrain(out, ("batch", "length", "heads", None))
