"""Grouped matmul in plain XLA as a loop over row tiles: the CPU path.

`jax.lax.ragged_dot` on XLA:CPU is expanded into a dense product over every group (each row
multiplied by all `g` weight matrices, then masked), so its time and memory grow with the
number of groups — with 64 local experts, 64x the work of the dispatch itself. This path walks
the same tile schedule as the Pallas kernel (`tile_schedule.py`: one work item per
(group, row tile) the group touches, at most cdiv(m, block_m) + g of them) in a `lax.scan`:
each item multiplies one [block_m, k] tile by its group's [k, n] matrix and adds the rows of
that group into the output. Work is m·k·n plus at most one extra tile per group, memory one
tile. The backward pass is two more such loops (dlhs with rhs transposed; drhs accumulating
tileᵀ · dout per group), so nothing is saved per item.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.tile_schedule import tile_schedule


def _items(group_sizes, m: int, block_m: int):
    group, tile, lo, hi = tile_schedule(group_sizes, m, block_m)
    return group, tile * block_m, lo, hi


def _row_mask(row0, lo, hi, group, num_groups, block_m: int):
    rows = row0 + jnp.arange(block_m, dtype=jnp.int32)
    return ((rows >= lo) & (rows < hi) & (group < num_groups))[:, None]


def _pad_rows(x, block_m: int):
    padded = -(-x.shape[0] // block_m) * block_m
    return jnp.pad(x, ((0, padded - x.shape[0]), (0, 0)))


def _forward(lhs, rhs, group_sizes, block_m: int, transpose_rhs: bool = False):
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    m, num_groups = lhs.shape[0], rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    x = _pad_rows(lhs, block_m)

    def item(out, work):
        group, row0, lo, hi = work
        tile = jax.lax.dynamic_slice_in_dim(x, row0, block_m)
        w = rhs[jnp.minimum(group, num_groups - 1)]
        y = jnp.dot(tile, w.T if transpose_rhs else w, preferred_element_type=jnp.float32)
        y = jnp.where(_row_mask(row0, lo, hi, group, num_groups, block_m), y, 0.0)
        old = jax.lax.dynamic_slice_in_dim(out, row0, block_m)
        return jax.lax.dynamic_update_slice_in_dim(out, old + y, row0, 0), None

    out = jnp.zeros((x.shape[0], n), jnp.float32)
    out, _ = jax.lax.scan(item, out, _items(group_sizes, m, block_m))
    return out[:m].astype(jnp.result_type(lhs.dtype, rhs.dtype))


def _rhs_grad(lhs, dout, group_sizes, num_groups: int, block_m: int, dtype):
    m = lhs.shape[0]
    x, d = _pad_rows(lhs, block_m), _pad_rows(dout, block_m)

    def item(grad, work):
        group, row0, lo, hi = work
        mask = _row_mask(row0, lo, hi, group, num_groups, block_m)
        tile = jnp.where(mask, jax.lax.dynamic_slice_in_dim(x, row0, block_m), 0)
        dtile = jax.lax.dynamic_slice_in_dim(d, row0, block_m)
        g = jnp.minimum(group, num_groups - 1)
        return grad.at[g].add(jnp.dot(tile.T, dtile, preferred_element_type=jnp.float32)), None

    grad = jnp.zeros((num_groups, lhs.shape[1], dout.shape[1]), jnp.float32)
    grad, _ = jax.lax.scan(item, grad, _items(group_sizes, m, block_m))
    return grad.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def grouped_matmul_tiled(lhs, rhs, group_sizes, block_m: int = 64):
    """`[m, k] x [g, k, n] -> [m, n]` with `jax.lax.ragged_dot` semantics (rows past the groups
    give zeros), computed tile by tile."""
    return _forward(lhs, rhs, group_sizes, block_m)


def _fwd(lhs, rhs, group_sizes, block_m):
    return _forward(lhs, rhs, group_sizes, block_m), (lhs, rhs, group_sizes)


def _bwd(block_m, res, dout):
    lhs, rhs, group_sizes = res
    dlhs = _forward(dout.astype(lhs.dtype), rhs, group_sizes, block_m, transpose_rhs=True).astype(lhs.dtype)
    drhs = _rhs_grad(lhs, dout.astype(lhs.dtype), group_sizes, rhs.shape[0], block_m, rhs.dtype)
    return dlhs, drhs, None


grouped_matmul_tiled.defvjp(_fwd, _bwd)
