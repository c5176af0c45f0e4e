"""The flash-attention Triton kernels (Pallas): forward, and the backward's dK/dV and dQ kernels.

Every kernel reads q [b, l, h, d], k [b, s, kv, d], v [b, s, kv, dv] in place (a query head h
reads kv head h // group through its index, no repeated K/V) as [block, d2] tiles, d2 = d padded
to a power of 2 by masked loads. Token places and segment ids arrive padded to whole blocks
(padded queries at the lowest int32 place, padded keys at the highest: they see / are seen by
nothing). Per block, small int32 tables say the largest query place and the segment-id range of a
query block, the smallest key place and the segment-id range of a key block, and the span of
blocks worth visiting; a block pair whose ranges rule out every (query, key) pair is skipped.

Scores live in base 2 (scaled by scale * log2 e, `exp2`); lse is stored in natural units.
Launch wrappers, block tables and the public `forward`/`backward`: flash_attention_pallas.py.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jaxtrain.pallas_kernels._common import masked_load as load
from jaxtrain.pallas_kernels._common import masked_store as store
from jaxtrain.pallas_kernels.flash_attention_reference import NO_KEYS

_F32 = jnp.float32
LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
# Running max a row starts from: finite, so a row that has seen nothing yet never computes
# -inf - (-inf); far below any real (scaled) score, so the first real block replaces it.
_START_MAX = -1e30


@dataclasses.dataclass(frozen=True)
class Dims:
    """Static shape facts of one launch."""

    l: int  # queries
    s: int  # keys
    d: int  # q/k head dim
    dv: int  # v head dim
    d2: int  # d, dv rounded up to powers of 2 >= 16 (Triton tiles)
    dv2: int
    bq: int  # query block
    bk: int  # key block
    group: int  # query heads per kv head
    scale: float
    precision: object  # HIGHEST for f32 inputs, None (native) for bf16/f16

    @property
    def scale2(self):  # scores in base 2
        return self.scale * LOG2E


def _rows(dims_len, block, start):
    """Row mask of a block starting at `start`, or None when blocks tile the length exactly."""
    if dims_len % block == 0:
        return None
    return start + jnp.arange(block, dtype=jnp.int32) < dims_len


def _cols(size, size2):
    return None if size == size2 else jnp.arange(size2, dtype=jnp.int32) < size


def _tile(ref, bi, start, block, head, width2):
    return ref.at[bi, pl.ds(start, block), head, pl.ds(0, width2)]


def _dot(a, b, contract, precision):
    return jax.lax.dot_general(a, b, (contract, ((), ())), precision=precision, preferred_element_type=_F32)


def _blocks_meet(qblk_ref, kblk_ref, bi, i, j):
    """Can any query of block i see any key of block j? Tables: qblk [b, nq, (max place, seg lo,
    seg hi)], kblk [b, nk, (min place, seg lo, seg hi)]."""
    causal = qblk_ref[bi, i, 0] >= kblk_ref[bi, j, 0]
    overlap = (qblk_ref[bi, i, 2] >= kblk_ref[bi, j, 1]) & (kblk_ref[bi, j, 2] >= qblk_ref[bi, i, 1])
    return causal & overlap


def _sees(qpos, qseg, kpos, kseg):
    """[bq, bk]: query row sees key column (causal by place, same segment)."""
    return (kpos[None, :] <= qpos[:, None]) & (kseg[None, :] == qseg[:, None])


def _skip_unless(meet, visit):
    """A fori body that runs `visit` only for block pairs that can meet."""

    def body(j, carry):
        return jax.lax.cond(meet(j), visit, lambda _, c: c, j, carry)

    return body


class _Block:
    """One block's places and segment ids (padded inputs: plain loads)."""

    def __init__(self, pos_ref, seg_ref, bi, start, block):
        self.pos = pos_ref.at[pl.ds(start, block)][...]
        self.seg = seg_ref.at[bi, pl.ds(start, block)][...]


