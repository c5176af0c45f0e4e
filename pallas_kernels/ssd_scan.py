"""Mamba-2 SSD (state-space duality) scan.

Recurrence per batch b, head h (group gh = h // (heads / groups)):
  s_t = exp(dt_t * A_h) * s_{t-1} + dt_t * x_t ⊗ B_t      s: [p, n]
  y_t = s_t @ C_t + D_h * x_t
`dt` is already positive (bias + softplus applied), A < 0. `seq_idx[b, t]`
restarts the state where it changes; `initial_states` feeds only the first
segment. Returns (y [b, l, h, p] in x.dtype, final_states [b, h, p, n] f32).

Chunked form (both the XLA reference and the kernels), with Lc = chunk_size
and acum = within-chunk cumsum of dt * A:
  intra-chunk:  y_i += sum_j<=i (C_i . B_j) exp(acum_i - acum_j) dt_j x_j
  chunk state:  st_c = sum_j exp(acum_last - acum_j) dt_j x_j ⊗ B_j
  inter-chunk:  S_{c+1} = exp(acum_last) S_c + st_c;  y_i += exp(acum_i) S_c C_i
Segment masks zero every term that would cross a seq_idx change.

Pallas path: three Triton kernels forward (chunk states | sequential state
passing | chunk output) and three backward (dy-weighted chunk states | reverse
state passing | all per-chunk gradients). The tiny within-chunk cumsum and the
segment bookkeeping stay in XLA, so JAX differentiates them (dA, the cumsum's
share of ddt) and no kernel needs a reverse cumsum.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels import _common
from pallas_kernels._common import masked_load as load
from pallas_kernels._common import masked_store as store

_NAME = "ssd_scan"
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class SsdConfig:
    """Triton launch params (Hopper defaults) and the state-passing tile."""

    num_warps: int = 4
    num_warps_bwd: int = 8  # the backward chunk kernel holds many [Lc, Lc] tiles
    num_stages: int = 2
    state_tile: int = 1024  # elements of the flattened [p, n] state per program
    interpret: bool = False


# ----------------------------------------------------------------------------
# Shared XLA helpers.


def _segment_ids(seq_idx, length):
    """Change-counting ids (see _common.segment_ids), edge-padded to `length`.

    Padding repeats the last id, so padded tokens never look like a restart.
    """
    seg = _common.segment_ids(seq_idx)
    return jnp.pad(seg, ((0, 0), (0, length - seg.shape[1])), mode="edge")


def _pad_time(a, length):
    pad = [(0, 0)] * a.ndim
    pad[1] = (0, length - a.shape[1])
    return jnp.pad(a, pad)


# ----------------------------------------------------------------------------
# References.


def ssd_scan_reference(x, dt, A, B, C, *, chunk_size, D=None, initial_states=None, seq_idx=None):
    """Chunked SSD in XLA (f32 math). Memory O(l * chunk_size), not O(l^2)."""
    b, l, h, p = x.shape
    g, n = B.shape[2:]
    hpg = h // g
    lc = chunk_size
    nc = pl.cdiv(l, lc)
    lp = nc * lc

    def chunked(a):
        a = _pad_time(a.astype(_F32), lp)
        return a.reshape(b, nc, lc, *a.shape[2:])

    xc = chunked(x).reshape(b, nc, lc, g, hpg, p)
    dtc = chunked(dt).reshape(b, nc, lc, g, hpg)
    bc, cc = chunked(B), chunked(C)  # [b, nc, lc, g, n]
    acum = jnp.cumsum(dtc * A.astype(_F32).reshape(g, hpg), axis=2)
    last = acum[:, :, -1]  # [b, nc, g, hpg]
    causal = jnp.tril(jnp.ones((lc, lc), bool))
    if seq_idx is None:
        same = causal  # [i, j]
        from_prev = from_here = carry = jnp.ones((), bool)
    else:
        seg = _segment_ids(seq_idx, lp).reshape(b, nc, lc)
        seg_in = jnp.concatenate([jnp.zeros_like(seg[:, :1, -1]), seg[:, :-1, -1]], axis=1)  # [b, nc]
        same = causal & (seg[..., :, None] == seg[..., None, :])  # [b,nc,i,j]
        same = same[:, :, None, None]
        from_prev = (seg == seg_in[..., None])[..., None, None]  # [b,nc,lc,1,1]
        from_here = (seg == seg[..., -1:])[..., None, None]
        carry = (seg[..., -1] == seg_in)[..., None, None]  # [b, nc, 1, 1]

    # Intra-chunk (quadratic within a chunk only).
    cb = jnp.einsum("bcign,bcjgn->bcgij", cc, bc)
    a_h = jnp.moveaxis(acum, 2, -1)  # [b, nc, g, hpg, lc]
    decay = jnp.exp(jnp.where(same, a_h[..., :, None] - a_h[..., None, :], -jnp.inf))
    mix = cb[:, :, :, None] * decay * jnp.moveaxis(dtc, 2, -1)[..., None, :]
    y = jnp.einsum("bcgkij,bcjgkp->bcigkp", mix, xc)

    # Per-chunk states, then the sequential pass over chunks.
    w = jnp.exp(last[:, :, None] - acum) * dtc * from_here
    states = jnp.einsum("bcjgk,bcjgkp,bcjgn->bcgkpn", w, xc, bc)
    chunk_decay = jnp.exp(last) * carry
    if initial_states is None:
        # zeros_like (not zeros): inside shard_map the carry must vary over the mesh like `states`.
        init = jnp.zeros_like(states[:, 0])
    else:
        init = initial_states.astype(_F32).reshape(b, g, hpg, p, n)

    def step(s, inputs):
        st, dc = inputs
        return dc[..., None, None] * s + st, s

    final, s_in = jax.lax.scan(step, init, (jnp.moveaxis(states, 1, 0), jnp.moveaxis(chunk_decay, 1, 0)))
    s_in = jnp.moveaxis(s_in, 0, 1)  # state entering each chunk
    y = y + jnp.einsum("bcign,bcgkpn->bcigkp", cc, s_in) * (jnp.exp(acum) * from_prev)[..., None]
    if D is not None:
        y = y + D.astype(_F32).reshape(g, hpg)[:, :, None] * xc
    y = y.reshape(b, lp, h, p)[:, :l].astype(x.dtype)
    return y, final.reshape(b, h, p, n)


def ssd_scan_naive(x, dt, A, B, C, *, D=None, initial_states=None, seq_idx=None):
    """Token-by-token lax.scan of the recurrence (f32). For tests only."""
    b, l, h, p = x.shape
    g, n = B.shape[2:]
    f32 = lambda a: a.astype(_F32)
    bh = jnp.repeat(f32(B), h // g, axis=2)
    ch = jnp.repeat(f32(C), h // g, axis=2)
    if seq_idx is None:
        keep = jnp.ones((b, l), _F32)
    else:
        keep = jnp.concatenate([jnp.ones((b, 1), bool), seq_idx[:, 1:] == seq_idx[:, :-1]], axis=1)
        keep = keep.astype(_F32)
    s0 = jnp.zeros((b, h, p, n), _F32) if initial_states is None else f32(initial_states)

    def step(s, inputs):
        xt, dtt, bt, ct, kt = inputs
        da = jnp.exp(dtt * f32(A)) * kt[:, None]
        s = da[..., None, None] * s + (dtt[..., None] * xt)[..., None] * bt[:, :, None, :]
        return s, jnp.einsum("bhpn,bhn->bhp", s, ct)

    seq = lambda a: jnp.moveaxis(a, 1, 0)
    final, y = jax.lax.scan(step, s0, (seq(f32(x)), seq(f32(dt)), seq(bh), seq(ch), seq(keep)))
    y = jnp.moveaxis(y, 0, 1)
    if D is not None:
        y = y + f32(D)[:, None] * f32(x)
    return y.astype(x.dtype), final


# ----------------------------------------------------------------------------
# Kernels. Grids are (heads, chunks, batch): heads fastest, so the heads of
# one group read the same B/C chunk back to back from L2.


@dataclasses.dataclass(frozen=True)
class _Dims:
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


def _chunk_state_kernel(u_ref, v_ref, dt_ref, acum_ref, seg_ref, seg_in_ref, out_ref, *, dims, from_start):
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


def _state_pass_kernel(start_ref, step_ref, acum_ref, carry_ref, seq_ref, end_ref, *, dims, tile, reverse):
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


def _chunk_out_kernel(x_ref, dt_ref, acum_ref, b_ref, c_ref, d_ref, s_in_ref, seg_ref, seg_in_ref, y_ref, *, dims):
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


def _chunk_bwd_kernel(
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


# ----------------------------------------------------------------------------
# pallas_call wrappers.


def _call(kernel, out_shape, grid, cfg, name, num_warps=None, **kw):
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        interpret=cfg.interpret,
        compiler_params=_common.triton_params(num_warps or cfg.num_warps, cfg.num_stages),
        name=name,
        **kw,
    )


def _state_shape(b, dims, h):
    return jax.ShapeDtypeStruct((b, dims.nc, h, dims.p2, dims.n2), _F32)


def _chunk_states(u, v, dt, acum, seg, seg_in, dims, cfg, from_start):
    b, h = u.shape[0], u.shape[2]
    kernel = functools.partial(_chunk_state_kernel, dims=dims, from_start=from_start)
    return _call(
        kernel,
        _state_shape(b, dims, h),
        (h, dims.nc, b),
        cfg,
        "ssd_chunk_state_bwd" if from_start else "ssd_chunk_state",
    )(u, v, dt, acum, seg, seg_in)


def _state_pass(start, steps, acum, carry, dims, cfg, reverse):
    """start [b, h, p2, n2], steps [b, nc, h, p2, n2] -> (per-chunk seq, end)."""
    b, nc, h = steps.shape[:3]
    flat = dims.p2 * dims.n2
    tile = min(flat, cfg.state_tile)
    kernel = functools.partial(_state_pass_kernel, dims=dims, tile=tile, reverse=reverse)
    seq, end = _call(
        kernel,
        (jax.ShapeDtypeStruct((b, nc, h, flat), _F32), jax.ShapeDtypeStruct((b, h, flat), _F32)),
        (flat // tile, h, b),
        cfg,
        "ssd_state_pass_bwd" if reverse else "ssd_state_pass",
    )(start.reshape(b, h, flat), steps.reshape(b, nc, h, flat), acum, carry)
    return (seq.reshape(b, nc, h, dims.p2, dims.n2), end.reshape(b, h, dims.p2, dims.n2))


def _forward(x, dt, acum, bmat, cmat, d, init, seg, seg_in, carry, dims, cfg):
    b, _, h, _ = x.shape
    states = _chunk_states(x, bmat, dt, acum, seg, seg_in, dims, cfg, False)
    s_in, final = _state_pass(init, states, acum, carry, dims, cfg, False)
    y = _call(
        functools.partial(_chunk_out_kernel, dims=dims),
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        (h, dims.nc, b),
        cfg,
        "ssd_chunk_out",
    )(x, dt, acum, bmat, cmat, d, s_in, seg, seg_in)
    return y, final, s_in


@functools.partial(jax.custom_vjp, nondiff_argnums=(10, 11))
def _ssd_core(x, dt, acum, bmat, cmat, d, init, seg, seg_in, carry, dims, cfg):
    y, final, _ = _forward(x, dt, acum, bmat, cmat, d, init, seg, seg_in, carry, dims, cfg)
    return y, final


def _ssd_core_fwd(x, dt, acum, bmat, cmat, d, init, seg, seg_in, carry, dims, cfg):
    y, final, s_in = _forward(x, dt, acum, bmat, cmat, d, init, seg, seg_in, carry, dims, cfg)
    return (y, final), (x, dt, acum, bmat, cmat, d, s_in, seg, seg_in, carry)


def _ssd_core_bwd(dims, cfg, res, cot):
    x, dt, acum, bmat, cmat, d, s_in, seg, seg_in, carry = res
    dy, dfinal = cot
    dy = dy.astype(x.dtype)
    b, l, h, _ = x.shape
    g = bmat.shape[2]
    # dL/dS_in per chunk from y, then the reverse pass gives dL/dS_out per chunk.
    dsy = _chunk_states(dy, cmat, dt, acum, seg, seg_in, dims, cfg, True)
    g_out, dinit = _state_pass(dfinal.astype(_F32), dsy, acum, carry, dims, cfg, True)
    lp = dims.nc * dims.lc
    tok = jax.ShapeDtypeStruct((b, h, lp), _F32)
    bc_shape = jax.ShapeDtypeStruct((b, lp, g, dims.n2), _F32)
    zeros = jnp.zeros(bc_shape.shape, _F32)
    dx, ddt, dacum, dd, db, dc = _call(
        functools.partial(_chunk_bwd_kernel, dims=dims),
        (jax.ShapeDtypeStruct(x.shape, x.dtype), tok, tok, tok, bc_shape, bc_shape),
        (h, dims.nc, b),
        cfg,
        "ssd_chunk_bwd",
        num_warps=cfg.num_warps_bwd,
        input_output_aliases={12: 4, 13: 5},
    )(x, dy, dt, acum, bmat, cmat, d, s_in, g_out, carry, seg, seg_in, zeros, zeros)
    n = dims.n
    return (
        dx,
        ddt,
        dacum,
        db[:, :l, :, :n].astype(bmat.dtype),
        dc[:, :l, :, :n].astype(cmat.dtype),
        jnp.sum(dd, axis=(0, 2)),
        dinit,
        None,
        None,
        None,
    )


_ssd_core.defvjp(_ssd_core_fwd, _ssd_core_bwd)


def _ssd_pallas(x, dt, A, B, C, D, initial_states, seq_idx, chunk_size, cfg):
    b, l, h, p = x.shape
    g, n = B.shape[2:]
    lc = chunk_size
    nc = pl.cdiv(l, lc)
    lp = nc * lc
    # p, n tiles: powers of 2 and >= 16 (Triton tensor-core dot minimum).
    dims = _Dims(
        l=l,
        lc=lc,
        nc=nc,
        hpg=h // g,
        p=p,
        n=n,
        p2=max(16, _common.pl_next_pow2(p)),
        n2=max(16, _common.pl_next_pow2(n)),
        has_seg=seq_idx is not None,
        precision=_common.dot_precision(x.dtype),
    )
    # Small per-token XLA prep (differentiable): [b, h, lp] f32, zero-padded dt.
    dt_bhl = _pad_time(dt.astype(_F32), lp).transpose(0, 2, 1)
    a = dt_bhl * A.astype(_F32)[None, :, None]
    acum = jnp.cumsum(a.reshape(b, h, nc, lc), axis=-1).reshape(b, h, lp)
    if seq_idx is None:
        seg = jnp.zeros((b, lc), jnp.int32)  # unused placeholders
        seg_in = jnp.zeros((b, nc), jnp.int32)
        carry = jnp.ones((b, nc), _F32)
    else:
        seg = _segment_ids(seq_idx, lp)
        ends = seg[:, lc - 1 :: lc]
        seg_in = jnp.concatenate([jnp.zeros_like(ends[:, :1]), ends[:, :-1]], 1)
        carry = (ends == seg_in).astype(_F32)
    d = jnp.zeros((h,), _F32) if D is None else D.astype(_F32)
    init = jnp.zeros((b, h, p, n), _F32) if initial_states is None else initial_states.astype(_F32)
    init = jnp.pad(init, ((0, 0), (0, 0), (0, dims.p2 - p), (0, dims.n2 - n)))
    y, final = _ssd_core(x, dt_bhl, acum, B, C, d, init, seg, seg_in, carry, dims, cfg)
    return y, final[:, :, :p, :n]


# ----------------------------------------------------------------------------
# Public API.


def _check_args(x, dt, A, B, C, chunk_size, D, initial_states, seq_idx):
    def bad(name, want, got):
        raise ValueError(f"{_NAME}: {name} must be {want}, got shape {got}")

    if x.ndim != 4:
        bad("x", "[b, l, h, p]", x.shape)
    b, l, h, p = x.shape
    if dt.shape != (b, l, h):
        bad("dt", f"[b, l, h] = {(b, l, h)}", dt.shape)
    if A.shape != (h,):
        bad("A", f"[h] = {(h,)}", A.shape)
    if B.ndim != 4 or B.shape[:2] != (b, l) or h % B.shape[2]:
        bad("B", "[b, l, g, n] with heads divisible by g", B.shape)
    if C.shape != B.shape:
        bad("C", f"the shape of B {B.shape}", C.shape)
    if D is not None and D.shape != (h,):
        bad("D", f"[h] = {(h,)}", D.shape)
    n = B.shape[3]
    if initial_states is not None and initial_states.shape != (b, h, p, n):
        bad("initial_states", f"[b, h, p, n] = {(b, h, p, n)}", initial_states.shape)
    if seq_idx is not None and seq_idx.shape != (b, l):
        bad("seq_idx", f"[b, l] = {(b, l)}", seq_idx.shape)
    if int(chunk_size) < 1:
        raise ValueError(f"{_NAME}: chunk_size must be >= 1, got {chunk_size}")


def ssd_scan(
    x,
    dt,
    A,
    B,
    C,
    *,
    chunk_size: int,
    D=None,
    initial_states=None,
    seq_idx=None,
    impl: str = "auto",
    num_warps: int | None = None,
    num_stages: int | None = None,
):
    """Mamba-2 SSD scan -> (y [b, l, h, p] x.dtype, final_states [b,h,p,n] f32).

    Args:
      x: [b, l, h, p]; dt: [b, l, h] positive step sizes; A: [h] negative.
      B, C: [b, l, g, n]; head h uses group h // (h_total / g).
      chunk_size: chunk length (a power of 2 >= 16 for the Pallas path).
      D: optional [h] skip. initial_states: optional [b, h, p, n] (first
        segment only). seq_idx: optional [b, l] int; the state restarts where it
        changes.
      impl: "auto" (Pallas on GPU, XLA elsewhere) | "pallas" | "xla".
    """
    use_pallas, interpret = _common.resolve_impl(impl, _NAME)
    x, dt, A, B, C = map(jnp.asarray, (x, dt, A, B, C))
    D = None if D is None else jnp.asarray(D)
    initial_states = None if initial_states is None else jnp.asarray(initial_states)
    seq_idx = None if seq_idx is None else jnp.asarray(seq_idx)
    _check_args(x, dt, A, B, C, chunk_size, D, initial_states, seq_idx)
    if not use_pallas:
        return ssd_scan_reference(
            x, dt, A, B, C, chunk_size=chunk_size, D=D, initial_states=initial_states, seq_idx=seq_idx
        )
    _common.check_block(_NAME, "chunk_size", chunk_size, 16)  # dot tile >= 16
    base = SsdConfig()
    cfg = dataclasses.replace(
        base, interpret=interpret, num_warps=num_warps or base.num_warps, num_stages=num_stages or base.num_stages
    )
    B = B.astype(x.dtype)
    C = C.astype(x.dtype)
    return _ssd_pallas(x, dt, A, B, C, D, initial_states, seq_idx, int(chunk_size), cfg)
