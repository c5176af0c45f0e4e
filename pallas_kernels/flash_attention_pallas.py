"""Flash attention as Pallas Triton kernels: `forward` -> (out, lse) and `backward` from a given
(out, lse), the backend of impl="pallas" in flash_attention.py (which owns the custom VJP).

  forward   one program per (head, query block, batch); online softmax in f32 over key blocks
  backward  delta = rowsum(dout * out) in XLA, then a dK/dV kernel (one program per (kv head,
            key block, batch), looping over query blocks and the query heads of its group, so
            GQA needs no repeated K/V and no atomics) and a dQ kernel (one program per (head,
            query block, batch), looping over key blocks)

Masks come from token places and segment ids (flash_attention_reference.py), so any order of
tokens works: contiguous, zigzag, a ring step's key block. Before launch, XLA reduces the places
and ids to a few int32 numbers per block and, per block, the first and last block of the other
side that any of its tokens can meet; kernels loop over that span and skip the pairs in it that
cannot meet (no query place >= a key place, or disjoint segment-id ranges).

Head dims need not be powers of 2 (d=192, dv=128 as in MLA: tiles padded by masked loads), and
lengths need not be multiples of a block. Block sizes are powers of 2 >= 16, shrunk to the
sequence for short inputs. Kernel bodies: flash_attention_pallas_kernels.py.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxtrain.pallas_kernels import _common
from jaxtrain.pallas_kernels.flash_attention_pallas_kernels import LOG2E, Dims, dkv_kernel, dq_kernel, forward_kernel
from jaxtrain.pallas_kernels.flash_attention_reference import NO_KEYS, check_shapes

_NAME = "flash_attention"
_F32 = jnp.float32
_I32 = jnp.iinfo(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Launch:
    """Blocks and Triton params of one kernel."""

    bq: int
    bk: int
    num_warps: int
    num_stages: int = 2


def launches(l: int, s: int, d: int, dv: int, block_q=None, block_k=None) -> dict[str, Launch]:
    """Per kernel ("fwd", "dkv", "dq") launch settings; H100/H200 defaults unless blocks are given.

    A program keeps its own block's tiles (and f32 accumulators) in registers while it loops over
    the other side, so wide heads (d or dv > 128, e.g. MLA's 192) hold a smaller block.
    """
    if block_q is not None:
        _common.check_block(_NAME, "block_q", block_q, 16)
    if block_k is not None:
        _common.check_block(_NAME, "block_k", block_k, 16)
    width = max(_pad(d), _pad(dv))
    wide = width > 128
    held = 32 if wide else 64
    defaults = {"fwd": (64 if wide else 128, 64), "dkv": (64, held), "dq": (held, 64)}
    warps = 4 if width <= 64 else 8
    return {
        name: Launch(_common.fit_block(l, block_q or bq), _common.fit_block(s, block_k or bk), warps)
        for name, (bq, bk) in defaults.items()
    }


def _pad(dim):
    return max(16, _common.pl_next_pow2(dim))


def _dims(q, v, kv_heads, launch, scale, k_len):
    _, l, h, d = q.shape
    dv = v.shape[-1]
    return Dims(l=l, s=k_len, d=d, dv=dv, d2=_pad(d), dv2=_pad(dv), bq=launch.bq, bk=launch.bk,
                group=h // kv_heads, scale=float(scale), precision=_common.dot_precision(q.dtype))


@dataclasses.dataclass(frozen=True)
class Tables:
    qpos: jax.Array  # [lp] int32 query places, padded with the lowest int32
    kpos: jax.Array  # [sp] key places, padded with the highest int32
    qseg: jax.Array  # [b, lp] segment ids
    kseg: jax.Array  # [b, sp]
    qblk: jax.Array  # [b, nq, 3] per query block: max place, min seg, max seg
    kblk: jax.Array  # [b, nk, 3] per key block: min place, min seg, max seg
    q_span: jax.Array  # [b, nq, 2] key blocks [first, last + 1) a query block can meet
    k_span: jax.Array  # [b, nk, 2] query blocks a key block can meet


def block_tables(q_index, kv_index, q_segment, kv_segment, bq: int, bk: int) -> Tables:
    """The padded places / ids and the per-block tables the kernels skip by (small XLA work:
    O(l + s) per batch row, plus an [nq, nk] compare that XLA fuses into its reductions)."""
    b, l = q_segment.shape
    s = kv_segment.shape[1]
    nq, nk = pl.cdiv(l, bq), pl.cdiv(s, bk)
    qpos = jnp.pad(q_index.astype(jnp.int32), (0, nq * bq - l), constant_values=_I32.min)
    kpos = jnp.pad(kv_index.astype(jnp.int32), (0, nk * bk - s), constant_values=_I32.max)
    qseg = jnp.pad(q_segment.astype(jnp.int32), ((0, 0), (0, nq * bq - l)))
    kseg = jnp.pad(kv_segment.astype(jnp.int32), ((0, 0), (0, nk * bk - s)))

    def seg_range(seg, n, block, length):
        real = (jnp.arange(n * block) < length).reshape(n, block)
        seg = seg.reshape(b, n, block)
        return jnp.min(jnp.where(real, seg, _I32.max), -1), jnp.max(jnp.where(real, seg, _I32.min), -1)

    q_hi = jnp.broadcast_to(jnp.max(qpos.reshape(nq, bq), -1), (b, nq))  # padding is the lowest place
    k_lo = jnp.broadcast_to(jnp.min(kpos.reshape(nk, bk), -1), (b, nk))  # padding is the highest
    qs_lo, qs_hi = seg_range(qseg, nq, bq, l)
    ks_lo, ks_hi = seg_range(kseg, nk, bk, s)
    meet = ((q_hi[:, :, None] >= k_lo[:, None, :]) & (qs_hi[:, :, None] >= ks_lo[:, None, :])
            & (ks_hi[:, None, :] >= qs_lo[:, :, None]))  # [b, nq, nk]

    def span(m):  # [..., n] bool -> [..., 2]: [first True, last True + 1), or [0, 0)
        n = m.shape[-1]
        first = jnp.argmax(m, -1)
        end = n - jnp.argmax(m[..., ::-1], -1)
        hit = jnp.any(m, -1)
        return jnp.stack([jnp.where(hit, first, 0), jnp.where(hit, end, 0)], -1).astype(jnp.int32)

    return Tables(qpos=qpos, kpos=kpos, qseg=qseg, kseg=kseg,
                  qblk=jnp.stack([q_hi, qs_lo, qs_hi], -1), kblk=jnp.stack([k_lo, ks_lo, ks_hi], -1),
                  q_span=span(meet), k_span=span(jnp.swapaxes(meet, 1, 2)))


def _call(kernel, out_shape, grid, launch, interpret, name):
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, interpret=interpret, name=name,
                          compiler_params=_common.triton_params(launch.num_warps, launch.num_stages))


def _common_dtype(q, k, v):
    return k.astype(q.dtype), v.astype(q.dtype)


def forward(q, k, v, q_segment, kv_segment, q_index, kv_index, *, scale, block_q=None, block_k=None,
            interpret=False):
    """q [b, l, h, d], k [b, s, kv, d], v [b, s, kv, dv] -> (out [b, l, h, dv] f32, lse [b, h, l] f32).
    Rows that see no key: out 0, lse NO_KEYS."""
    check_shapes(_NAME, q, k, v, q_segment, kv_segment, q_index, kv_index)
    b, l, h, _ = q.shape
    s, kv_heads, dv = k.shape[1], k.shape[2], v.shape[-1]
    launch = launches(l, s, q.shape[-1], dv, block_q, block_k)["fwd"]
    if l == 0 or s == 0:
        return jnp.zeros((b, l, h, dv), _F32), jnp.full((b, h, l), NO_KEYS, _F32)
    k, v = _common_dtype(q, k, v)
    t = block_tables(q_index, kv_index, q_segment, kv_segment, launch.bq, launch.bk)
    dims = _dims(q, v, kv_heads, launch, scale, s)
    out_shape = (jax.ShapeDtypeStruct((b, l, h, dv), _F32), jax.ShapeDtypeStruct((b, h, l), _F32))
    grid = (h, pl.cdiv(l, launch.bq), b)  # heads fastest: a group's heads read the same K/V blocks
    return _call(functools.partial(forward_kernel, dims=dims), out_shape, grid, launch, interpret,
                 "flash_attention_fwd")(q, k, v, t.qpos, t.kpos, t.qseg, t.kseg, t.qblk, t.kblk, t.q_span)


def _pad_len(x, length):
    """[b, h, l] -> [b, h, length] (zeros after l)."""
    return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[-1])))


def backward(q, k, v, q_segment, kv_segment, q_index, kv_index, out, lse, dout, *, scale, block_q=None,
             block_k=None, interpret=False):
    """(dq, dk, dv) in the dtypes of q, k, v from the saved (out, lse) and the output cotangent.
    (out, lse) may be over more keys than k/v hold (ring attention): probabilities are taken
    against that lse."""
    check_shapes(_NAME, q, k, v, q_segment, kv_segment, q_index, kv_index)
    b, l, h, d = q.shape
    s, kv_heads, dv = k.shape[1], k.shape[2], v.shape[-1]
    plan = launches(l, s, d, dv, block_q, block_k)
    if l == 0 or s == 0:
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
    kc, vc = _common_dtype(q, k, v)
    # delta_i = sum_c dout_ic out_ic = sum_j p_ij dp_ij (elementwise f32: no TF32 dot).
    delta = jnp.sum(dout.astype(_F32) * out.astype(_F32), axis=-1).transpose(0, 2, 1)
    lse2 = lse.astype(_F32) * LOG2E
    do = dout.astype(q.dtype)
    indices = (q_index, kv_index, q_segment, kv_segment)

    launch = plan["dkv"]
    t = block_tables(*indices, launch.bq, launch.bk)
    lp = pl.cdiv(l, launch.bq) * launch.bq
    dims = _dims(q, v, kv_heads, launch, scale, s)
    dk, dv_ = _call(
        functools.partial(dkv_kernel, dims=dims),
        (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
        (kv_heads, pl.cdiv(s, launch.bk), b), launch, interpret, "flash_attention_bwd_dkv",
    )(q, kc, vc, do, _pad_len(lse2, lp), _pad_len(delta, lp), t.qpos, t.kpos, t.qseg, t.kseg, t.qblk, t.kblk,
      t.k_span)

    launch = plan["dq"]
    t = block_tables(*indices, launch.bq, launch.bk)
    lp = pl.cdiv(l, launch.bq) * launch.bq
    dims = _dims(q, v, kv_heads, launch, scale, s)
    dq = _call(
        functools.partial(dq_kernel, dims=dims), jax.ShapeDtypeStruct(q.shape, q.dtype),
        (h, pl.cdiv(l, launch.bq), b), launch, interpret, "flash_attention_bwd_dq",
    )(q, kc, vc, do, _pad_len(lse2, lp), _pad_len(delta, lp), t.qpos, t.kpos, t.qseg, t.kseg, t.qblk, t.kblk,
      t.q_span)
    return dq, dk, dv_
