"""The tile schedule of a grouped matmul: which (group, row tile) pairs hold work.

Both grouped-matmul paths walk it: the Pallas kernel (grouped_matmul.py) as its grid, the XLA
loop for CPU (grouped_matmul_tiled.py) as its scan. It is its own module so that neither path
imports the other for it (the Pallas module dispatches to the XLA loop).
"""
from __future__ import annotations

import jax.numpy as jnp


def tile_schedule(group_sizes, m: int, block_m: int):
    """Work items for the m axis: int32 arrays (group, m_tile, row_lo, row_hi).

    Segment g < num_groups is group g; segment num_groups is the zero tail
    [sum(group_sizes), m). Each segment covers the m-tiles it touches, so the
    number of items is at most cdiv(m, block_m) + num_groups (the static grid).
    Unused items have row_lo == row_hi (they store nothing).
    """
    num_groups = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.minimum(jnp.cumsum(sizes), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    starts = jnp.concatenate([starts, ends[-1:]])
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    nonempty = ends > starts
    first_tile = starts // block_m
    tiles = jnp.where(nonempty, (ends - 1) // block_m - first_tile + 1, 0)
    tile_end = jnp.cumsum(tiles)
    tile_begin = tile_end - tiles
    num_items = -(-m // block_m) + num_groups
    item = jnp.arange(num_items, dtype=jnp.int32)
    seg = jnp.searchsorted(tile_end, item, side="right").astype(jnp.int32)
    used = seg <= num_groups
    seg = jnp.minimum(seg, num_groups)
    m_tile = jnp.where(used, first_tile[seg] + item - tile_begin[seg], 0)
    row_lo = jnp.where(used, starts[seg], 0)
    row_hi = jnp.where(used, ends[seg], 0)
    return seg, m_tile, row_lo, row_hi
