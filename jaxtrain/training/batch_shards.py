"""Which rows of the global batch a process feeds.

A process must supply exactly the rows its devices hold under the batch sharding. Processes that
split the `data` axis hold different rows; processes that differ only along axes the batch is
replicated over (a pipeline stage per node, say) hold the same rows and must all read them. So the
number of row shards is the number of distinct row sets among the processes, not the process
count.
"""
from __future__ import annotations

from typing import Callable


def process_batch_shard(sharding, global_shape: tuple[int, ...], process_index: int,
                        process_of: Callable = lambda device: device.process_index) -> tuple[int, int]:
    """(shard, shards): the process feeds rows shard::shards of each global batch (the data
    iterators' split), one of `shards` equal, disjoint row sets. Raises ValueError when the
    sharding gives processes overlapping but different rows."""
    rows = global_shape[0]
    by_process: dict[int, set] = {}
    for device, index in sharding.devices_indices_map(tuple(global_shape)).items():
        start, stop, _ = index[0].indices(rows)
        by_process.setdefault(process_of(device), set()).add((start, stop))
    row_sets = sorted({frozenset(spans) for spans in by_process.values()}, key=min)
    shards = len(row_sets)
    covered = sorted(span for row_set in row_sets for span in row_set)
    contiguous = all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    if not (covered[0][0] == 0 and covered[-1][1] == rows and contiguous and rows % shards == 0
            and all(sum(b - a for a, b in s) == rows // shards for s in row_sets)):
        raise ValueError(f"the batch sharding {sharding.spec} gives processes overlapping but different rows of "
                         f"the {rows}-row batch ({[sorted(s) for s in row_sets]}): lay the mesh out so processes "
                         f"split the batch rows evenly or share all of them")
    if process_index not in by_process:
        raise ValueError(f"process {process_index} holds no device of the batch sharding")
    return row_sets.index(frozenset(by_process[process_index])), shards
