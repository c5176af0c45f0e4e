"""The context-parallel settings as plain values, without jax: which chunks of the sequence each
`context` rank holds (Contiguous | LoadBalanced) and how ranks see each other's keys and values
(RingKV | AllGatherKV | LatentKV). A ParallelPlan holds them (it is read before jax starts);
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


def _per_head_width(kv_heads: int, qk_head_dim: int, v_head_dim: int) -> int:
    return kv_heads * (qk_head_dim + v_head_dim)


@dataclasses.dataclass(frozen=True)
class RingKV:
    """Keys and values travel around the context ring block by block (ppermute), overlapped
    with each block's attention; memory holds two K/V blocks, not the whole sequence. MLA
    up-projects each rank's own tokens and rings the per-head keys/values."""
    gathers_keys = False  # GQA: the ring (meshes/context_attention.py)
    moves_latent = False  # MLA: per-head keys/values travel (models/layers/mla.py)

    def exchanged_width(self, *, kv_heads: int, qk_head_dim: int, v_head_dim: int,
                        latent_width: int | None = None) -> int:
        """Values per token that reach a device over `context` in one layer's forward (it receives
        (C - 1) / C of the sequence's tokens at this width). `kv_heads`: the key/value heads one
        device holds (MLA: its query heads, / tensor when the heads are split); `latent_width`:
        MLA's kv_lora + rope (None for attention without a latent; never split over tensor)."""
        return _per_head_width(kv_heads, qk_head_dim, v_head_dim)


@dataclasses.dataclass(frozen=True)
class AllGatherKV:
    """Every rank gathers the whole sequence's keys and values once (cheap with few kv heads);
    MLA gathers per-head keys/values up-projected by each rank from its own tokens."""
    gathers_keys = True
    moves_latent = False

    def exchanged_width(self, *, kv_heads: int, qk_head_dim: int, v_head_dim: int,
                        latent_width: int | None = None) -> int:
        """As RingKV's: the same values cross, all at once instead of a block per ring step."""
        return _per_head_width(kv_heads, qk_head_dim, v_head_dim)


@dataclasses.dataclass(frozen=True)
class LatentKV:
    """MLA gathers the whole sequence's latent and rotary key (kv_lora + rope values a token:
    576 at V2-Lite's shape, ~9x fewer than its per-head keys/values) and every rank up-projects
    all of it, a rank's length of keys at a time inside the attention: (C - 1) / C more
    up-projection work for the fewer bytes (slow links, long contexts). Attention without a
    latent (GQA) rings its keys/values as under RingKV."""
    gathers_keys = False
    moves_latent = True

    def exchanged_width(self, *, kv_heads: int, qk_head_dim: int, v_head_dim: int,
                        latent_width: int | None = None) -> int:
        """MLA: latent_width (kv_lora + rope); without a latent, RingKV's per-head width."""
        return _per_head_width(kv_heads, qk_head_dim, v_head_dim) if latent_width is None else int(latent_width)


KV_EXCHANGE_TYPES = (RingKV, AllGatherKV, LatentKV)


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """Context-parallel settings (gin: `TrainConfig.context_parallel = @ContextParallel()`).
    `layout`: Contiguous() | LoadBalanced(); `kv_exchange`: RingKV() | AllGatherKV() | LatentKV()
    (what crosses `context` for attention: per-head keys/values by ring or gather, or MLA's latent)."""
    layout: object = LoadBalanced()
    kv_exchange: object = RingKV()

    def validate(self, seq_len: int, context: int) -> None:
        if not isinstance(self.layout, (Contiguous, LoadBalanced)):
            raise ValueError(f"ContextParallel.layout must be Contiguous() or LoadBalanced(), got {self.layout!r}")
        if not isinstance(self.kv_exchange, KV_EXCHANGE_TYPES):
            raise ValueError(f"ContextParallel.kv_exchange must be RingKV(), AllGatherKV() or LatentKV(), "
                             f"got {self.kv_exchange!r}")
        if context > 1:
            device_order(self.layout, seq_len, context)  # raises when the length does not divide
