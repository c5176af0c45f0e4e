"""Which link each mesh axis crosses, and what it delivers.

Devices are numbered node by node and the mesh puts `tensor` innermost (meshes/mesh.py), so an
axis whose devices lie within `devices_per_node` consecutive devices talks over the node's
links (NVLink, or PCIe), and an axis that spans nodes over the network. Across several
processes jaxtrain spreads them over the outer axes first, which is the same picture. A
collective over several axes is as slow as the slowest of them.

Measured figures (`python -m jaxtrain.bench collectives --json FILE`, rows carrying the mesh
they ran on) replace the data-sheet bandwidths: for each row the link class of its axes is
found the same way, and the largest message's bus bandwidth of each class is taken.
"""
from __future__ import annotations

import json
import math

from jaxtrain.meshes.mesh_config import AXES

INTRA, INTER, BETWEEN_GROUPS = "intra-node", "inter-node", "between groups"


def axis_link(axis: str, sizes: dict[str, int], devices_per_node: int) -> str:
    """The link class one mesh axis crosses."""
    inner = math.prod(sizes[a] for a in AXES[AXES.index(axis) + 1:])
    return INTRA if inner * sizes[axis] <= devices_per_node else INTER


def slowest_link(axes, sizes: dict[str, int], devices_per_node: int) -> str | None:
    """The link class of a collective over `axes` (None when they are all of size 1)."""
    links = {axis_link(a, sizes, devices_per_node) for a in axes if sizes[a] > 1}
    return INTER if INTER in links else INTRA if links else None


DATA_SHEET = "data sheet"
# Large collectives reach about this fraction of a link's data-sheet bandwidth (nccl-tests bus
# bandwidth against line rate); measured figures are used as they are.
DATA_SHEET_EFFICIENCY = 0.8


class LinkTable:
    """GB/s per link class for one device group; from the spec, or from measurements."""

    def __init__(self, intra_gbps: float, inter_gbps: float, between_groups_gbps: float | None = None,
                 source: str = DATA_SHEET):
        self.gbps = {INTRA: intra_gbps, INTER: inter_gbps, BETWEEN_GROUPS: between_groups_gbps or inter_gbps}
        self.source = source

    def seconds(self, link: str | None, bus_bytes: float) -> float:
        """Time for `bus_bytes` of bus traffic per device over `link` (None: no traffic)."""
        if link is None or not bus_bytes:
            return 0.0
        efficiency = DATA_SHEET_EFFICIENCY if self.source == DATA_SHEET else 1.0
        return bus_bytes / (self.gbps[link] * 1e9 * efficiency)

    def with_measurements(self, path: str, devices_per_node: int) -> "LinkTable":
        """This table with the classes the collectives bench measured replaced by its figures."""
        best: dict[str, tuple[int, float]] = {}
        with open(path) as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    mesh, axes = row["mesh"], row["axes"].split("+")
                    size, busbw = int(row["bytes"]), float(row["busbw_GBps"])
                except (ValueError, KeyError) as e:
                    raise ValueError(f"{path}:{line_no}: not a collectives-bench row with mesh, axes, bytes and "
                                     f"busbw_GBps ({e})") from None
                link = slowest_link(axes, {a: mesh.get(a, 1) for a in AXES}, devices_per_node)
                if link is not None and (link not in best or size > best[link][0]
                                         or (size == best[link][0] and busbw > best[link][1])):
                    best[link] = (size, busbw)
        if not best:
            raise ValueError(f"{path}: no collectives-bench rows over an axis of size > 1")
        out = LinkTable(self.gbps[INTRA], self.gbps[INTER], self.gbps[BETWEEN_GROUPS], source=path)
        for link in set(out.gbps) - set(best):  # classes it did not measure: their data-sheet figure's reach
            out.gbps[link] *= DATA_SHEET_EFFICIENCY
        for link, (_, busbw) in best.items():
            out.gbps[link] = busbw
        return out
