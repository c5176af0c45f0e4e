"""Grouped (ragged) matmul with the semantics of `jax.lax.ragged_dot`.

Rows of `lhs[m, k]` belong to groups in order: the first `group_sizes[0]` rows
use `rhs[0]`, the next `group_sizes[1]` use `rhs[1]`, ...; rows past
`sum(group_sizes)` produce zeros.

Pallas/Triton design: a *tile schedule* computed in XLA from `group_sizes`
lists work items (group, m-tile, row range). An m-tile that straddles a group
boundary appears once per group, each pass storing only its own rows (masked
store), so no tile mixes groups. Empty groups get no work item; the rows past
the last group form a pseudo-group that just stores zeros. Straddling tiles
cost at most one extra tile per group (none when sizes are multiples of
block_m). Backward: dlhs is the same
kernel reading rhs transposed; drhs is a second kernel (per group
lhs_gᵀ·dout_g, its row loop as long as the group).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxtrain.pallas_kernels import _common
from jaxtrain.pallas_kernels._common import masked_load as load
from jaxtrain.pallas_kernels._common import masked_store as store
from jaxtrain.pallas_kernels.grouped_matmul_tiled import grouped_matmul_tiled
from jaxtrain.pallas_kernels.tile_schedule import tile_schedule

_NAME = "grouped_matmul"
# groups x rows x k x n from which the CPU path loops over tiles. Forward + backward on one
# core-pair, the dense product is the faster one up to a few 1e6 of dense work; from about 1e7
# the tiles are, and their lead grows with the work (several times at a tiny MoE layer's 1e9;
# full-size MoE layers are ~1e12).
TILED_MIN_DENSE_WORK = 10**7


@dataclasses.dataclass(frozen=True)
class GmmConfig:
    """Static tiling. Defaults suit Hopper (H100/H200) bf16 with Triton."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4
    interpret: bool = False


# ----------------------------------------------------------------------------
# Reference (XLA).


def grouped_matmul_reference(lhs, rhs, group_sizes):
    """XLA path: `jax.lax.ragged_dot` (its grads are XLA ragged dots too)."""
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)


# ----------------------------------------------------------------------------
# Kernels.


def _gmm_kernel(
    group_ref,
    tile_ref,
    lo_ref,
    hi_ref,
    lhs_ref,
    rhs_ref,
    out_ref,
    *,
    m,
    k,
    n,
    num_groups,
    transpose_rhs,
    cfg,
    precision,
):
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    pid_n = pl.program_id(0)
    item = pl.program_id(1)
    group = group_ref[item]
    row0 = tile_ref[item] * bm
    lo = lo_ref[item]
    hi = hi_ref[item]
    col0 = pid_n * bn
    rows = row0 + jnp.arange(bm, dtype=jnp.int32)
    cols = col0 + jnp.arange(bn, dtype=jnp.int32)
    # Masks only where a dim is not a multiple of its block (static), so the
    # common aligned case issues unmasked, fully vectorized loads.
    row_in = rows < m if m % bm else None
    col_in = cols < n if n % bn else None
    rhs_group = jnp.minimum(group, num_groups - 1)
    # Tail/unused items skip the k loop: zero trips leave acc == 0.
    compute = (group < num_groups) & (hi > lo)
    num_k = jnp.where(compute, pl.cdiv(k, bk), 0)

    def body(kt, acc):
        k0 = kt * bk
        k_in = (k0 + jnp.arange(bk, dtype=jnp.int32)) < k if k % bk else None
        a = load(lhs_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)], row_in, k_in)
        if transpose_rhs:  # rhs is [g, n, k]: contract its last dim.
            b = load(rhs_ref.at[rhs_group, pl.ds(col0, bn), pl.ds(k0, bk)], col_in, k_in)
            dims = (((1,), (1,)), ((), ()))
        else:
            b = load(rhs_ref.at[rhs_group, pl.ds(k0, bk), pl.ds(col0, bn)], k_in, col_in)
            dims = (((1,), (0,)), ((), ()))
        return acc + jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, num_k, body, jnp.zeros((bm, bn), jnp.float32))
    mine = (rows >= lo) & (rows < hi)
    store(out_ref.at[pl.ds(row0, bm), pl.ds(col0, bn)], acc, mine, col_in)


