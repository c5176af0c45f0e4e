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

Files: this one (public API, launch wrappers, custom VJP), ssd_scan_kernels.py (kernel
bodies), ssd_scan_reference.py (the XLA chunked form and a per-token loop).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxtrain.pallas_kernels import _common
from jaxtrain.pallas_kernels.ssd_scan_kernels import (
    Dims,
    chunk_bwd_kernel,
    chunk_out_kernel,
    chunk_state_kernel,
    state_pass_kernel,
)
from jaxtrain.pallas_kernels.ssd_scan_reference import pad_time, padded_segment_ids, ssd_scan_naive, ssd_scan_reference

__all__ = ["SsdConfig", "ssd_scan", "ssd_scan_naive", "ssd_scan_reference"]

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
    kernel = functools.partial(chunk_state_kernel, dims=dims, from_start=from_start)
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
    kernel = functools.partial(state_pass_kernel, dims=dims, tile=tile, reverse=reverse)
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
        functools.partial(chunk_out_kernel, dims=dims),
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
        functools.partial(chunk_bwd_kernel, dims=dims),
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
    dims = Dims(
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
    dt_bhl = pad_time(dt.astype(_F32), lp).transpose(0, 2, 1)
    a = dt_bhl * A.astype(_F32)[None, :, None]
    acum = jnp.cumsum(a.reshape(b, h, nc, lc), axis=-1).reshape(b, h, lp)
    if seq_idx is None:
        seg = jnp.zeros((b, lc), jnp.int32)  # unused placeholders
        seg_in = jnp.zeros((b, nc), jnp.int32)
        carry = jnp.ones((b, nc), _F32)
    else:
        seg = padded_segment_ids(seq_idx, lp)
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
