"""The SSD scan's Triton kernels (Pallas): chunk states, sequential state passing (forward or
reverse), chunk output, and the backward's per-chunk gradients. Grids are (heads, chunks,
batch): heads fastest, so the heads of one group read the same B/C chunk back to back from L2.
Launch wrappers and the custom VJP that strings them together: ssd_scan.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jaxtrain.pallas_kernels._common import masked_load as load
from jaxtrain.pallas_kernels._common import masked_store as store

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Dims:
    l: int
    lc: int  # chunk length (power of 2)
    nc: int
    hpg: int  # heads per group
    p: int
    n: int
    p2: int  # p, n rounded up to powers of 2 (Triton tile sizes)
    n2: int
    has_seg: bool
    precision: object

    @property
    def row_tail(self):  # last chunk is partial: mask rows >= l
        return self.l % self.lc != 0


def _chunk_rows(dims, c):
    rows = c * dims.lc + jnp.arange(dims.lc, dtype=jnp.int32)
    return rows < dims.l if dims.row_tail else None


def _col_mask(size, size2):
    return jnp.arange(size2, dtype=jnp.int32) < size if size != size2 else None


def _last(v):
    """v[-1] of a 1-D tile (Triton has no element extract)."""
    idx = jnp.arange(v.shape[0], dtype=jnp.int32)
    return jnp.sum(jnp.where(idx == v.shape[0] - 1, v, 0))


def _dot(a, b, contract, precision):
    return jax.lax.dot_general(a, b, (contract, ((), ())), precision=precision, preferred_element_type=_F32)


def _token_view(ref, bi, c, head_or_group, dims, width2):
    return ref.at[bi, pl.ds(c * dims.lc, dims.lc), head_or_group, pl.ds(0, width2)]


def _seg_masks(seg_ref, seg_in_ref, bi, c, dims):
    """Masks: (causal same-segment [Lc, Lc], sees carried-in state [Lc],
    feeds the chunk's end state [Lc]); the last two are None without seq_idx."""
    lc = dims.lc
    causal = jnp.arange(lc)[:, None] >= jnp.arange(lc)[None, :]
    if not dims.has_seg:
        return causal, None, None
    seg = seg_ref.at[bi, pl.ds(c * lc, lc)][...]
    seg_in = seg_in_ref[bi, c]
    seg_last = jnp.max(seg)  # ids never decrease
    same = causal & (seg[:, None] == seg[None, :])
    return same, seg == seg_in, seg == seg_last


def chunk_state_kernel(u_ref, v_ref, dt_ref, acum_ref, seg_ref, seg_in_ref, out_ref, *, dims, from_start):
    """out[b, c, h] = sum_j weight_j u_j ⊗ v_j over the chunk ([p, n], f32).

    Forward: (u, v) = (x, B), weight = dt_j exp(acum_last - acum_j) [same seg
    as the chunk's last token]. Backward (from_start): (u, v) = (dy, C),
    weight = exp(acum_j) [same seg as the carried-in state] = dL/dS_in.
    """
    h, c, bi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    grp = h // dims.hpg
    rows = _chunk_rows(dims, c)
    u = load(_token_view(u_ref, bi, c, h, dims, dims.p2), rows, _col_mask(dims.p, dims.p2))
    v = load(_token_view(v_ref, bi, c, grp, dims, dims.n2), rows, _col_mask(dims.n, dims.n2))
    acum = acum_ref.at[bi, h, pl.ds(c * dims.lc, dims.lc)][...]
    _, sees_prev, feeds_state = _seg_masks(seg_ref, seg_in_ref, bi, c, dims)
    if from_start:
        weight, keep = jnp.exp(acum), sees_prev
    else:
        dt = dt_ref.at[bi, h, pl.ds(c * dims.lc, dims.lc)][...]
        weight, keep = jnp.exp(_last(acum) - acum) * dt, feeds_state
    if keep is not None:
        weight = jnp.where(keep, weight, 0.0)
    uw = (u.astype(_F32) * weight[:, None]).astype(u.dtype)
    out_ref.at[bi, c, h][...] = _dot(uw, v, ((0,), (0,)), dims.precision)


def state_pass_kernel(start_ref, step_ref, acum_ref, carry_ref, seq_ref, end_ref, *, dims, tile, reverse):
    """Sequential pass over chunks on a flat [tile] slice of the [p*n] state.

    Forward:  seq[c] = S (state entering chunk c); S = decay_c S + step[c].
    Reverse:  seq[c] = H (grad of the state leaving chunk c);
              H = decay_c H + step[c]  (step = dL/dS_in from chunk c's outputs).
    decay_c = exp(acum at chunk end) * carry_c (0 if a segment starts in c).
    """
    t, h, bi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(t * tile, tile)

    def body(i, s):
        c = dims.nc - 1 - i if reverse else i
        seq_ref.at[bi, c, h, cols][...] = s
        decay = jnp.exp(acum_ref[bi, h, c * dims.lc + dims.lc - 1])
        decay = decay * carry_ref[bi, c]
        return decay * s + step_ref.at[bi, c, h, cols][...]

    s = jax.lax.fori_loop(0, dims.nc, body, start_ref.at[bi, h, cols][...])
    end_ref.at[bi, h, cols][...] = s


def chunk_out_kernel(x_ref, dt_ref, acum_ref, b_ref, c_ref, d_ref, s_in_ref, seg_ref, seg_in_ref, y_ref, *, dims):
    h, c, bi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    grp = h // dims.hpg
    rows = _chunk_rows(dims, c)
    pmask, nmask = _col_mask(dims.p, dims.p2), _col_mask(dims.n, dims.n2)
    x = load(_token_view(x_ref, bi, c, h, dims, dims.p2), rows, pmask)
    bm = load(_token_view(b_ref, bi, c, grp, dims, dims.n2), rows, nmask)
    cm = load(_token_view(c_ref, bi, c, grp, dims, dims.n2), rows, nmask)
    dt = dt_ref.at[bi, h, pl.ds(c * dims.lc, dims.lc)][...]
    acum = acum_ref.at[bi, h, pl.ds(c * dims.lc, dims.lc)][...]
    same, sees_prev, _ = _seg_masks(seg_ref, seg_in_ref, bi, c, dims)
    prec = dims.precision

    cb = _dot(cm, bm, ((1,), (1,)), prec)  # [Lc, Lc]
    decay = jnp.exp(jnp.where(same, acum[:, None] - acum[None, :], -jnp.inf))
    mix = (cb * decay * dt[None, :]).astype(x.dtype)
    y = _dot(mix, x, ((1,), (0,)), prec)  # [Lc, p]
    s_in = s_in_ref.at[bi, c, h][...].astype(cm.dtype)  # [p, n]
    from_prev = jnp.exp(acum)
    if sees_prev is not None:
        from_prev = jnp.where(sees_prev, from_prev, 0.0)
    y += _dot(cm, s_in, ((1,), (1,)), prec) * from_prev[:, None]
    y += d_ref[h] * x.astype(_F32)
    store(_token_view(y_ref, bi, c, h, dims, dims.p2), y, rows, pmask)


def chunk_bwd_kernel(
    x_ref,
    dy_ref,
    dt_ref,
    acum_ref,
    b_ref,
    c_ref,
    d_ref,
    s_in_ref,
    g_ref,
    carry_ref,
    seg_ref,
    seg_in_ref,
    db_in_ref,
    dc_in_ref,
    dx_ref,
    ddt_ref,
    dacum_ref,
    dd_ref,
    db_ref,
    dc_ref,
    *,
    dims,
):
    """All gradients of one (chunk, head); G = dL/d(state leaving the chunk).

    dB/dC are shared by the heads of a group: f32 atomic adds into zeroed
    buffers (db_ref aliases db_in_ref), so their summation order over the heads
    of a group may vary from run to run (last-bit nondeterminism).
    """
    del db_in_ref, dc_in_ref
    h, c, bi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    grp = h // dims.hpg
    lc = dims.lc
    rows = _chunk_rows(dims, c)
    pmask, nmask = _col_mask(dims.p, dims.p2), _col_mask(dims.n, dims.n2)
    x = load(_token_view(x_ref, bi, c, h, dims, dims.p2), rows, pmask)
    dy = load(_token_view(dy_ref, bi, c, h, dims, dims.p2), rows, pmask)
    bm = load(_token_view(b_ref, bi, c, grp, dims, dims.n2), rows, nmask)
    cm = load(_token_view(c_ref, bi, c, grp, dims, dims.n2), rows, nmask)
    toks = pl.ds(c * lc, lc)
    dt = dt_ref.at[bi, h, toks][...]
    acum = acum_ref.at[bi, h, toks][...]
    s_in = s_in_ref.at[bi, c, h][...]  # [p, n] f32
    g = g_ref.at[bi, c, h][...]
    same, sees_prev, feeds_state = _seg_masks(seg_ref, seg_in_ref, bi, c, dims)
    prec = dims.precision
    dtype = x.dtype
    is_last = jnp.arange(lc, dtype=jnp.int32) == lc - 1
    a_last = _last(acum)

    # Phases each finish (store) one output, so few [Lc, Lc] / [Lc, n] f32
    # tiles are live at once on the GPU.
    decay = jnp.exp(jnp.where(same, acum[:, None] - acum[None, :], -jnp.inf))
    dyx = _dot(dy, x, ((1,), (1,)), prec)  # dy_i . x_j
    pm = (dyx * decay * dt[None, :]).astype(dtype)
    from_prev = jnp.exp(acum)  # carried-in state: y_i += exp(acum_i) S_in C_i
    if sees_prev is not None:
        from_prev = jnp.where(sees_prev, from_prev, 0.0)
    to_end = jnp.exp(a_last - acum)  # chunk state: S_out += to_end dt x ⊗ B
    if feeds_state is not None:
        to_end = jnp.where(feeds_state, to_end, 0.0)
    w = to_end * dt
    # dB/dC live in [b, lp, g, n2] f32 buffers: always in bounds, and padded
    # rows/cols only add zeros.
    bc_index = (bi, toks, grp, pl.ds(0, dims.n2))

    # 1. dB = pmᵀ C + w x G.
    db = _dot(pm, cm, ((0,), (0,)), prec)
    db += w[:, None] * _dot(x, g.astype(dtype), ((1,), (0,)), prec)
    pl_triton.atomic_add(db_ref, bc_index, db)

    # 2. dC = pm B + from_prev dy S_in.
    dc = _dot(pm, bm, ((1,), (0,)), prec)
    dc += from_prev[:, None] * _dot(dy, s_in.astype(dtype), ((1,), (0,)), prec)
    pl_triton.atomic_add(dc_ref, bc_index, dc)

    # 3. Intra-chunk y_i = sum_j cb_ij decay_ij dt_j x_j: dx, ddt, dacum.
    cb_decay = _dot(cm, bm, ((1,), (1,)), prec) * decay
    r = cb_decay * dyx  # d y / d dt_j, per (i, j)
    ddt = jnp.sum(r, axis=0)
    q = r * dt[None, :]  # d y / d(acum_i - acum_j)
    dacum = jnp.sum(q, axis=1) - jnp.sum(q, axis=0)
    mix = (cb_decay * dt[None, :]).astype(dtype)
    dx = _dot(mix, dy, ((0,), (0,)), prec)  # mixᵀ dy
    bg = _dot(bm, g.astype(dtype), ((1,), (1,)), prec)  # B Gᵀ: [Lc, p]
    dx += w[:, None] * bg + d_ref[h] * dy.astype(_F32)
    store(_token_view(dx_ref, bi, c, h, dims, dims.p2), dx, rows, pmask)

    # 4. Per-token scalars: the state terms of ddt / dacum, and dD.
    cs = _dot(cm, s_in.astype(dtype), ((1,), (1,)), prec)  # C S_inᵀ: [Lc, p]
    dacum += from_prev * jnp.sum(dy.astype(_F32) * cs, axis=1)
    v = to_end * jnp.sum(x.astype(_F32) * bg, axis=1)
    ddt += v
    dacum -= v * dt
    # acum_last also scales every chunk-state term and decay_c * S_in, with
    # decay_c = exp(a_last) * carry_c.
    chunk_decay = jnp.exp(a_last) * carry_ref[bi, c]
    dacum += jnp.where(is_last, jnp.sum(v * dt) + chunk_decay * jnp.sum(s_in * g), 0.0)
    ddt_ref.at[bi, h, toks][...] = ddt
    dacum_ref.at[bi, h, toks][...] = dacum
    dd_ref.at[bi, h, toks][...] = jnp.sum(dy.astype(_F32) * x.astype(_F32), axis=1)