def _gmm_pallas(lhs, rhs, group_sizes, cfg: GmmConfig, transpose_rhs=False):
    m, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    cfg = dataclasses.replace(
        cfg,
        block_m=_common.fit_block(m, cfg.block_m),
        block_n=_common.fit_block(n, cfg.block_n),
        block_k=_common.fit_block(k, cfg.block_k),
    )
    schedule = tile_schedule(group_sizes, m, cfg.block_m)
    num_items = schedule[0].shape[0]
    kernel = functools.partial(
        _gmm_kernel,
        m=m,
        k=k,
        n=n,
        num_groups=num_groups,
        transpose_rhs=transpose_rhs,
        cfg=cfg,
        precision=_common.dot_precision(lhs.dtype),
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), lhs.dtype),
        # n fastest: consecutive programs share an lhs tile; rhs[g] stays in L2.
        grid=(pl.cdiv(n, cfg.block_n), num_items),
        compiler_params=_common.triton_params(cfg.num_warps, cfg.num_stages),
        interpret=cfg.interpret,
        name="grouped_matmul_t" if transpose_rhs else "grouped_matmul",
    )(*schedule, lhs, rhs)


def _tgmm_kernel(start_ref, end_ref, lhs_ref, dout_ref, out_ref, *, k, n, tile_k, tile_n, step_m, precision):
    """out[g, k-tile, n-tile] = sum over rows r of group g: lhs[r]ᵀ dout[r]."""
    pid_n, pid_k, group = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start = start_ref[group]
    end = end_ref[group]
    k0, col0 = pid_k * tile_k, pid_n * tile_n
    ks = k0 + jnp.arange(tile_k, dtype=jnp.int32)
    cols = col0 + jnp.arange(tile_n, dtype=jnp.int32)
    k_in = ks < k if k % tile_k else None
    col_in = cols < n if n % tile_n else None

    def body(t, acc):
        r0 = start + t * step_m
        row_in = (r0 + jnp.arange(step_m, dtype=jnp.int32)) < end
        a = load(lhs_ref.at[pl.ds(r0, step_m), pl.ds(k0, tile_k)], row_in, k_in)
        b = load(dout_ref.at[pl.ds(r0, step_m), pl.ds(col0, tile_n)], row_in, col_in)
        return acc + jax.lax.dot_general(
            a, b, (((0,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )

    # Trip count follows the group size: empty groups store zeros.
    num_t = pl.cdiv(jnp.maximum(end - start, 0), step_m)
    acc = jax.lax.fori_loop(0, num_t, body, jnp.zeros((tile_k, tile_n), jnp.float32))
    store(out_ref.at[group, pl.ds(k0, tile_k), pl.ds(col0, tile_n)], acc, k_in, col_in)


def _tgmm_pallas(lhs, dout, group_sizes, num_groups, cfg: GmmConfig, dtype):
    """[g, k, n] with out[i] = lhs[rows of i]ᵀ @ dout[rows of i]."""
    m, k = lhs.shape
    n = dout.shape[1]
    # Output tile block_m x block_n over [k, n]; rows are walked block_k at a
    # time.
    tile_k = _common.fit_block(k, cfg.block_m)
    tile_n = _common.fit_block(n, cfg.block_n)
    step_m = _common.fit_block(m, cfg.block_k)
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    kernel = functools.partial(
        _tgmm_kernel, k=k, n=n, tile_k=tile_k, tile_n=tile_n, step_m=step_m, precision=_common.dot_precision(lhs.dtype)
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_groups, k, n), dtype),
        # Group slowest: programs of one group share its lhs/dout rows in L2.
        grid=(pl.cdiv(n, tile_n), pl.cdiv(k, tile_k), num_groups),
        compiler_params=_common.triton_params(cfg.num_warps, cfg.num_stages),
        interpret=cfg.interpret,
        name="grouped_matmul_tgmm",
    )(starts, ends, lhs, dout)


# ----------------------------------------------------------------------------
# Differentiable Pallas path.


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm(lhs, rhs, group_sizes, cfg):
    return _gmm_pallas(lhs, rhs, group_sizes, cfg)


def _gmm_fwd(lhs, rhs, group_sizes, cfg):
    return _gmm_pallas(lhs, rhs, group_sizes, cfg), (lhs, rhs, group_sizes)


def _gmm_bwd(cfg, res, dout):
    lhs, rhs, group_sizes = res
    dout = dout.astype(lhs.dtype)
    dlhs = _gmm_pallas(dout, rhs, group_sizes, cfg, transpose_rhs=True)
    drhs = _tgmm_pallas(lhs, dout, group_sizes, rhs.shape[0], cfg, rhs.dtype)
    return dlhs, drhs, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


# ----------------------------------------------------------------------------
# Public API.


def grouped_matmul(
    lhs,
    rhs,
    group_sizes,
    *,
    impl: str = "auto",
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
):
    """`[m, k] x [g, k, n] -> [m, n]`, exactly `jax.lax.ragged_dot` semantics.

    Args:
      lhs: [m, k] rows sorted by group.
      rhs: [g, k, n] one weight matrix per group.
      group_sizes: [g] integer row counts (cast to int32).
      impl: "auto" (Pallas on GPU, XLA elsewhere), "pallas" (interpreted off
        GPU) or "xla" (`ragged_dot`; on CPU the tiled loop of grouped_matmul_tiled.py).
      block_m/block_n/block_k: power-of-2 tile sizes >= 16 (shrunk for small
        dims);
        num_warps/num_stages: Triton launch params.
    """
    use_pallas, interpret = _common.resolve_impl(impl, _NAME)
    lhs, rhs, group_sizes = map(jnp.asarray, (lhs, rhs, group_sizes))
    if lhs.ndim != 2:
        raise ValueError(f"{_NAME}: lhs must be [m, k], got shape {lhs.shape}")
    if rhs.ndim != 3 or rhs.shape[1] != lhs.shape[1]:
        raise ValueError(f"{_NAME}: rhs must be [g, k={lhs.shape[1]}, n], " f"got shape {rhs.shape}")
    if group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"{_NAME}: group_sizes must be [g={rhs.shape[0]}], " f"got shape {group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"{_NAME}: group_sizes must be integers, " f"got {group_sizes.dtype}")
    group_sizes = group_sizes.astype(jnp.int32)
    dtype = jnp.result_type(lhs.dtype, rhs.dtype)
    lhs, rhs = lhs.astype(dtype), rhs.astype(dtype)
    if not use_pallas:
        # XLA:CPU expands ragged_dot densely over groups: past a size, loop over row tiles
        # instead (below TILED_MIN_DENSE_WORK the dense product is the faster one).
        dense_work = rhs.shape[0] * lhs.shape[0] * lhs.shape[1] * rhs.shape[2]
        if _common.target_platform() == "cpu" and dense_work >= TILED_MIN_DENSE_WORK:
            return grouped_matmul_tiled(lhs, rhs, group_sizes)
        return grouped_matmul_reference(lhs, rhs, group_sizes)
    base = GmmConfig()
    cfg = GmmConfig(
        # >= 16: smallest tile Triton's tensor-core dot accepts.
        block_m=_common.check_block(_NAME, "block_m", block_m or base.block_m, 16),
        block_n=_common.check_block(_NAME, "block_n", block_n or base.block_n, 16),
        block_k=_common.check_block(_NAME, "block_k", block_k or base.block_k, 16),
        num_warps=num_warps or base.num_warps,
        num_stages=num_stages or base.num_stages,
        interpret=interpret,
    )
    return _gmm(lhs, rhs, group_sizes, cfg)
