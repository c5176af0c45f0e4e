"""Blockwise (flash-style) attention in pure JAX: the `impl="xla"` backend of flash_attention.py.

Queries are cut into blocks of `block_q` tokens and keys into blocks of `block_k`. For each query
block a scan runs over the key blocks keeping a running max, running sum and float32 accumulator
(online softmax), so only one [block_q, block_k] tile of scores per head exists at a time: memory
is O(l * block), never O(l * s). The backward recomputes each tile from the saved log-sum-exp.

A (query block, key block) pair whose tokens cannot see each other — every key placed after
every query, or no document id shared in any batch row — is skipped with `lax.cond` rather than
computed and masked. The decision uses only per-block ranges (min/max place, min/max segment id),
so it is conservative for any token order (zigzag, ring blocks) and exact masks do the rest.

Lengths that are not a multiple of the block are padded: a padded key gets place INT32_MAX (no
query is placed after it) and a padded query INT32_MIN (it sees no key); their rows are sliced
off. Real places must therefore lie strictly between those two values.

Mask semantics, GQA grouping and the (out, lse) contract follow flash_attention_reference.py.
"""
from __future__ import annotations

import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxtrain.pallas_kernels.flash_attention_reference import NO_KEYS

_NAME = "flash_attention (xla)"
_F32 = jnp.float32
_DEFAULT_BLOCK = 512  # a [512, 512] f32 score tile per head: big enough for fast matmuls, small in memory
_I32 = jnp.iinfo(jnp.int32)
_PAD_Q_PLACE = _I32.min  # a padded query is placed before every key: it sees none
_PAD_KV_PLACE = _I32.max  # a padded key is placed after every query: nobody sees it


# ----------------------------------------------------------------------------- blocking helpers


def _pick_block(name: str, block, length: int) -> int:
    """The block size to use along a dimension of `length` tokens (never longer than needed)."""
    if block is None:
        block = _DEFAULT_BLOCK
    elif isinstance(block, bool) or not isinstance(block, numbers.Integral) or block <= 0:
        raise ValueError(f"{_NAME}: {name} must be a positive integer, got {block!r}")
    # A block longer than the (power-of-2 rounded) length would only add padding.
    needed = 1 << max(int(length) - 1, 0).bit_length()
    return min(int(block), needed)


def _blocks(x, block: int, axis: int, fill=0):
    """Pads `axis` to a multiple of `block` and moves the block number to the front:
    [..., n * block, ...] -> [n, ..., block, ...] (the layout lax.scan / lax.map iterate over)."""
    n = -(-x.shape[axis] // block)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n * block - x.shape[axis])
    x = jnp.pad(x, pad, constant_values=fill)
    x = x.reshape(x.shape[:axis] + (n, block) + x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def _unblocks(x, axis: int, length: int):
    """Inverse of `_blocks`: [n, ..., block, ...] -> [..., length, ...], padding dropped."""
    x = jnp.moveaxis(x, 0, axis)
    x = x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])
    return lax.slice_in_dim(x, 0, length, axis=axis)


class _Tokens(NamedTuple):
    """Places and document ids of the tokens of every block, with the per-block ranges that
    decide skipping. Leading axis: block number (sliced away inside the loops)."""

    place: jax.Array  # [n, block]
    segment: jax.Array  # [n, b, block]
    first: jax.Array  # [n]     smallest place of a real token
    last: jax.Array  # [n]      largest place of a real token
    segment_lo: jax.Array  # [n, b]  smallest segment id of a real token, per batch row
    segment_hi: jax.Array  # [n, b]


def _tokens(place, segment, block: int, pad_place: int) -> _Tokens:
    place = place.astype(jnp.int32)
    segment = segment.astype(jnp.int32)
    real = _blocks(jnp.ones(place.shape, bool), block, 0, fill=False)  # [n, block]
    place = _blocks(place, block, 0, fill=pad_place)
    segment = _blocks(segment, block, 1)
    # Ranges over real tokens only: an all-padding block gets an empty range and is always skipped.
    real_b = real[:, None, :]
    return _Tokens(
        place=place,
        segment=segment,
        first=jnp.where(real, place, _I32.max).min(-1),
        last=jnp.where(real, place, _I32.min).max(-1),
        segment_lo=jnp.where(real_b, segment, _I32.max).min(-1),
        segment_hi=jnp.where(real_b, segment, _I32.min).max(-1),
    )


def _may_see(qt: _Tokens, kt: _Tokens):
    """Scalar bool for one (query block, key block): False only if no query can see any key."""
    some_key_early_enough = kt.first <= qt.last
    ranges_overlap = (qt.segment_lo <= kt.segment_hi) & (kt.segment_lo <= qt.segment_hi)  # [b]
    return some_key_early_enough & jnp.any(ranges_overlap)