def forward_kernel(q_ref, k_ref, v_ref, qpos_ref, kpos_ref, qseg_ref, kseg_ref, qblk_ref, kblk_ref, span_ref,
                   out_ref, lse_ref, *, dims):
    """One (head, query block, batch): online softmax over the key blocks of its span."""
    h, i, bi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kvh = h // dims.group
    bq, bk, prec = dims.bq, dims.bk, dims.precision
    dmask, vmask = _cols(dims.d, dims.d2), _cols(dims.dv, dims.dv2)
    q_start = i * bq
    rows = _rows(dims.l, bq, q_start)
    q = load(_tile(q_ref, bi, q_start, bq, h, dims.d2), rows, dmask)
    qb = _Block(qpos_ref, qseg_ref, bi, q_start, bq)

    def visit(j, carry):
        acc, peak, total = carry
        k_start = j * bk
        krows = _rows(dims.s, bk, k_start)
        k = load(_tile(k_ref, bi, k_start, bk, kvh, dims.d2), krows, dmask)
        v = load(_tile(v_ref, bi, k_start, bk, kvh, dims.dv2), krows, vmask)
        kb = _Block(kpos_ref, kseg_ref, bi, k_start, bk)
        scores = _dot(q, k, ((1,), (1,)), prec) * dims.scale2
        scores = jnp.where(_sees(qb.pos, qb.seg, kb.pos, kb.seg), scores, -jnp.inf)
        new_peak = jnp.maximum(peak, jnp.max(scores, axis=1))
        probs = jnp.exp2(scores - new_peak[:, None])  # masked: exp2(-inf) = 0
        rescale = jnp.exp2(peak - new_peak)
        total = rescale * total + jnp.sum(probs, axis=1)
        acc = rescale[:, None] * acc + _dot(probs.astype(v.dtype), v, ((1,), (0,)), prec)
        return acc, new_peak, total

    init = (jnp.zeros((bq, dims.dv2), _F32), jnp.full((bq,), _START_MAX, _F32), jnp.zeros((bq,), _F32))
    body = _skip_unless(lambda j: _blocks_meet(qblk_ref, kblk_ref, bi, i, j), visit)
    acc, peak, total = jax.lax.fori_loop(span_ref[bi, i, 0], span_ref[bi, i, 1], body, init)

    seen = total > 0
    safe_total = jnp.where(seen, total, 1.0)
    store(_tile(out_ref, bi, q_start, bq, h, dims.dv2), acc / safe_total[:, None], rows, vmask)
    lse = jnp.where(seen, (peak + jnp.log2(safe_total)) * _LN2, NO_KEYS)
    lse_view = lse_ref.at[bi, h, pl.ds(q_start, bq)]
    if rows is None:
        lse_view[...] = lse
    else:
        pl_triton.store(lse_view, lse, mask=rows)


def _probs(q, k, qb, kb, lse2, dims):
    """exp(score - lse) of a [bq, bk] tile against the given (base-2) lse, 0 where unseen."""
    scores = _dot(q, k, ((1,), (1,)), dims.precision) * dims.scale2
    scores = jnp.where(_sees(qb.pos, qb.seg, kb.pos, kb.seg), scores, -jnp.inf)
    return jnp.exp2(scores - lse2[:, None])


def dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, kpos_ref, qseg_ref, kseg_ref, qblk_ref,
               kblk_ref, span_ref, dk_ref, dv_ref, *, dims):
    """One (kv head, key block, batch): dK, dV summed over the query blocks of its span and over
    the `group` query heads that read this kv head.

    lse_ref holds lse * log2(e) and delta_ref rowsum(dout * out), both [b, h, padded l] f32.
    """
    kvh, j, bi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bq, bk, prec = dims.bq, dims.bk, dims.precision
    dmask, vmask = _cols(dims.d, dims.d2), _cols(dims.dv, dims.dv2)
    k_start = j * bk
    krows = _rows(dims.s, bk, k_start)
    k = load(_tile(k_ref, bi, k_start, bk, kvh, dims.d2), krows, dmask)
    v = load(_tile(v_ref, bi, k_start, bk, kvh, dims.dv2), krows, vmask)
    kb = _Block(kpos_ref, kseg_ref, bi, k_start, bk)

    def visit(i, carry):
        q_start = i * bq
        rows = _rows(dims.l, bq, q_start)
        qb = _Block(qpos_ref, qseg_ref, bi, q_start, bq)

        def head(t, carry):
            dk, dv = carry
            h = kvh * dims.group + t
            q = load(_tile(q_ref, bi, q_start, bq, h, dims.d2), rows, dmask)
            do = load(_tile(do_ref, bi, q_start, bq, h, dims.dv2), rows, vmask)
            lse2 = lse_ref.at[bi, h, pl.ds(q_start, bq)][...]
            delta = delta_ref.at[bi, h, pl.ds(q_start, bq)][...]
            probs = _probs(q, k, qb, kb, lse2, dims)
            dv = dv + _dot(probs.astype(do.dtype), do, ((0,), (0,)), prec)
            dprobs = _dot(do, v, ((1,), (1,)), prec)
            dscores = probs * (dprobs - delta[:, None])
            dk = dk + _dot(dscores.astype(q.dtype), q, ((0,), (0,)), prec)
            return dk, dv

        return jax.lax.fori_loop(0, dims.group, head, carry)

    init = (jnp.zeros((bk, dims.d2), _F32), jnp.zeros((bk, dims.dv2), _F32))
    body = _skip_unless(lambda i: _blocks_meet(qblk_ref, kblk_ref, bi, i, j), visit)
    dk, dv = jax.lax.fori_loop(span_ref[bi, j, 0], span_ref[bi, j, 1], body, init)
    store(_tile(dk_ref, bi, k_start, bk, kvh, dims.d2), dk * dims.scale, krows, dmask)
    store(_tile(dv_ref, bi, k_start, bk, kvh, dims.dv2), dv, krows, vmask)


def dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, kpos_ref, qseg_ref, kseg_ref, qblk_ref,
              kblk_ref, span_ref, dq_ref, *, dims):
    """One (head, query block, batch): dQ over the key blocks of its span."""
    h, i, bi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kvh = h // dims.group
    bq, bk, prec = dims.bq, dims.bk, dims.precision
    dmask, vmask = _cols(dims.d, dims.d2), _cols(dims.dv, dims.dv2)
    q_start = i * bq
    rows = _rows(dims.l, bq, q_start)
    q = load(_tile(q_ref, bi, q_start, bq, h, dims.d2), rows, dmask)
    do = load(_tile(do_ref, bi, q_start, bq, h, dims.dv2), rows, vmask)
    lse2 = lse_ref.at[bi, h, pl.ds(q_start, bq)][...]
    delta = delta_ref.at[bi, h, pl.ds(q_start, bq)][...]
    qb = _Block(qpos_ref, qseg_ref, bi, q_start, bq)

    def visit(j, dq):
        k_start = j * bk
        krows = _rows(dims.s, bk, k_start)
        k = load(_tile(k_ref, bi, k_start, bk, kvh, dims.d2), krows, dmask)
        v = load(_tile(v_ref, bi, k_start, bk, kvh, dims.dv2), krows, vmask)
        kb = _Block(kpos_ref, kseg_ref, bi, k_start, bk)
        probs = _probs(q, k, qb, kb, lse2, dims)
        dprobs = _dot(do, v, ((1,), (1,)), prec)
        dscores = probs * (dprobs - delta[:, None])
        return dq + _dot(dscores.astype(k.dtype), k, ((1,), (0,)), prec)

    body = _skip_unless(lambda j: _blocks_meet(qblk_ref, kblk_ref, bi, i, j), visit)
    dq = jax.lax.fori_loop(span_ref[bi, i, 0], span_ref[bi, i, 1], body, jnp.zeros((bq, dims.d2), _F32))
    store(_tile(dq_ref, bi, q_start, bq, h, dims.d2), dq * dims.scale, rows, dmask)
