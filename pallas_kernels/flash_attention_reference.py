"""Materialized attention with explicit token places: the reference the blockwise and Pallas
implementations are checked against.

Every key a query may see is decided by two per-token labels instead of array order, so the
same function serves a contiguous sequence, one context rank's slice of it, a load-balanced
(zigzag) order, or a block of keys arriving around a ring:

  q_index[l], kv_index[s]      a token's place in the full (unpermuted) sequence
  q_segment[b, l], kv_segment[b, s]   packed-document ids

A query sees a key iff `kv_index <= q_index` and the two share a segment id. A query that sees
no key at all (possible for one block of keys, never for the whole causal sequence) gets output
0 and log-sum-exp `NO_KEYS`, a finite stand-in for -inf, so partial results merge without NaN.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

NO_KEYS = -1e30  # the log-sum-exp of a row that sees no key (finite: merges stay NaN-free)
_F32 = jnp.float32


def visible(q_index, kv_index, q_segment, kv_segment):
    """[b, l, s] boolean: which keys each query sees (causal by place, same document)."""
    causal = kv_index[None, None, :] <= q_index[None, :, None]
    return causal & (q_segment[:, :, None] == kv_segment[:, None, :])


def check_shapes(name, q, k, v, q_segment, kv_segment, q_index, kv_index):
    """One clear error per malformed operand (shared by every implementation)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"{name}: q, k, v must be [b, len, heads, dim], got {q.shape}, {k.shape}, {v.shape}")
    b, l, h, d = q.shape
    s, kv = k.shape[1], k.shape[2]
    if k.shape != (b, s, kv, d):
        raise ValueError(f"{name}: k must be [b={b}, s, kv_heads, d={d}], got {k.shape}")
    if v.shape[:3] != (b, s, kv):
        raise ValueError(f"{name}: v must be [b={b}, s={s}, kv_heads={kv}, dv], got {v.shape}")
    if h % kv:
        raise ValueError(f"{name}: {h} query heads are not a multiple of {kv} kv heads")
    for what, arr, shape in (("q_segment", q_segment, (b, l)), ("kv_segment", kv_segment, (b, s)),
                             ("q_index", q_index, (l,)), ("kv_index", kv_index, (s,))):
        if arr.shape != shape:
            raise ValueError(f"{name}: {what} must have shape {shape}, got {arr.shape}")


def attention_reference(q, k, v, q_segment, kv_segment, q_index, kv_index, *, scale: float):
    """q[b, l, h, d], k[b, s, kv, d], v[b, s, kv, dv] -> (out [b, l, h, dv] float32,
    lse [b, h, l] float32). Query heads are grouped over kv heads (GQA). Materializes [l, s]."""
    check_shapes("attention_reference", q, k, v, q_segment, kv_segment, q_index, kv_index)
    b, l, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, l, kv, h // kv, d)
    scores = jnp.einsum("blkgd,bskd->bkgls", qg, k, preferred_element_type=_F32) * scale
    mask = visible(q_index, kv_index, q_segment, kv_segment)[:, None, None]
    scores = jnp.where(mask, scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = jnp.where(mask, jnp.exp(scores - peak), 0.0)
    total = weights.sum(-1, keepdims=True)
    seen = total > 0
    probs = weights / jnp.where(seen, total, 1.0)
    out = jnp.einsum("bkgls,bskd->blkgd", probs, v.astype(_F32)).reshape(b, l, h, v.shape[-1])
    lse = jnp.where(seen, jnp.log(jnp.where(seen, total, 1.0)) + peak, NO_KEYS)[..., 0]
    return out, lse.reshape(b, h, l)


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Two attention results over disjoint key sets -> the result over their union (float32).
    out [b, l, h, dv], lse [b, h, l]."""
    lse = jnp.logaddexp(lse_a, lse_b)
    to_out = lambda w: jnp.swapaxes(w, 1, 2)[..., None]  # [b, h, l] -> [b, l, h, 1]
    out = to_out(jnp.exp(lse_a - lse)) * out_a + to_out(jnp.exp(lse_b - lse)) * out_b
    return out, jnp.maximum(lse, NO_KEYS)


def attention_backward_reference(q, k, v, q_segment, kv_segment, q_index, kv_index, out, lse, dout, *,
                                 scale: float):
    """The flash-attention backward from saved (out, lse): (dq, dk, dv) in the inputs' dtypes.

    `out`/`lse` may be the result over a *larger* key set than k/v (ring attention hands each
    key block the global result): the probabilities are exp(score - lse) against that total.
    """
    b, l, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    qg = q.reshape(b, l, kv, g, d).astype(_F32)
    scores = jnp.einsum("blkgd,bskd->bkgls", qg, k.astype(_F32)) * scale
    mask = visible(q_index, kv_index, q_segment, kv_segment)[:, None, None]
    probs = jnp.where(mask, jnp.exp(scores - lse.reshape(b, kv, g, l)[..., None]), 0.0)
    do = dout.astype(_F32).reshape(b, l, kv, g, -1)
    delta = jnp.einsum("blkgd,blkgd->bkgl", do, out.astype(_F32).reshape(b, l, kv, g, -1))
    dv = jnp.einsum("bkgls,blkgd->bskd", probs, do)
    dprobs = jnp.einsum("blkgd,bskd->bkgls", do, v.astype(_F32))
    ds = probs * (dprobs - delta[..., None]) * scale
    dq = jnp.einsum("bkgls,bskd->blkgd", ds, k.astype(_F32)).reshape(b, l, h, d)
    dk = jnp.einsum("bkgls,blkgd->bskd", ds, qg)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