def _visible(qt: _Tokens, kt: _Tokens):
    """[b, 1, 1, block_q, block_k] exact mask of one tile, broadcast over (kv head, group)."""
    causal = kt.place[None, :] <= qt.place[:, None]
    same_doc = qt.segment[:, :, None] == kt.segment[:, None, :]
    return (causal[None] & same_doc)[:, None, None]


def _scores(q_blk, k_blk, scale):
    """q [b, bq, kv, g, d] . k [b, bk, kv, d] -> float32 [b, kv, g, bq, bk]."""
    return jnp.einsum("bqkgd,bskd->bkgqs", q_blk, k_blk, preferred_element_type=_F32) * scale


def _carry_seed(*arrays):
    """A float32 scalar 0 typed like all `arrays` together. Inside shard_map (check_vma) a loop
    carry must vary over the same mesh axes as what the loop adds into it; `zeros_like` inherits
    those axes where `jnp.zeros` would not, and the sum takes their union. No mesh is named."""
    return sum(jnp.zeros_like(a, dtype=_F32, shape=()) for a in arrays)


def _filled(seed, shape, value=0.0):
    return jnp.full_like(seed, value, shape=shape)


def _tied(qt: _Tokens, kt: _Tokens, q_blk):
    """The tiles' token labels, tied to the query values by an optimization barrier.

    Masks depend only on token labels. Inside a differentiated outer loop (a layer scan) JAX
    would otherwise hoist every (query block, key block) mask out of these loops as a
    loop-invariant residual — stacked, [blocks_q, blocks_k, bq, bk]: the L² array this file
    exists to avoid. Tied to q they are computed where they are used, one tile at a time."""
    qt, kt, _ = lax.optimization_barrier((qt, kt, q_blk))
    return qt, kt


# ----------------------------------------------------------------------------- forward


def _softmax_step(carry, q_blk, k_blk, v_blk, mask, scale):
    """Folds one key block into the running (max, sum, accumulator) of a query block."""
    peak, total, acc = carry  # [b, kv, g, bq], [b, kv, g, bq], [b, kv, g, bq, dv]
    scores = jnp.where(mask, _scores(q_blk, k_blk, scale), -jnp.inf)
    new_peak = jnp.maximum(peak, scores.max(-1))
    # While a row has seen no key its peak is -inf: shift by 0 so exp gives 0, not NaN.
    shift = jnp.where(new_peak == -jnp.inf, 0.0, new_peak)
    probs = jnp.exp(scores - shift[..., None])
    rescale = jnp.exp(peak - shift)  # how much the old sum/accumulator shrink under the new max
    total = total * rescale + probs.sum(-1)
    pv = jnp.einsum("bkgqs,bskd->bkgqd", probs.astype(v_blk.dtype), v_blk, preferred_element_type=_F32)
    return new_peak, total, acc * rescale[..., None] + pv


def _softmax_finish(peak, total, acc):
    """-> out [b, bq, kv, g, dv], lse [b, kv, g, bq]; a row that saw no key: 0 and NO_KEYS."""
    seen = total > 0
    safe_total = jnp.where(seen, total, 1.0)
    out = acc / safe_total[..., None]  # an unseen row's accumulator is 0 already
    lse = jnp.where(seen, peak + jnp.log(safe_total), NO_KEYS)
    return jnp.moveaxis(out, 3, 1), lse


def forward(q, k, v, q_segment, kv_segment, q_index, kv_index, *, scale, block_q=None, block_k=None,
            interpret=False):
    """q [b, l, h, d], k [b, s, kv, d], v [b, s, kv, dv] -> (out [b, l, h, dv] float32,
    lse [b, h, l] float32). `interpret` is accepted for signature parity and ignored."""
    del interpret
    b, l, h, d = q.shape
    s, kv, dim_v = k.shape[1], k.shape[2], v.shape[3]
    g = h // kv
    bq, bk = _pick_block("block_q", block_q, l), _pick_block("block_k", block_k, s)

    q_blocks = _blocks(q.reshape(b, l, kv, g, d), bq, 1)  # [nq, b, bq, kv, g, d]; GQA without copying K/V
    k_blocks, v_blocks = _blocks(k, bk, 1), _blocks(v, bk, 1)  # [nk, b, bk, kv, d | dv]
    q_tok = _tokens(q_index, q_segment, bq, _PAD_Q_PLACE)
    kv_tok = _tokens(kv_index, kv_segment, bk, _PAD_KV_PLACE)
    seed = _carry_seed(q, k, v, q_segment, kv_segment, q_index, kv_index)

    def one_query_block(args):
        q_blk, qt = args

        def over_keys(carry, key_args):
            k_blk, v_blk, kt = key_args
            qt_tile, kt = _tied(qt, kt, q_blk)
            fold = lambda c: _softmax_step(c, q_blk, k_blk, v_blk, _visible(qt_tile, kt), scale)
            return lax.cond(_may_see(qt_tile, kt), fold, lambda c: c, carry), None

        rows = (b, kv, g, bq)
        init = (_filled(seed, rows, -jnp.inf), _filled(seed, rows), _filled(seed, rows + (dim_v,)))
        carry, _ = lax.scan(over_keys, init, (k_blocks, v_blocks, kv_tok))
        return _softmax_finish(*carry)

    out, lse = lax.map(one_query_block, (q_blocks, q_tok))  # [nq, b, bq, kv, g, dv], [nq, b, kv, g, bq]
    out = _unblocks(out, 1, l).reshape(b, l, h, dim_v)
    lse = _unblocks(lse, 3, l).reshape(b, h, l)
    return out, lse


