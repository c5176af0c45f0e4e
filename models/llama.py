"""The Llama family: pre-norm blocks of grouped-query attention and a SwiGLU MLP."""
from __future__ import annotations

import dataclasses
from typing import Mapping

from flax import nnx

from jaxtrain.models.causal_lm import CausalLM, add_residual, layer_input
from jaxtrain.models.dtypes import dtype_from_name
from jaxtrain.models.family import FamilyConfig, model_family
from jaxtrain.models.layers.attention import GroupedQueryAttention
from jaxtrain.models.layers.attention_impl import STRATEGIES as ATTENTION_STRATEGIES
from jaxtrain.models.layers.attention_impl import AutoAttention, check_attention
from jaxtrain.models.layers.mlp import SwiGLU
from jaxtrain.models.layers.norm import RMSNorm
from jaxtrain.models.layers.rope import SCALINGS, NoScaling
from jaxtrain.models.layers.stack import LayerStack


@model_family("llama", "pre-norm grouped-query attention + SwiGLU, RoPE",
              parts=(*SCALINGS, *ATTENTION_STRATEGIES), hf_adapter="jaxtrain.hf.families.llama",
              adapter_targets={"q": "attn/q", "k": "attn/k", "v": "attn/v", "o": "attn/o",
                               "gate": "mlp/gate", "up": "mlp/up", "down": "mlp/down"})
@dataclasses.dataclass(frozen=True)
class LlamaConfig(FamilyConfig):
    vocab_size: int = 512
    embed: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    head_dim: int | None = None  # defaults to embed // heads
    mlp: int = 768
    rope_theta: float = 10000.0
    rope_scaling: object = NoScaling()
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    init_std: float = 0.02
    dtype: str = "float32"  # compute dtype; parameters stay float32
    remat: str = "none"
    attention: object = AutoAttention()  # models/layers/attention_impl.py

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.embed // self.heads

    def validate(self, mesh_sizes: Mapping[str, int]) -> None:
        """Errors for a model that makes no sense, before anything is built. Whether its
        dimensions divide the mesh is the rule tables' check over every parameter
        (meshes/rules.py, run when the state's shardings are built)."""
        for name in ("vocab_size", "embed", "layers", "heads", "kv_heads", "mlp"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name} must be positive, got {getattr(self, name)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"LlamaConfig.heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if self.resolved_head_dim % 2:
            raise ValueError(f"LlamaConfig head_dim={self.resolved_head_dim} must be even (rotary dims come in pairs)")
        check_attention(self.attention, "LlamaConfig")

    def build(self, rngs: nnx.Rngs) -> CausalLM:
        return build_llama(self, rngs)

    def param_count(self, include_embeddings: bool = True, active_only: bool = False) -> int:
        """Every parameter is active for every token (no experts): active_only changes nothing."""
        d, hd = self.embed, self.resolved_head_dim
        attn = d * hd * (2 * self.heads + 2 * self.kv_heads)
        per_layer = attn + 3 * d * self.mlp + 2 * d
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.layers * per_layer + d + (emb if include_embeddings else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x matmul params + causal attention scores and values."""
        matmul_params = self.param_count(include_embeddings=False) + self.vocab_size * self.embed
        attention = 6 * self.layers * self.heads * self.resolved_head_dim * seq_len  # 12·l·h·d·s/2 (causal)
        return 6 * matmul_params + attention


class LlamaBlock(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        dtype = dtype_from_name(cfg.dtype)
        self.attn_norm = RMSNorm(cfg.embed, rngs=rngs, eps=cfg.norm_eps)
        self.attn = GroupedQueryAttention(
            cfg.embed, cfg.heads, cfg.kv_heads, cfg.resolved_head_dim,
            inv_freq=cfg.rope_scaling.inv_freq(cfg.resolved_head_dim, cfg.rope_theta),
            rngs=rngs, use_bias=cfg.attention_bias, init_std=cfg.init_std, dtype=dtype, attention=cfg.attention)
        self.mlp_norm = RMSNorm(cfg.embed, rngs=rngs, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg.embed, cfg.mlp, rngs=rngs, use_bias=cfg.mlp_bias, init_std=cfg.init_std, dtype=dtype)

    def __call__(self, x, positions, segment_ids):
        x = add_residual(x, self.attn(layer_input(self.attn_norm(x)), positions, segment_ids))
        x = add_residual(x, self.mlp(layer_input(self.mlp_norm(x))))
        return x, {}

    # Generation (models/layers/decode_cache.py): the same block, attention through its cache.
    def init_cache(self, batch: int, max_len: int, dtype):
        return self.attn.init_cache(batch, max_len, dtype)

    def prefill(self, x, positions, segment_ids, cache):
        update, cache = self.attn.prefill(layer_input(self.attn_norm(x)), positions, segment_ids, cache)
        x = add_residual(x, update)
        return add_residual(x, self.mlp(layer_input(self.mlp_norm(x)))), cache

    def decode(self, x, positions, cache, index, valid_from):
        update, cache = self.attn.decode(layer_input(self.attn_norm(x)), positions, cache, index, valid_from)
        x = add_residual(x, update)
        return add_residual(x, self.mlp(layer_input(self.mlp_norm(x)))), cache


def build_llama(cfg: LlamaConfig, rngs: nnx.Rngs) -> CausalLM:
    blocks = LayerStack(lambda r: LlamaBlock(cfg, rngs=r), cfg.layers, rngs=rngs, remat=cfg.remat)
    return CausalLM(vocab=cfg.vocab_size, embed=cfg.embed, stacks={"blocks": blocks},
                    norm_eps=cfg.norm_eps, tie_embeddings=cfg.tie_embeddings, rngs=rngs,
                    init_std=cfg.init_std, dtype=dtype_from_name(cfg.dtype))
