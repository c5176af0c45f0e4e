"""Depthwise causal 1-D convolution (the Mamba short conv), segment aware.

  y[b, t, c] = act(bias[c] + sum_i w[c, i] * x[b, t - (k-1) + i, c])
Taps before t = 0, or in a different `seq_idx` segment than t, read zero; a
segment is a run of equal ids (the window restarts wherever seq_idx changes).
`activation` is "silu" or None.

Pallas/Triton: one program per (channel tile, time tile, batch). Each tap is
a row-shifted load of the same x tile (L1/L2 hits), gathered with explicit row
indices so taps before t = 0 are masked, not clamped. The backward recomputes
the pre-activation on the k-1 rows after the tile instead of storing it, and
writes per-tile dw/dbias partial sums that XLA adds up (deterministic).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jaxtrain.pallas_kernels import _common

_NAME = "causal_conv1d"
_F32 = jnp.float32
ACTIVATIONS = ("silu", None)


@dataclasses.dataclass(frozen=True)
class ConvConfig:
    """Tile sizes (powers of 2) and Triton params; memory-bound, so wide rows.

    The backward keeps ~3k row-shifted f32 tiles live, so it uses shorter ones.
    """

    block_l: int = 32
    block_l_bwd: int = 16
    block_d: int = 128
    num_warps: int = 4
    num_stages: int = 1
    interpret: bool = False


# ----------------------------------------------------------------------------
# Reference (XLA).


def _silu(z):
    return z / (1.0 + jnp.exp(-z))


def causal_conv1d_reference(x, w, bias=None, *, activation="silu", seq_idx=None):
    """Sum of k shifted copies (f32), masked across segment starts."""
    b, l, d = x.shape
    k = w.shape[1]
    xp = jnp.pad(x.astype(_F32), ((0, 0), (k - 1, 0), (0, 0)))
    if seq_idx is not None:  # padded ids never matter: padded x is zero
        seq_idx = _common.segment_ids(seq_idx)
        sp = jnp.pad(seq_idx, ((0, 0), (k - 1, 0)))
    z = jnp.zeros((b, l, d), _F32)
    if bias is not None:
        z = z + bias.astype(_F32)
    for i in range(k):
        tap = xp[:, i : i + l] * w[:, i].astype(_F32)
        if seq_idx is not None:
            same = sp[:, i : i + l] == seq_idx
            tap = jnp.where(same[..., None], tap, 0.0)
        z = z + tap
    if activation == "silu":
        z = _silu(z)
    return z.astype(x.dtype)


# ----------------------------------------------------------------------------
# Kernels.


@dataclasses.dataclass(frozen=True)
class _Dims:
    l: int
    d: int
    k: int
    bl: int  # forward time tile
    bl_bwd: int  # backward time tile
    bd: int
    activation: str | None
    has_seg: bool


def _tile(dims):
    dt_, lt, bi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = lt * dims.bl + jnp.arange(dims.bl, dtype=jnp.int32)
    cols = dt_ * dims.bd + jnp.arange(dims.bd, dtype=jnp.int32)
    return bi, lt, dt_, rows, cols


class _Window:
    """Row-shifted loads of one tile: offset o reads rows t + o (cached)."""

    def __init__(self, ref, seg_ref, bi, rows, cols, dims):
        self.ref, self.seg_ref, self.bi = ref, seg_ref, bi
        self.rows, self.cols, self.dims = rows, cols, dims
        self.col_in = cols < dims.d
        self._x, self._seg = {}, {}

    def in_range(self, o):
        src = self.rows + o
        return (src >= 0) & (src < self.dims.l)

    def x(self, o):
        if o not in self._x:
            src = self.rows + o
            mask = self.in_range(o)[:, None] & self.col_in[None, :]
            self._x[o] = pl_triton.load(
                self.ref.at[self.bi, src[:, None], self.cols[None, :]], mask=mask, other=0
            ).astype(_F32)
        return self._x[o]

    def seg(self, o):
        if o not in self._seg:
            self._seg[o] = pl_triton.load(self.seg_ref.at[self.bi, self.rows + o], mask=self.in_range(o), other=-1)
        return self._seg[o]

    def tap_ok(self, src, dst):
        """Row t + src may feed row t + dst: in range and same segment."""
        ok = self.in_range(src)
        if self.dims.has_seg:
            ok &= self.seg(src) == self.seg(dst)
        return ok

    def z(self, w, bias, o):
        """Pre-activation at rows t + o."""
        k = self.dims.k
        z = jnp.broadcast_to(bias[None, :], (self.dims.bl, self.dims.bd))
        for i in range(k):
            src = o + i - (k - 1)
            z = z + jnp.where(self.tap_ok(src, o)[:, None], self.x(src), 0.0) * (w[i][None, :])
        return z


def _load_params(w_ref, bias_ref, cols, dims):
    col_in = cols < dims.d
    w = [pl_triton.load(w_ref.at[i, cols], mask=col_in, other=0).astype(_F32) for i in range(dims.k)]
    bias = pl_triton.load(bias_ref.at[cols], mask=col_in, other=0).astype(_F32)
    return w, bias


def _store_rows(ref, bi, rows, cols, value, dims):
    mask = (rows < dims.l)[:, None] & (cols < dims.d)[None, :]
    pl_triton.store(ref.at[bi, rows[:, None], cols[None, :]], value.astype(ref.dtype), mask=mask)


def _conv_fwd_kernel(x_ref, w_ref, bias_ref, seg_ref, y_ref, *, dims):
    bi, _, _, rows, cols = _tile(dims)
    w, bias = _load_params(w_ref, bias_ref, cols, dims)
    z = _Window(x_ref, seg_ref, bi, rows, cols, dims).z(w, bias, 0)
    if dims.activation == "silu":
        z = _silu(z)
    _store_rows(y_ref, bi, rows, cols, z, dims)


def _conv_bwd_kernel(x_ref, w_ref, bias_ref, seg_ref, dy_ref, dx_ref, dw_ref, dbias_ref, *, dims):
    bi, lt, _, rows, cols = _tile(dims)
    k = dims.k
    w, bias = _load_params(w_ref, bias_ref, cols, dims)
    win = _Window(x_ref, seg_ref, bi, rows, cols, dims)
    dyw = _Window(dy_ref, seg_ref, bi, rows, cols, dims)
    # dz at rows t + j, j = 0..k-1 (rows >= l load dy = 0, so dz = 0).
    dz = []
    for j in range(k):
        g = dyw.x(j)
        if dims.activation == "silu":
            z = win.z(w, bias, j)
            sig = 1.0 / (1.0 + jnp.exp(-z))
            g = g * sig * (1.0 + z * (1.0 - sig))
        dz.append(g)
    # dx[s] = sum_i w_i dz[s + (k-1) - i] where tap i of that row reaches s.
    dx = jnp.zeros((dims.bl, dims.bd), _F32)
    for i in range(k):
        j = k - 1 - i
        dx = dx + jnp.where(win.tap_ok(0, j)[:, None], dz[j], 0.0) * w[i][None, :]
    _store_rows(dx_ref, bi, rows, cols, dx, dims)
    # Per-tile partial sums of dw[:, i] and dbias over this tile's rows.
    col_in = cols < dims.d
    for i in range(k):
        src = i - (k - 1)
        tap = jnp.where(win.tap_ok(src, 0)[:, None], win.x(src), 0.0)
        pl_triton.store(dw_ref.at[bi, lt, i, cols], jnp.sum(dz[0] * tap, axis=0), mask=col_in)
    pl_triton.store(dbias_ref.at[bi, lt, cols], jnp.sum(dz[0], axis=0), mask=col_in)


# ----------------------------------------------------------------------------
# Differentiable Pallas path.


def _grid(x, dims):
    b = x.shape[0]
    return (pl.cdiv(dims.d, dims.bd), pl.cdiv(dims.l, dims.bl), b)


def _call(kernel, out_shape, grid, cfg, name):
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        interpret=cfg.interpret,
        compiler_params=_common.triton_params(cfg.num_warps, cfg.num_stages),
        name=name,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _conv(x, w_t, bias, seg, dims, cfg):
    return _call(
        functools.partial(_conv_fwd_kernel, dims=dims),
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        _grid(x, dims),
        cfg,
        "causal_conv1d",
    )(x, w_t, bias, seg)


def _conv_fwd(x, w_t, bias, seg, dims, cfg):
    return _conv(x, w_t, bias, seg, dims, cfg), (x, w_t, bias, seg)


def _conv_bwd(dims, cfg, res, dy):
    x, w_t, bias, seg = res
    dims = dataclasses.replace(dims, bl=dims.bl_bwd)
    grid = _grid(x, dims)
    b, nl = x.shape[0], grid[1]
    dx, dw, dbias = _call(
        functools.partial(_conv_bwd_kernel, dims=dims),
        (
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct((b, nl, dims.k, dims.d), _F32),
            jax.ShapeDtypeStruct((b, nl, dims.d), _F32),
        ),
        grid,
        cfg,
        "causal_conv1d_bwd",
    )(x, w_t, bias, seg, dy.astype(x.dtype))
    return (dx, jnp.sum(dw, axis=(0, 1)).astype(w_t.dtype), jnp.sum(dbias, axis=(0, 1)).astype(bias.dtype), None)


_conv.defvjp(_conv_fwd, _conv_bwd)


# ----------------------------------------------------------------------------
# Public API.


def causal_conv1d(
    x,
    w,
    bias=None,
    *,
    activation: str | None = "silu",
    seq_idx=None,
    impl: str = "auto",
    block_l: int | None = None,
    block_d: int | None = None,
    num_warps: int | None = None,
):
    """Depthwise causal conv: x [b, l, d], w [d, k], bias [d] -> [b, l, d].

    Output t sees x[t-k+1 .. t] of its own `seq_idx` segment (zeros elsewhere).
    impl: "auto" (Pallas on GPU, XLA elsewhere) | "pallas" | "xla".
    block_l / block_d: power-of-2 tiles (the backward uses at most 16 rows).
    """
    use_pallas, interpret = _common.resolve_impl(impl, _NAME)
    x, w = jnp.asarray(x), jnp.asarray(w)
    if x.ndim != 3:
        raise ValueError(f"{_NAME}: x must be [b, l, d], got shape {x.shape}")
    b, l, d = x.shape
    if w.ndim != 2 or w.shape[0] != d or w.shape[1] < 1:
        raise ValueError(f"{_NAME}: w must be [d={d}, k], got shape {w.shape}")
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.shape != (d,):
            raise ValueError(f"{_NAME}: bias must be [d={d}], got shape " f"{bias.shape}")
    if seq_idx is not None:
        seq_idx = jnp.asarray(seq_idx)
        if seq_idx.shape != (b, l):
            raise ValueError(f"{_NAME}: seq_idx must be [b, l] = {(b, l)}, got " f"shape {seq_idx.shape}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{_NAME}: activation must be one of {ACTIVATIONS}, got " f"{activation!r}")
    if not use_pallas:
        return causal_conv1d_reference(x, w, bias, activation=activation, seq_idx=seq_idx)
    base = ConvConfig()
    bl = _common.check_block(_NAME, "block_l", block_l or base.block_l)
    bd = _common.check_block(_NAME, "block_d", block_d or base.block_d)
    cfg = dataclasses.replace(base, num_warps=num_warps or base.num_warps, interpret=interpret)
    dims = _Dims(
        l=l,
        d=d,
        k=w.shape[1],
        bl=_common.fit_block(l, bl, 1),
        bl_bwd=_common.fit_block(l, min(bl, cfg.block_l_bwd), 1),
        bd=_common.fit_block(d, bd),
        activation=activation,
        has_seg=seq_idx is not None,
    )
    seg = jnp.zeros((b, 1), jnp.int32) if seq_idx is None else _common.segment_ids(seq_idx)
    bias_ = jnp.zeros((d,), w.dtype) if bias is None else bias
    # w as [k, d]: each tap is a contiguous row.
    return _conv(x, w.T, bias_, seg, dims, cfg)
