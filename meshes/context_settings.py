"""The context-parallel settings as plain values, without jax: which chunks of the sequence each
`context` rank holds (Contiguous | LoadBalanced) and how ranks see each other's keys and values
(RingKV | AllGatherKV). A ParallelPlan holds them (it is read before jax starts);
meshes/context_layout.py applies them inside a step.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Contiguous:
    chunks_per_rank = 1

    def chunk_ids(self, context: int) -> np.ndarray:
        """[context, chunks_per_rank]: the global chunk index of each rank's local chunks."""
        return np.arange(context).reshape(context, 1)


@dataclasses.dataclass(frozen=True)
class LoadBalanced:
    chunks_per_rank = 2

    def chunk_ids(self, context: int) -> np.ndarray:
        ranks = np.arange(context)
        return np.stack([ranks, 2 * context - 1 - ranks], axis=1)


def device_order(layout, length: int, context: int) -> np.ndarray:
    """[length] int32: the original place of the token at each device-order position."""
    chunks = context * layout.chunks_per_rank
    if length % chunks:
        raise ValueError(f"sequence length {length} is not divisible by context={context} x "
                         f"{layout.chunks_per_rank} chunks per rank ({type(layout).__name__} layout)")
    size = length // chunks
    ids = layout.chunk_ids(context).reshape(-1)
    return (ids[:, None] * size + np.arange(size)[None, :]).reshape(-1).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class RingKV:
    """Keys and values travel around the context ring block by block (ppermute), overlapped
    with each block's attention; memory holds two K/V blocks, not the whole sequence."""


@dataclasses.dataclass(frozen=True)
class AllGatherKV:
    """Every rank gathers the whole sequence's keys and values once (cheap with few kv heads)."""


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """Context-parallel settings (gin: `TrainConfig.context_parallel = @ContextParallel()`).
    `layout`: Contiguous() | LoadBalanced(); `kv_exchange`: RingKV() | AllGatherKV() (GQA;
    MLA always gathers its compressed latent instead of per-head keys and values)."""
    layout: object = LoadBalanced()
    kv_exchange: object = RingKV()

    def validate(self, seq_len: int, context: int) -> None:
        if not isinstance(self.layout, (Contiguous, LoadBalanced)):
            raise ValueError(f"ContextParallel.layout must be Contiguous() or LoadBalanced(), got {self.layout!r}")
        if not isinstance(self.kv_exchange, (RingKV, AllGatherKV)):
            raise ValueError(f"ContextParallel.kv_exchange must be RingKV() or AllGatherKV(), "
                             f"got {self.kv_exchange!r}")
        if context > 1:
            device_order(self.layout, seq_len, context)  # raises when the length does not divide
