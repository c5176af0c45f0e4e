"""How attention is computed: one strategy object per implementation, chosen by model config
(`LlamaConfig.attention = @BlockwiseAttention()`, ...). All give the same numbers.

  MaterializedAttention  one einsum over [queries, keys]: the L² scores in memory. The reference
                         the others are tested against; XLA's partitioner shards it as it can.
  BlockwiseAttention     flash-style pure JAX (online softmax over key blocks, masked blocks
                         skipped): O(L · block) memory, any backend.
  PallasAttention        the Triton flash kernels (GPU; `interpret=True` runs them on CPU).
  AutoAttention          Pallas on GPU, blockwise elsewhere (the default).

Every strategy but the materialized one runs per device under a mesh, with real context
parallelism (meshes/context_attention.py). A strategy is called as
`strategy(q, k, v, segment_ids, scale=..., kv_whole=False, kv_head_name="kv_heads")`:
q [b, l, h, d], k/v [b, l, kv, d|dv] with the sequence in the context layout's device order;
`kv_whole`: k/v already span the whole sequence on every context rank.

Strategies with `takes_latent` also attend to MLA's latent directly:
`strategy.latent(q, latent, k_rope, w_up, segment_ids, nope=..., scale=...)` up-projects the
(whole-sequence) latent to per-head keys/values chunk by chunk inside the attention
(meshes/latent_attention.py). The materialized reference does not: its caller up-projects.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxtrain.meshes.context_attention import sequence_order, sharded_attention, sharded_latent_attention
from jaxtrain.meshes.rules import constrain
from jaxtrain.models.layers.attention_core import attention_mask, dot_product_attention
from jaxtrain.pallas_kernels._common import target_platform


@dataclasses.dataclass(frozen=True)
class MaterializedAttention:
    decode_block: int | None = None  # cache entries a decode step reads per trip (None: decode_attention's default)
    takes_latent = False

    def check_backend(self, platform: str) -> None:
        pass

    def __call__(self, q, k, v, segment_ids, *, scale: float, kv_whole=False, kv_head_name="kv_heads"):
        places = jnp.asarray(sequence_order(q.shape[1]))  # whole rows here: XLA partitions the einsum
        return dot_product_attention(q, k, v, attention_mask(segment_ids, segment_ids, places, places), scale=scale)


@dataclasses.dataclass(frozen=True)
class _Flash:
    """Shared by the per-device implementations: which kernel, which blocks."""
    block_q: int | None = None  # None: the kernel's default, shrunk for short sequences
    block_k: int | None = None
    decode_block: int | None = None  # cache entries a decode step reads per trip (models/layers/decode_attention.py)
    takes_latent = True

    def check_backend(self, platform: str) -> None:
        pass

    def kernel_impl(self) -> str:
        return "xla"

    def __call__(self, q, k, v, segment_ids, *, scale: float, kv_whole=False, kv_head_name="kv_heads"):
        out = sharded_attention(q, k, v, segment_ids, scale=scale, impl=self.kernel_impl(), block_q=self.block_q,
                                block_k=self.block_k, kv_whole=kv_whole, kv_head_name=kv_head_name)
        return constrain(out, ("batch", "length", "heads", None))

    def latent(self, q, latent, k_rope, w_up, segment_ids, *, nope: int, scale: float):
        """q [b, l, h, nope + rope]; latent [b, L, kv_lora], k_rope [b, L, rope] whole-sequence in
        device order; w_up [kv_lora, h, nope + dv] -> [b, l, h, dv]."""
        out = sharded_latent_attention(q, latent, k_rope, w_up, segment_ids, nope=nope, scale=scale,
                                       impl=self.kernel_impl(), block_q=self.block_q, block_k=self.block_k)
        return constrain(out, ("batch", "length", "heads", None))


@dataclasses.dataclass(frozen=True)
class BlockwiseAttention(_Flash):
    pass


@dataclasses.dataclass(frozen=True)
class PallasAttention(_Flash):
    interpret: bool = False  # run the kernels in the Pallas interpreter (CPU tests)

    def check_backend(self, platform: str) -> None:
        if platform != "gpu" and not self.interpret:
            raise ValueError(f"PallasAttention needs a GPU (its Triton kernels cannot run on {platform!r}); use "
                             f"BlockwiseAttention() or AutoAttention() here, or PallasAttention(interpret=True) "
                             f"to run the kernels in the (slow) interpreter")

    def kernel_impl(self) -> str:
        return "pallas"


@dataclasses.dataclass(frozen=True)
class AutoAttention(_Flash):
    def kernel_impl(self) -> str:
        return "pallas" if target_platform() == "gpu" else "xla"


STRATEGIES = (MaterializedAttention, BlockwiseAttention, PallasAttention, AutoAttention)


def check_attention(strategy, owner: str) -> None:
    """A clear error for anything that is not an attention strategy (e.g. a string in gin)."""
    if not isinstance(strategy, STRATEGIES):
        names = ", ".join(f"{s.__name__}()" for s in STRATEGIES)
        raise ValueError(f"{owner}.attention must be one of {names}; got {strategy!r}")