# ----------------------------------------------------------------------------- backward


def _grad_step(grads, q_blk, k_blk, v_blk, do_blk, lse_blk, delta_blk, mask, scale):
    """Adds one tile's share to (dq of the query block, dk and dv of the key block)."""
    dq, dk, dv = grads
    scores = _scores(q_blk, k_blk, scale)
    # Probabilities against the saved lse, which may cover more keys than k/v (ring attention).
    probs = jnp.exp(jnp.where(mask, scores - lse_blk[..., None], -jnp.inf))  # [b, kv, g, bq, bk]
    dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", probs.astype(do_blk.dtype), do_blk, preferred_element_type=_F32)
    dprobs = jnp.einsum("bqkgd,bskd->bkgqs", do_blk, v_blk, preferred_element_type=_F32)
    dscores = probs * (dprobs - delta_blk[..., None]) * scale
    dq = dq + jnp.einsum("bkgqs,bskd->bqkgd", dscores.astype(k_blk.dtype), k_blk, preferred_element_type=_F32)
    dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", dscores.astype(q_blk.dtype), q_blk, preferred_element_type=_F32)
    return dq, dk, dv


def backward(q, k, v, q_segment, kv_segment, q_index, kv_index, out, lse, dout, *, scale, block_q=None,
             block_k=None, interpret=False):
    """(dq, dk, dv) in the dtypes of q, k, v from the saved (out, lse) and the cotangent `dout`.

    Outer scan over key blocks (their dk/dv accumulate in the inner carry), inner scan over query
    blocks (each one's dq passes through and comes out updated): O(l * block) memory."""
    del interpret
    b, l, h, d = q.shape
    s, kv, dim_v = k.shape[1], k.shape[2], v.shape[3]
    g = h // kv
    bq, bk = _pick_block("block_q", block_q, l), _pick_block("block_k", block_k, s)

    do = dout.reshape(b, l, kv, g, dim_v)
    # delta = rowsum(dout * out): the softmax-backward term shared by every key of a row.
    delta = jnp.einsum("blkgd,blkgd->bkgl", do.astype(_F32), out.astype(_F32).reshape(b, l, kv, g, dim_v))
    q_side = (
        _blocks(q.reshape(b, l, kv, g, d), bq, 1),  # [nq, b, bq, kv, g, d]
        _blocks(do, bq, 1),  # [nq, b, bq, kv, g, dv]
        _blocks(lse.astype(_F32).reshape(b, kv, g, l), bq, 3),  # [nq, b, kv, g, bq]
        _blocks(delta, bq, 3),
        _tokens(q_index, q_segment, bq, _PAD_Q_PLACE),
    )
    kv_side = (_blocks(k, bk, 1), _blocks(v, bk, 1), _tokens(kv_index, kv_segment, bk, _PAD_KV_PLACE))
    seed = _carry_seed(q, k, v, q_segment, kv_segment, q_index, kv_index, out, lse, dout)

    def one_key_block(dq_blocks, key_args):
        k_blk, v_blk, kt = key_args

        def over_queries(dkv, query_args):
            dq_blk, (q_blk, do_blk, lse_blk, delta_blk, qt) = query_args

            qt, kt_tile = _tied(qt, kt, q_blk)

            def add(grads):
                return _grad_step(grads, q_blk, k_blk, v_blk, do_blk, lse_blk, delta_blk, _visible(qt, kt_tile),
                                  scale)

            dq_blk, dk_blk, dv_blk = lax.cond(_may_see(qt, kt_tile), add, lambda c: c, (dq_blk, *dkv))
            return (dk_blk, dv_blk), dq_blk

        init = (_filled(seed, k_blk.shape), _filled(seed, v_blk.shape))
        dkv, dq_blocks = lax.scan(over_queries, init, (dq_blocks, q_side))
        return dq_blocks, dkv

    dq_init = _filled(seed, q_side[0].shape)
    dq, (dk, dv) = lax.scan(one_key_block, dq_init, kv_side)
    dq = _unblocks(dq, 1, l).reshape(b, l, h, d)
    return dq.astype(q.dtype), _unblocks(dk, 1, s).astype(k.dtype), _unblocks(dv, 1, s).astype(v.dtype)
