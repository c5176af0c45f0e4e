"""Ring attention over the `context` axis, forward and backward, for use inside `shard_map`.

Each context rank holds its queries and one block of keys/values (its own tokens). For C
steps every rank attends its queries to the block it holds, merging the partial results by
log-sum-exp, while the block moves one rank on (`ppermute`): the send is issued before the
block's computation so the two can overlap. Memory holds two K/V blocks, never the sequence.

The backward is a second ring (custom VJP): each block travels with its running dK/dV, every
rank adds its queries' share from the saved global (out, lse), and after C hops the gradient is
back at its owner; the last hop carries dK/dV only (the keys/values have no one left to visit).
dQ stays local. All C steps run in one loop, the last hop chosen by a switch on a constant
per-step array (executed collective counts read it exactly: jaxtrain/observe/hlo_branches.py).
A last step peeled off the loop puts a kernel call in the layer's own computation, beside the
forward's (recomputed there under remat): XLA:CPU merges their identical query blocks and
zero-filled buffers and holds them from the forward through the MLP's backward, the step's peak.

Masks come from token places (meshes/context_layout.py): the block a rank holds at step s
belongs to rank (r - s) mod C, whose places are known without sending them.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.pallas_kernels.flash_attention import NO_KEYS, attention_backward, attention_forward, merge_partials

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

    def send_block(block):
        """Every step but the last: the keys/values go on with their running gradients."""
        return _hop(block, axis, size)

    def send_gradients(block):
        """The last step: the keys/values have visited every rank, only their gradients go home."""
        return block[:3] + _hop(block[3:], axis, size)

    def step(carry, xs):
        s, send = xs
        dq, (kb, vb, sb, dk, dv) = carry
        dq_s, dk_s, dv_s = grads(q, kb, vb, segment, sb, q_places, _places(order, jnp.mod(rank - s, size), length),
                                 out, lse, dout)
        block = jax.lax.switch(send, (send_block, send_gradients),
                               (kb, vb, sb, dk + dk_s.astype(_F32), dv + dv_s.astype(_F32)))
        return (dq + dq_s.astype(_F32), block), None

    zeros = lambda a: jnp.zeros(a.shape, _F32)
    start = (zeros(q), (k, v, segment, zeros(k), zeros(v)))
    sends = np.array([0] * (size - 1) + [1], np.int32)  # which branch each step's send takes
    (dq, (_, _, _, dk, dv)), _ = jax.lax.scan(step, start, (jnp.arange(size), sends))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


ring_attention.defvjp(_ring_fwd, _ring_bwd)
