"""The Nemotron-H hybrid family (Nemotron-3-Nano is its reference shape): a per-layer pattern of
pre-norm blocks of four kinds (HF `layers_block_type`):

  mamba      Mamba-2 mixer (models/layers/mamba2.py)
  attention  grouped-query attention without rotary embedding (position comes from the Mamba layers)
  mlp        non-gated MLP, squared ReLU
  moe        sigmoid router with a score-correction bias, non-gated squared-ReLU experts, one shared
             expert of its own width, an optional latent projection around the routed experts

All layers sit in one PatternStack (`stacks/blocks/<kind>/layers/...`).
"""
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
from jaxtrain.models.layers.mamba2 import SSMConfig
from jaxtrain.models.layers.mlp import PlainMLP
from jaxtrain.models.layers.moe import MoEBlock
from jaxtrain.models.layers.norm import RMSNorm
from jaxtrain.models.layers.pattern_stack import PatternStack
from jaxtrain.models.layers.router import RouterConfig
from jaxtrain.models.mamba2 import Mamba2Block

KINDS = ("mamba", "attention", "mlp", "moe")


# {target: (module path pattern (models/lora.py), the transformers module it adapts, within a
# layer's `mixer`)}. "+" joins projections transformers fuses into one (Mamba-2's in_proj rows are
# [z | x | B | C | dt]); they share one A, as peft's adapter on the fused module does. Routed experts
# get one A/B pair per expert (peft's `target_parameters` on the stacked expert tensors).
ADAPTER_TARGETS = {
    "in_proj": ("mixer/in_z+in_x+in_b+in_c+in_dt", "mixer.in_proj"),
    "out_proj": ("mixer/out", "mixer.out_proj"),
    "q": ("attn/q", "mixer.q_proj"),
    "k": ("attn/k", "mixer.k_proj"),
    "v": ("attn/v", "mixer.v_proj"),
    "o": ("attn/o", "mixer.o_proj"),
    "up": ("mlp/up", "mixer.up_proj"),
    "down": ("mlp/down", "mixer.down_proj"),
    "shared_up": ("moe/shared/up", "mixer.shared_experts.up_proj"),
    "shared_down": ("moe/shared/down", "mixer.shared_experts.down_proj"),
    "latent_down": ("moe/latent_down", "mixer.fc1_latent_proj"),
    "latent_up": ("moe/latent_up", "mixer.fc2_latent_proj"),
    "experts_up": ("moe/experts/up", "mixer.experts.up_proj"),
    "experts_down": ("moe/experts/down", "mixer.experts.down_proj"),
}


@model_family("nemotron_h", "hybrid pattern of Mamba-2, attention, MLP and MoE blocks",
              parts=(RouterConfig, SSMConfig, *ATTENTION_STRATEGIES), hf_adapter="jaxtrain.hf.families.nemotron_h",
              adapter_targets={name: pattern for name, (pattern, _) in ADAPTER_TARGETS.items()})
