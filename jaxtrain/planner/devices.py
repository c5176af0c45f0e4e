"""What one accelerator offers the planner: memory, peak FLOP/s and link bandwidths.

Figures are the vendors' data-sheet numbers for dense bf16 tensor-core math and per-GPU
one-direction link bandwidth; a cluster description (cluster.py) may override any of them,
and measured link figures (`python -m jaxtrain.bench collectives --json`) replace the
bandwidths where given.

    intra_node_gbps   NVLink (or PCIe) bandwidth one GPU can push to its node's peers, GB/s
    inter_node_gbps   network bandwidth per GPU to other nodes (e.g. one 400 Gb/s NIC = 50)
"""
from __future__ import annotations

import dataclasses

GB = 1e9
GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    kind: str
    memory_bytes: float  # HBM the run may use (what the runtime reports, not the marketing GB)
    peak_flops: float  # dense bf16 FLOP/s
    memory_gbps: float  # HBM bandwidth, GB/s (for the roofline of memory-bound work)
    intra_node_gbps: float
    inter_node_gbps: float
    devices_per_node: int = 8


# The built-in kinds. Memory is the total nvidia-smi reports (MiB / 1024); the planner keeps a
# headroom below it (planner.py) for the runtime, NCCL buffers and fragmentation.
BUILTIN = {spec.kind: spec for spec in (
    DeviceSpec("H100", memory_bytes=79.6 * GIB, peak_flops=989e12, memory_gbps=3350,
               intra_node_gbps=450, inter_node_gbps=50),
    DeviceSpec("H200", memory_bytes=140.4 * GIB, peak_flops=989e12, memory_gbps=4800,
               intra_node_gbps=450, inter_node_gbps=50),
    DeviceSpec("B200", memory_bytes=179.1 * GIB, peak_flops=2250e12, memory_gbps=8000,
               intra_node_gbps=900, inter_node_gbps=50),
    DeviceSpec("A100", memory_bytes=80.0 * GIB, peak_flops=312e12, memory_gbps=2039,
               intra_node_gbps=300, inter_node_gbps=25),
    # RTX PRO 6000 Blackwell (server edition): 96 GB GDDR7, no NVLink: peers talk over PCIe 5
    # x16 (~64 GB/s a direction, less through the host bridge); 4 PFLOP/s FP4 with sparsity is
    # 0.5 PFLOP/s dense bf16.
    DeviceSpec("RTX PRO 6000", memory_bytes=95.6 * GIB, peak_flops=503.8e12, memory_gbps=1792,
               intra_node_gbps=50, inter_node_gbps=50),
)}
FIELDS = tuple(f.name for f in dataclasses.fields(DeviceSpec))


def builtin(kind: str) -> DeviceSpec:
    """The built-in spec whose name matches `kind` (case and spaces ignored)."""
    key = kind.replace(" ", "").lower()
    for name, spec in BUILTIN.items():
        if name.replace(" ", "").lower() == key:
            return spec
    raise ValueError(f"unknown device kind {kind!r}: built-in kinds are {', '.join(BUILTIN)}; "
                     f"describe another with every field ({', '.join(FIELDS[1:])})")
