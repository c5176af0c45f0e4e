"""Ring attention over the `context` axis, forward and backward, for use inside `shard_map`.

Each context rank holds its queries and one block of keys/values (its own tokens). For C
steps every rank attends its queries to the block it holds, merging the partial results by
log-sum-exp, while the block moves one rank on (`ppermute`): the send is issued before the
block's computation so the two can overlap. Memory holds two K/V blocks, never the sequence.

The backward is a second ring (custom VJP): each block travels with its running dK/dV, every
rank adds its queries' share from the saved global (out, lse), and after C hops the gradient is
back at its owner; the last hop carries dK/dV only (the keys/values have no one left to visit).
dQ stays local.

Masks come from token places (meshes/context_layout.py): the block a rank holds at step s
belongs to rank (r - s) mod C, whose places are known without sending them.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.flash_attention import NO_KEYS, attention_backward, attention_forward, merge_partials

_F32 = jnp.float32


def _places(order, rank, length: int):
    """Token places held by `rank` (traced): `order` is the device order [C * length]."""
    return jax.lax.dynamic_slice_in_dim(order, rank * length, length)


def _hop(tree, axis: str, size: int):
    """Every rank sends `tree` to the next rank of the ring."""
    return jax.lax.ppermute(tree, axis, perm=[(i, (i + 1) % size) for i in range(size)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def ring_attention(q, k, v, segment, order, axis: str, size: int, kernel):
    """q [b, l, h, d], k/v [b, l, kv, d|dv], segment [b, l]: this rank's tokens; order [C*l]:
    the device order. `kernel`: a hashable (scale, impl, block_q, block_k). -> out in q.dtype."""
    return _forward(q, k, v, segment, order, axis, size, kernel)[0].astype(q.dtype)


def _forward(q, k, v, segment, order, axis, size, kernel):
    scale, impl, block_q, block_k = kernel
    rank = jax.lax.axis_index(axis)
    length = q.shape[1]
    q_places = _places(order, rank, length)
    attend = functools.partial(attention_forward, scale=scale, impl=impl, block_q=block_q, block_k=block_k)

    def step(carry, s):
        out, lse, block = carry
        arriving = _hop(block, axis, size)  # independent of this step's math: overlaps with it
        kb, vb, sb = block
        o, l = attend(q, kb, vb, segment, sb, q_places, _places(order, jnp.mod(rank - s, size), length))
        out, lse = merge_partials(out, lse, o, l)
        return (out, lse, arriving), None

    b, _, h, _ = q.shape
    out = jnp.zeros(q.shape[:3] + v.shape[3:], _F32)
    lse = jnp.full((b, h, length), NO_KEYS, _F32)
    (out, lse, last), _ = jax.lax.scan(step, (out, lse, (k, v, segment)), jnp.arange(size - 1))
    kb, vb, sb = last  # the last block needs no onward send
    o, l = attend(q, kb, vb, segment, sb, q_places, _places(order, jnp.mod(rank + 1, size), length))
    out, lse = merge_partials(out, lse, o, l)
    return out, lse


def _ring_fwd(q, k, v, segment, order, axis, size, kernel):
    out, lse = _forward(q, k, v, segment, order, axis, size, kernel)
    return out.astype(q.dtype), (q, k, v, segment, order, out, lse)


def _ring_bwd(axis, size, kernel, res, dout):
    q, k, v, segment, order, out, lse = res
    scale, impl, block_q, block_k = kernel
    rank = jax.lax.axis_index(axis)
    length = q.shape[1]
    q_places = _places(order, rank, length)
    grads = functools.partial(attention_backward, scale=scale, impl=impl, block_q=block_q, block_k=block_k)

    def add(block, s):
        """This rank's queries' share of the gradients of the block it holds at step s."""
        kb, vb, sb, dk, dv = block
        dq_s, dk_s, dv_s = grads(q, kb, vb, segment, sb, q_places, _places(order, jnp.mod(rank - s, size), length),
                                 out, lse, dout)
        return dq_s.astype(_F32), dk + dk_s.astype(_F32), dv + dv_s.astype(_F32)

    def step(carry, s):
        dq, block = carry
        dq_s, dk, dv = add(block, s)
        return (dq + dq_s, _hop(block[:3] + (dk, dv), axis, size)), None

    zeros = lambda a: jnp.zeros(a.shape, _F32)
    start = (zeros(q), (k, v, segment, zeros(k), zeros(v)))
    (dq, last), _ = jax.lax.scan(step, start, jnp.arange(size - 1))
    # The last block's keys/values have reached every rank: only its gradient travels on, home.
    dq_s, dk, dv = add(last, size - 1)
    dk, dv = _hop((dk, dv), axis, size)
    return (dq + dq_s).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


ring_attention.defvjp(_ring_fwd, _ring_bwd)
