"""Grouped matmul in plain XLA as a loop over row tiles: the CPU path.

`jax.lax.ragged_dot` on XLA:CPU is expanded into a dense product over every group (each row
multiplied by all `g` weight matrices, then masked), so its time and memory grow with the
number of groups — with 64 local experts, 64x the work of the dispatch itself. This path walks
the same tile schedule as the Pallas kernel (`tile_schedule.py`: one work item per
(group, row tile) the group touches, at most cdiv(m, block_m) + g of them) in a `lax.scan`:
each item multiplies one [block_m, k] tile by its group's [k, n] matrix and adds the rows of
that group into the output. Items without rows of a group (the zero tail past the groups, unused
items) come last in the schedule, so the loop stops before them (a loop with a traced trip
count): a dropless dispatch's receive buffer, sized for the worst case (every slot to one
device), costs its filled rows, not its size. Work is the filled rows·k·n
plus at most one extra tile per group, memory one tile. The backward pass is two more such loops
(dlhs with rhs transposed; drhs accumulating tileᵀ · dout per group), so nothing is saved per item.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtrain.pallas_kernels.tile_schedule import tile_schedule


def _items(group_sizes, m: int, block_m: int):
    group, tile, lo, hi = tile_schedule(group_sizes, m, block_m)
    return group, tile * block_m, lo, hi


def _row_mask(row0, lo, hi, group, num_groups, block_m: int):
    rows = row0 + jnp.arange(block_m, dtype=jnp.int32)
    return ((rows >= lo) & (rows < hi) & (group < num_groups))[:, None]


def _pad_rows(x, block_m: int):
    padded = -(-x.shape[0] // block_m) * block_m
    return jnp.pad(x, ((0, padded - x.shape[0]), (0, 0)))


def _work_loop(body, init, group_sizes, m: int, block_m: int):
    """Runs body(carry, (group, row0, lo, hi)) over the schedule's items that hold a group's rows:
    a prefix of it (groups in order, then the zero tail, then unused items), so a loop with a
    traced trip count, not a cond per item (with a cond, XLA:CPU holds about a third more temp
    on a full-size DeepSeek-V2-Lite step). Returns (carry, trips run, counted as they run)."""
    items = _items(group_sizes, m, block_m)
    count = jnp.sum((items[0] < group_sizes.shape[0]) & (items[3] > items[2])).astype(jnp.int32)
    step = lambda i, carry: (body(carry[0], tuple(a[i] for a in items)), carry[1] + 1)
    return jax.lax.fori_loop(jnp.zeros((), jnp.int32), count, step, (init, jnp.zeros((), jnp.int32)))


def _forward_counted(lhs, rhs, group_sizes, block_m: int, transpose_rhs: bool = False):
    """(out, tile products run): only items with work multiply (`_work_loop`), so a buffer sized
    for the worst case costs its filled rows, not its size."""
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    m, num_groups = lhs.shape[0], rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    x = _pad_rows(lhs, block_m)

    def multiply(out, work):
        group, row0, lo, hi = work
        tile = jax.lax.dynamic_slice_in_dim(x, row0, block_m)
        w = rhs[jnp.minimum(group, num_groups - 1)]
        y = jnp.dot(tile, w.T if transpose_rhs else w, preferred_element_type=jnp.float32)
        y = jnp.where(_row_mask(row0, lo, hi, group, num_groups, block_m), y, 0.0)
        old = jax.lax.dynamic_slice_in_dim(out, row0, block_m)
        return jax.lax.dynamic_update_slice_in_dim(out, old + y, row0, 0)

    out, run = _work_loop(multiply, jnp.zeros((x.shape[0], n), jnp.float32), group_sizes, m, block_m)
    return out[:m].astype(jnp.result_type(lhs.dtype, rhs.dtype)), run


def _forward(lhs, rhs, group_sizes, block_m: int, transpose_rhs: bool = False):
    return _forward_counted(lhs, rhs, group_sizes, block_m, transpose_rhs)[0]


def _rhs_grad_counted(lhs, dout, group_sizes, num_groups: int, block_m: int, dtype):
    """(d rhs, tile products run)."""
    m = lhs.shape[0]
    x, d = _pad_rows(lhs, block_m), _pad_rows(dout, block_m)

    def accumulate(grad, work):
        group, row0, lo, hi = work
        mask = _row_mask(row0, lo, hi, group, num_groups, block_m)
        tile = jnp.where(mask, jax.lax.dynamic_slice_in_dim(x, row0, block_m), 0)
        dtile = jax.lax.dynamic_slice_in_dim(d, row0, block_m)
        g = jnp.minimum(group, num_groups - 1)
        return grad.at[g].add(jnp.dot(tile.T, dtile, preferred_element_type=jnp.float32))

    grad = jnp.zeros((num_groups, lhs.shape[1], dout.shape[1]), jnp.float32)
    grad, run = _work_loop(accumulate, grad, group_sizes, m, block_m)
    return grad.astype(dtype), run


def _rhs_grad(lhs, dout, group_sizes, num_groups: int, block_m: int, dtype):
    return _rhs_grad_counted(lhs, dout, group_sizes, num_groups, block_m, dtype)[0]


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
