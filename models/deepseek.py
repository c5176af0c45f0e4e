"""The DeepSeek-V2 family: MLA attention, the first `first_k_dense` layers with a dense SwiGLU
MLP, the rest DeepSeekMoE (routed experts + shared experts).

Dense and MoE layers are two layer stacks (`dense_blocks`, `moe_blocks`), each scanned.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from flax import nnx

from jaxtrain.models.causal_lm import CausalLM, add_residual, layer_input
from jaxtrain.models.dtypes import dtype_from_name
from jaxtrain.models.family import FamilyConfig, model_family
from jaxtrain.models.layers.attention_impl import STRATEGIES as ATTENTION_STRATEGIES
from jaxtrain.models.layers.attention_impl import AutoAttention, check_attention
from jaxtrain.models.layers.mla import MultiHeadLatentAttention, mla_softmax_scale
from jaxtrain.models.layers.mlp import SwiGLU
from jaxtrain.models.layers.moe import MoEBlock
from jaxtrain.models.layers.norm import RMSNorm
from jaxtrain.models.layers.rope import SCALINGS, NoScaling, rope_attention_factor
from jaxtrain.models.layers.router import RouterConfig
from jaxtrain.models.layers.stack import LayerStack


# {target: (module path pattern (models/lora.py), the transformers module it adapts)}. "+" joins
# projections of one input that transformers fuses into one module; they share one A, as peft's
# adapter on the fused module does. Routed experts get one A/B pair per expert (peft's
# `target_parameters` on the stacked expert tensors).
ADAPTER_TARGETS = {
    "q": ("attn/q", "self_attn.q_proj"),
    "q_a": ("attn/q_down", "self_attn.q_a_proj"),
    "q_b": ("attn/q_up", "self_attn.q_b_proj"),
    "kv_a": ("attn/kv_down+k_rope", "self_attn.kv_a_proj_with_mqa"),
    "kv_b": ("attn/kv_up", "self_attn.kv_b_proj"),
    "o": ("attn/o", "self_attn.o_proj"),
    "gate": ("mlp/gate", "mlp.gate_proj"),
    "up": ("mlp/up", "mlp.up_proj"),
    "down": ("mlp/down", "mlp.down_proj"),
    "shared_gate": ("moe/shared/gate", "mlp.shared_experts.gate_proj"),
    "shared_up": ("moe/shared/up", "mlp.shared_experts.up_proj"),
    "shared_down": ("moe/shared/down", "mlp.shared_experts.down_proj"),
    "experts_gate_up": ("moe/experts/gate+up", "mlp.experts.gate_up_proj"),
    "experts_down": ("moe/experts/down", "mlp.experts.down_proj"),
}


@model_family("deepseek_v2", "MLA attention, dense prefix, DeepSeekMoE (routed + shared experts)",
              parts=(RouterConfig, *SCALINGS, *ATTENTION_STRATEGIES), hf_adapter="jaxtrain.hf.families.deepseek_v2",
              adapter_targets={name: pattern for name, (pattern, _) in ADAPTER_TARGETS.items()})
@dataclasses.dataclass(frozen=True)
class DeepSeekConfig(FamilyConfig):
    vocab_size: int = 512
    embed: int = 64
    layers: int = 4
    first_k_dense: int = 1  # HF first_k_dense_replace
    heads: int = 4
    q_lora_rank: int | None = None  # None: queries projected directly (DeepSeek-V2-Lite)
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    mlp: int = 128  # dense layers' intermediate size
    expert_mlp: int = 32  # each routed expert's intermediate size (HF moe_intermediate_size)
    shared_experts: int = 1  # the shared expert is one SwiGLU of width shared_experts * expert_mlp
    router: RouterConfig = RouterConfig(num_experts=8, top_k=2)
    rope_theta: float = 10000.0
    rope_scaling: object = NoScaling()
    norm_eps: float = 1e-6
    latent_norm_eps: float = 1e-6  # MLA's q/kv latent norms (transformers fixes 1e-6 there)
    tie_embeddings: bool = False
    attention_bias: bool = False
    init_std: float = 0.02
    dtype: str = "float32"
    remat: str = "none"
    kernels: str = "xla"  # MoE routing / grouped matmul: auto | pallas | xla
    attention: object = AutoAttention()  # models/layers/attention_impl.py

    @property
    def moe_layers(self) -> int:
        return self.layers - self.first_k_dense

    def validate(self, mesh_sizes: Mapping[str, int]) -> None:
        """Semantic checks; divisibility by the mesh is checked per parameter by the rule tables."""
        if not 0 <= self.first_k_dense <= self.layers:
            raise ValueError(f"DeepSeekConfig.first_k_dense={self.first_k_dense} must be in [0, layers={self.layers}]")
        self.router.validate()
        check_attention(self.attention, "DeepSeekConfig")

    def build(self, rngs: nnx.Rngs) -> CausalLM:
        stacks = {}
        if self.first_k_dense:
            stacks["dense_blocks"] = LayerStack(lambda r: DeepSeekBlock(self, moe=False, rngs=r), self.first_k_dense,
                                                rngs=rngs, remat=self.remat)
        if self.moe_layers:
            stacks["moe_blocks"] = LayerStack(lambda r: DeepSeekBlock(self, moe=True, rngs=r), self.moe_layers,
                                              rngs=rngs, remat=self.remat)
        return CausalLM(vocab=self.vocab_size, embed=self.embed, stacks=stacks, norm_eps=self.norm_eps,
                        tie_embeddings=self.tie_embeddings, rngs=rngs, init_std=self.init_std,
                        dtype=dtype_from_name(self.dtype))

    # -- sizes -------------------------------------------------------------------------------
    def _attention_params(self) -> int:
        d, h = self.embed, self.heads
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = d * h * qk if self.q_lora_rank is None else d * self.q_lora_rank + self.q_lora_rank * (h * qk + 1)
        kv = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * (
            h * (self.qk_nope_head_dim + self.v_head_dim) + 1)
        return q + kv + h * self.v_head_dim * d

    def param_count(self, include_embeddings: bool = True, active_only: bool = False) -> int:
        d, e = self.embed, self.router.num_experts
        experts = (self.router.top_k if active_only else e) * 3 * d * self.expert_mlp
        moe = d * e + experts + 3 * d * self.shared_experts * self.expert_mlp
        per_layer = self._attention_params() + 2 * d
        total = self.layers * per_layer + self.first_k_dense * 3 * d * self.mlp + self.moe_layers * moe + d
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return total + (emb if include_embeddings else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """6 x active matmul parameters + causal attention (qk and v head dims)."""
        active = self.param_count(include_embeddings=False, active_only=True) + self.vocab_size * self.embed
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        attention = 3 * self.layers * self.heads * (qk + self.v_head_dim) * seq_len
        return 6 * active + attention


class DeepSeekBlock(nnx.Module):
    """Pre-norm MLA attention, then either a dense SwiGLU (`mlp`) or DeepSeekMoE (`moe`)."""

    def __init__(self, cfg: DeepSeekConfig, *, moe: bool, rngs: nnx.Rngs):
        dtype = dtype_from_name(cfg.dtype)
        kw = dict(rngs=rngs, init_std=cfg.init_std, dtype=dtype)
        qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        self.attn_norm = RMSNorm(cfg.embed, rngs=rngs, eps=cfg.norm_eps)
        self.attn = MultiHeadLatentAttention(
            cfg.embed, cfg.heads, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
            inv_freq=cfg.rope_scaling.inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta),
            softmax_scale=mla_softmax_scale(qk_head_dim, cfg.rope_scaling),
            rope_attention_factor=rope_attention_factor(cfg.rope_scaling), norm_eps=cfg.latent_norm_eps,
            use_bias=cfg.attention_bias, attention=cfg.attention, **kw)
        self.mlp_norm = RMSNorm(cfg.embed, rngs=rngs, eps=cfg.norm_eps)
        if moe:
            shared = SwiGLU(cfg.embed, cfg.shared_experts * cfg.expert_mlp, **kw) if cfg.shared_experts else None
            self.moe = MoEBlock(cfg.embed, router=cfg.router, expert_hidden=cfg.expert_mlp, shared=shared,
                                kernels=cfg.kernels, **kw)
            self.mlp = None
        else:
            self.mlp = SwiGLU(cfg.embed, cfg.mlp, **kw)
            self.moe = None

    def __call__(self, x, positions, segment_ids):
        x = add_residual(x, self.attn(layer_input(self.attn_norm(x)), positions, segment_ids))
        return self._feed_forward(x)

    def _feed_forward(self, x):
        h = layer_input(self.mlp_norm(x))
        if self.moe is None:
            return add_residual(x, self.mlp(h)), {}
        y, stats = self.moe(h)  # decode routes its b x 1 tokens as training routes b x l
        return add_residual(x, y), {"moe": stats}

    # -- generation (models/layers/decode_cache.py): the attention's latent cache is the block's --
    def init_cache(self, batch: int, max_len: int, dtype):
        return self.attn.init_cache(batch, max_len, dtype)

    def prefill(self, x, positions, segment_ids, cache):
        attended, cache = self.attn.prefill(layer_input(self.attn_norm(x)), positions, segment_ids, cache)
        return self._feed_forward(add_residual(x, attended))[0], cache

    def decode(self, x, positions, cache, index, valid_from):
        attended, cache = self.attn.decode(layer_input(self.attn_norm(x)), positions, cache, index, valid_from)
        return self._feed_forward(add_residual(x, attended))[0], cache
