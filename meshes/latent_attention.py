"""Multi-head latent attention over a gathered latent, one key chunk at a time (per device).

MLA's per-head keys and values are linear in a small per-token latent: for a key token,
k = [latent @ w_up[:, :, :nope] | k_rope (shared by every head)] and v = latent @ w_up[:, :, nope:].
Under context parallelism each rank holds the whole sequence's latent (kv_lora values a token) but
must not hold the whole sequence's per-head keys and values (heads x (nope + rope + v) a token,
and as much again for their gradients). This function up-projects the latent `chunk` key tokens
at a time inside a scan, attends this rank's queries to the chunk (pallas_kernels.flash_attention)
and merges the partial (out, log-sum-exp) results exactly, as ring attention merges its blocks.

The backward (custom VJP) scans the chunks again: it recomputes the chunk's keys and values,
takes (dq, dk, dv) from the saved global (out, lse), and folds dk/dv straight back through the
up-projection into d latent, d k_rope and d w_up. Saved for it: the inputs, out and lse only.

Single-device numerics (no mesh here): meshes/context_attention.sharded_latent_attention runs
it inside a shard_map; gradients of inputs replicated over `context` (latent, w_up) are partial
per rank and summed by the shard_map's transpose.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtrain.pallas_kernels import low_precision_dot
from jaxtrain.pallas_kernels.flash_attention import NO_KEYS, attention_backward, attention_forward, merge_partials

_F32 = jnp.float32


def latent_attention(q, latent, k_rope, w_up, q_segment, kv_segment, q_places, kv_places, *, nope: int,
                     scale: float, impl: str = "auto", block_q: int | None = None, block_k: int | None = None,
                     chunk: int | None = None):
    """Causal attention of queries q [b, l, h, nope + rope] to the keys/values of a latent.

    latent [b, S, kv_lora] and k_rope [b, S, rope]: the key tokens; w_up [kv_lora, h, nope + dv]:
    the up-projection (key part first, then the value). Segments q [b, l], kv [b, S]; places
    q [l], kv [S] (see flash_attention_reference.py). `chunk`: key tokens up-projected at once
    (must divide S; None: all of S). -> out [b, l, h, dv] in q's dtype.
    """
    b, l, h, d = q.shape
    S = latent.shape[1]
    chunk = S if chunk is None else int(chunk)
    if chunk <= 0 or S % chunk:
        raise ValueError(f"latent_attention: chunk={chunk} must divide the {S} key tokens")
    if latent.shape[0] != b or k_rope.shape[:2] != (b, S) or w_up.shape[:2] != (latent.shape[2], h):
        raise ValueError(f"latent_attention: shapes do not fit: q {q.shape}, latent {latent.shape}, "
                         f"k_rope {k_rope.shape}, w_up {w_up.shape}")
    if not 0 < nope < w_up.shape[2] or nope + k_rope.shape[2] != d:
        raise ValueError(f"latent_attention: q's head dim {d} must be nope={nope} + rope={k_rope.shape[2]}, "
                         f"and w_up's last dim {w_up.shape[2]} nope + dv")
    config = (int(nope), float(scale), impl, block_q, block_k, chunk)
    return _latent_attention(q, latent, k_rope, w_up, q_segment, kv_segment, q_places.astype(jnp.int32),
                             kv_places.astype(jnp.int32), config)


def _chunked(x, chunk: int):
    """[b, S, ...] -> [S // chunk, b, chunk, ...]; [S] -> [S // chunk, chunk] (scan order)."""
    if x.ndim == 1:
        return x.reshape(-1, chunk)
    return jnp.moveaxis(x.reshape(x.shape[0], -1, chunk, *x.shape[2:]), 1, 0)


def _unchunked(x):
    """The inverse of `_chunked` for [n, b, chunk, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


_UP = (((2,), (0,)), ((), ()))  # [b, c, kv_lora] . [kv_lora, h, d] -> [b, c, h, d]


def _keys_values(latent_c, k_rope_c, w_up, nope: int):
    """One chunk's per-head keys [b, c, h, nope + rope] and values [b, c, h, dv] (the MLA Dense's
    math: a contraction in the latent's dtype, rounded once: low_precision_dot)."""
    dtype = jnp.result_type(latent_c, w_up)
    kv = low_precision_dot.dot_general(latent_c.astype(dtype), w_up.astype(dtype), _UP)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    k_rope_c = jnp.broadcast_to(k_rope_c[:, :, None, :], k_nope.shape[:-1] + k_rope_c.shape[-1:])
    return jnp.concatenate([k_nope, k_rope_c.astype(k_nope.dtype)], axis=-1), v


def _chunk_inputs(latent, k_rope, kv_segment, kv_places, chunk):
    return tuple(_chunked(a, chunk) for a in (latent, k_rope, kv_segment, kv_places))


def _forward(q, latent, k_rope, w_up, q_segment, kv_segment, q_places, kv_places, config):
    nope, scale, impl, block_q, block_k, chunk = config
    b, l, h, _ = q.shape

    def step(carry, xs):
        latent_c, k_rope_c, segment_c, places_c = xs
        k, v = _keys_values(latent_c, k_rope_c, w_up, nope)
        o, s = attention_forward(q, k, v, q_segment, segment_c, q_places, places_c, scale=scale, impl=impl,
                                 block_q=block_q, block_k=block_k)
        return merge_partials(*carry, o, s), None

    out = jnp.zeros((b, l, h, w_up.shape[2] - nope), _F32)
    lse = jnp.full((b, h, l), NO_KEYS, _F32)
    (out, lse), _ = jax.lax.scan(step, (out, lse), _chunk_inputs(latent, k_rope, kv_segment, kv_places, chunk))
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _latent_attention(q, latent, k_rope, w_up, q_segment, kv_segment, q_places, kv_places, config):
    return _forward(q, latent, k_rope, w_up, q_segment, kv_segment, q_places, kv_places, config)[0].astype(q.dtype)


def _fwd(q, latent, k_rope, w_up, q_segment, kv_segment, q_places, kv_places, config):
    out, lse = _forward(q, latent, k_rope, w_up, q_segment, kv_segment, q_places, kv_places, config)
    out = out.astype(q.dtype)
    return out, (q, latent, k_rope, w_up, q_segment, kv_segment, q_places, kv_places, out, lse)


def _bwd(config, res, dout):
    q, latent, k_rope, w_up, q_segment, kv_segment, q_places, kv_places, out, lse = res
    nope, scale, impl, block_q, block_k, chunk = config

    def step(carry, xs):
        dq, dw = carry
        latent_c, k_rope_c, segment_c, places_c = xs
        k, v = _keys_values(latent_c, k_rope_c, w_up, nope)
        dq_c, dk, dv = attention_backward(q, k, v, q_segment, segment_c, q_places, places_c, out, lse, dout,
                                          scale=scale, impl=impl, block_q=block_q, block_k=block_k)
        # d (latent @ w_up) [b, c, h, nope + dv] in the keys' dtype (dk, dv come in it), multiplied
        # on those operands with float32 sums: the same numbers as widening them first, without
        # float32 operands (which XLA:CPU multiplies at half its bf16 speed and GPUs move twice)
        dkv = jnp.concatenate([dk[..., :nope], dv.astype(dk.dtype)], axis=-1)
        w = w_up.astype(dkv.dtype)
        d_latent = jax.lax.dot_general(dkv, w, (((2, 3), (1, 2)), ((), ())), preferred_element_type=_F32)
        d_k_rope = dk[..., nope:].astype(_F32).sum(axis=2)  # the rotary key is shared by every head
        dw = dw + jax.lax.dot_general(latent_c.astype(dkv.dtype), dkv, (((0, 1), (0, 1)), ((), ())),
                                      preferred_element_type=_F32)
        return (dq + dq_c.astype(_F32), dw), (d_latent, d_k_rope)

    start = (jnp.zeros(q.shape, _F32), jnp.zeros(w_up.shape, _F32))
    (dq, dw), (d_latent, d_k_rope) = jax.lax.scan(step, start,
                                                  _chunk_inputs(latent, k_rope, kv_segment, kv_places, chunk))
    return (dq.astype(q.dtype), _unchunked(d_latent).astype(latent.dtype), _unchunked(d_k_rope).astype(k_rope.dtype),
            dw.astype(w_up.dtype), None, None, None, None)


_latent_attention.defvjp(_fwd, _bwd)
