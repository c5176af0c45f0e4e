"""The pure Mamba-2 language model (HF `Mamba2ForCausalLM`): pre-norm Mamba-2 blocks only,
one scanned layer stack."""
from __future__ import annotations

import dataclasses
from typing import Mapping

from flax import nnx

from jaxtrain.models.causal_lm import CausalLM, add_residual, layer_input
from jaxtrain.models.dtypes import dtype_from_name
from jaxtrain.models.family import FamilyConfig, model_family
from jaxtrain.models.layers.mamba2 import Mamba2Mixer, SSMConfig
from jaxtrain.models.layers.norm import RMSNorm
from jaxtrain.models.layers.stack import LayerStack


class Mamba2Block(nnx.Module):
    """x + mixer(norm(x)). Also the Mamba layer of the hybrid families."""

    def __init__(self, embed: int, ssm: SSMConfig, *, norm_eps: float, rngs: nnx.Rngs, init_std: float,
                 dtype, kernels: str):
        self.norm = RMSNorm(embed, rngs=rngs, eps=norm_eps)
        self.mixer = Mamba2Mixer(embed, ssm, rngs=rngs, norm_eps=norm_eps, init_std=init_std, dtype=dtype,
                                 kernels=kernels)

    def __call__(self, x, positions, segment_ids):
        return add_residual(x, self.mixer(layer_input(self.norm(x)), segment_ids)), {}

    # Generation (models/layers/decode_cache.py): the mixer's constant-size state is the cache.
    def init_cache(self, batch: int, max_len: int, dtype):
        return self.mixer.init_cache(batch, max_len, dtype)

    def prefill(self, x, positions, segment_ids, cache):
        update, cache = self.mixer.prefill(layer_input(self.norm(x)), positions, segment_ids, cache)
        return add_residual(x, update), cache

    def decode(self, x, positions, cache, index, valid_from):
        update, cache = self.mixer.decode(layer_input(self.norm(x)), positions, cache, index, valid_from)
        return add_residual(x, update), cache


@model_family("mamba2", "pure Mamba-2 language model", parts=(SSMConfig,), hf_adapter="jaxtrain.hf.families.mamba2")
@dataclasses.dataclass(frozen=True)
class Mamba2Config(FamilyConfig):
    vocab_size: int = 512
    embed: int = 64
    layers: int = 2
    ssm: SSMConfig = SSMConfig(heads=8, head_dim=16, state=16, groups=2, chunk_size=16)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    dtype: str = "float32"
    remat: str = "none"
    kernels: str = "xla"  # SSD scan / causal conv: auto | pallas | xla

    def validate(self, mesh_sizes: Mapping[str, int]) -> None:
        for name in ("vocab_size", "embed", "layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"Mamba2Config.{name} must be positive, got {getattr(self, name)}")
        self.ssm.validate("Mamba2Config")

    def build(self, rngs: nnx.Rngs) -> CausalLM:
        dtype = dtype_from_name(self.dtype)
        blocks = LayerStack(lambda r: Mamba2Block(self.embed, self.ssm, norm_eps=self.norm_eps, rngs=r,
                                                  init_std=self.init_std, dtype=dtype, kernels=self.kernels),
                            self.layers, rngs=rngs, remat=self.remat)
        return CausalLM(vocab=self.vocab_size, embed=self.embed, stacks={"blocks": blocks}, norm_eps=self.norm_eps,
                        tie_embeddings=self.tie_embeddings, rngs=rngs, init_std=self.init_std, dtype=dtype)

    def param_count(self, include_embeddings: bool = True, active_only: bool = False) -> int:
        """Every parameter is active for every token (no experts): active_only changes nothing."""
        per_layer = self.ssm.param_count(self.embed) + self.embed
        emb = self.vocab_size * self.embed * (1 if self.tie_embeddings else 2)
        return self.layers * per_layer + self.embed + (emb if include_embeddings else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """6 x matmul parameters (projections + LM head) + the SSD scan (see
        SSMConfig.scan_flops_per_token); no term grows with seq_len."""
        matmul = self.layers * self.ssm.matmul_params(self.embed) + self.vocab_size * self.embed
        return 6.0 * matmul + self.layers * self.ssm.scan_flops_per_token()