@dataclasses.dataclass(frozen=True)
class NemotronHConfig(FamilyConfig):
    vocab_size: int = 512
    embed: int = 64
    pattern: tuple = ("mamba", "moe", "attention", "mlp")  # one kind per layer, in order
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    mlp: int = 128  # width of the `mlp` layers (HF intermediate_size)
    mlp_activation: str = "relu2"  # MLPs, routed and shared experts (HF mlp_hidden_act)
    mlp_bias: bool = False  # MLPs, shared expert and latent projections (HF mlp_bias)
    ssm: SSMConfig = SSMConfig(heads=8, head_dim=16, state=16, groups=2, chunk_size=16)
    expert_mlp: int = 32  # each routed expert's width (HF moe_intermediate_size)
    shared_expert_mlp: int = 64  # the shared expert's width; 0: none (HF moe_shared_expert_intermediate_size)
    moe_latent: int | None = None  # routed experts work in this latent width (HF moe_latent_size)
    router: RouterConfig = RouterConfig(num_experts=8, top_k=2, score_fn="sigmoid", correction_bias=True,
                                        norm_topk_prob=True)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    dtype: str = "float32"
    remat: str = "none"
    kernels: str = "xla"  # SSD scan, causal conv, MoE routing, grouped matmul: auto | pallas | xla
    attention: object = AutoAttention()  # models/layers/attention_impl.py

    def count(self, kind: str) -> int:
        return sum(1 for k in self.pattern if k == kind)

    def validate(self, mesh_sizes: Mapping[str, int]) -> None:
        """Semantic checks; divisibility by the mesh is checked per parameter by the rule tables."""
        unknown = sorted(set(self.pattern) - set(KINDS))
        if not self.pattern or unknown:
            raise ValueError(f"NemotronHConfig.pattern must list layer kinds from {KINDS}, got unknown {unknown}"
                             if unknown else "NemotronHConfig.pattern is empty")
        for name in ("vocab_size", "embed", "heads", "kv_heads", "head_dim", "mlp", "expert_mlp"):
            if getattr(self, name) < 1:
                raise ValueError(f"NemotronHConfig.{name} must be positive, got {getattr(self, name)}")
        if self.count("attention") and self.heads % self.kv_heads:
            raise ValueError(f"NemotronHConfig.heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if self.count("mamba"):
            self.ssm.validate("NemotronHConfig")
        self.router.validate()
        check_attention(self.attention, "NemotronHConfig")

    def build(self, rngs: nnx.Rngs) -> CausalLM:
        dtype = dtype_from_name(self.dtype)
        kw = dict(init_std=self.init_std, dtype=dtype)
        makers = {
            "mamba": lambda r: Mamba2Block(self.embed, self.ssm, norm_eps=self.norm_eps, rngs=r,
                                           kernels=self.kernels, **kw),
            "attention": lambda r: AttentionLayer(self, rngs=r),
            "mlp": lambda r: MLPLayer(self, rngs=r),
            "moe": lambda r: MoELayer(self, rngs=r),
        }
        blocks = PatternStack(self.pattern, makers, rngs=rngs, remat=self.remat)
        return CausalLM(vocab=self.vocab_size, embed=self.embed, stacks={"blocks": blocks}, norm_eps=self.norm_eps,
                        tie_embeddings=self.tie_embeddings, rngs=rngs, **kw)

    # -- sizes -------------------------------------------------------------------------------
    def _layer_params(self, kind: str, active_only: bool) -> int:
        d = self.embed
        mlp_bias = lambda width: (width + d) if self.mlp_bias else 0
        if kind == "mamba":
            return self.ssm.param_count(d)
        if kind == "attention":
            return d * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        if kind == "mlp":
            return 2 * d * self.mlp + mlp_bias(self.mlp)
        e = self.router.num_experts
        inner = self.moe_latent or d
        experts = (self.router.top_k if active_only else e) * 2 * inner * self.expert_mlp
        router = d * e + (e if self.router.correction_bias else 0)
        shared = 2 * d * self.shared_expert_mlp + mlp_bias(self.shared_expert_mlp) if self.shared_expert_mlp else 0
        latent = 2 * d * self.moe_latent + mlp_bias(self.moe_latent) if self.moe_latent else 0
        return router + experts + shared + latent

    def param_count(self, include_embeddings: bool = True, active_only: bool = False) -> int:
        layers = sum(self._layer_params(kind, active_only) + self.embed for kind in self.pattern)
        emb = self.vocab_size * self.embed * (1 if self.tie_embeddings else 2)
        return layers + self.embed + (emb if include_embeddings else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """6 x active matmul parameters (+ LM head), causal attention in the attention layers, and
        the SSD scan in the Mamba layers (SSMConfig.scan_flops_per_token)."""
        active = self.param_count(include_embeddings=False, active_only=True) + self.vocab_size * self.embed
        attention = 6 * self.count("attention") * self.heads * self.head_dim * seq_len
        return 6.0 * active + attention + self.count("mamba") * self.ssm.scan_flops_per_token()


class Cacheless:
    """Generation for a layer that keeps nothing between tokens (MLP, MoE): its training forward on
    the prompt, then on each new token; the aux outputs (MoE routing statistics) are dropped."""

    def init_cache(self, batch: int, max_len: int, dtype):
        return {}

    def prefill(self, x, positions, segment_ids, cache):
        return self(x, positions, segment_ids)[0], cache

    def decode(self, x, positions, cache, index, valid_from):
        return self(x, positions, None)[0], cache


class AttentionLayer(nnx.Module):
    def __init__(self, cfg: NemotronHConfig, *, rngs: nnx.Rngs):
        self.norm = RMSNorm(cfg.embed, rngs=rngs, eps=cfg.norm_eps)
        self.attn = GroupedQueryAttention(cfg.embed, cfg.heads, cfg.kv_heads, cfg.head_dim, inv_freq=None, rngs=rngs,
                                          init_std=cfg.init_std, dtype=dtype_from_name(cfg.dtype),
                                          attention=cfg.attention)

    def __call__(self, x, positions, segment_ids):
        return add_residual(x, self.attn(layer_input(self.norm(x)), positions, segment_ids)), {}

    def init_cache(self, batch: int, max_len: int, dtype):
        return self.attn.init_cache(batch, max_len, dtype)

    def prefill(self, x, positions, segment_ids, cache):
        update, cache = self.attn.prefill(layer_input(self.norm(x)), positions, segment_ids, cache)
        return add_residual(x, update), cache

    def decode(self, x, positions, cache, index, valid_from):
        update, cache = self.attn.decode(layer_input(self.norm(x)), positions, cache, index, valid_from)
        return add_residual(x, update), cache


class MLPLayer(Cacheless, nnx.Module):
    def __init__(self, cfg: NemotronHConfig, *, rngs: nnx.Rngs):
        self.norm = RMSNorm(cfg.embed, rngs=rngs, eps=cfg.norm_eps)
        self.mlp = PlainMLP(cfg.embed, cfg.mlp, rngs=rngs, activation=cfg.mlp_activation, use_bias=cfg.mlp_bias,
                            init_std=cfg.init_std, dtype=dtype_from_name(cfg.dtype))

    def __call__(self, x, positions, segment_ids):
        return add_residual(x, self.mlp(layer_input(self.norm(x)))), {}


class MoELayer(Cacheless, nnx.Module):
    def __init__(self, cfg: NemotronHConfig, *, rngs: nnx.Rngs):
        kw = dict(rngs=rngs, init_std=cfg.init_std, dtype=dtype_from_name(cfg.dtype))
        self.norm = RMSNorm(cfg.embed, rngs=rngs, eps=cfg.norm_eps)
        shared = PlainMLP(cfg.embed, cfg.shared_expert_mlp, activation=cfg.mlp_activation, use_bias=cfg.mlp_bias,
                          **kw) if cfg.shared_expert_mlp else None
        self.moe = MoEBlock(cfg.embed, router=cfg.router, expert_hidden=cfg.expert_mlp, gated=False,
                            activation=cfg.mlp_activation, shared=shared, latent_dim=cfg.moe_latent,
                            latent_bias=cfg.mlp_bias, kernels=cfg.kernels, **kw)

    def __call__(self, x, positions, segment_ids):
        y, stats = self.moe(layer_input(self.norm(x)))
        return add_residual(x, y), {"moe": stats}
