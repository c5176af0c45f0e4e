"""HF `LlamaForCausalLM` (model_type "llama") <-> models/llama.py.

HF linear weights are [out, in]; ours are [in, out] with heads split into (heads, head_dim).
HF stores q/k in the rotate-half layout our rope uses, so no permutation is needed.
"""
from __future__ import annotations

from jaxtrain.hf.config_fields import HFConfigFields
from jaxtrain.hf.mapping import Family, TensorMap
from jaxtrain.hf.rope_params import rope_from_hf, rope_to_hf
from jaxtrain.models.llama import LlamaConfig

LAYER = "model.layers.{layer}."
BLOCK = "stacks/blocks/layers/"

TENSORS = (
    TensorMap("embed/table", "model.embed_tokens.weight"),
    TensorMap("head/kernel", "lm_head.weight", "vocab embed -> embed vocab", optional=True),  # absent when tied
    TensorMap("final_norm/scale", "model.norm.weight"),
    TensorMap(BLOCK + "attn_norm/scale", LAYER + "input_layernorm.weight"),
    TensorMap(BLOCK + "mlp_norm/scale", LAYER + "post_attention_layernorm.weight"),
    TensorMap(BLOCK + "attn/q/kernel", LAYER + "self_attn.q_proj.weight", "(heads dim) embed -> embed heads dim"),
    TensorMap(BLOCK + "attn/k/kernel", LAYER + "self_attn.k_proj.weight", "(heads dim) embed -> embed heads dim"),
    TensorMap(BLOCK + "attn/v/kernel", LAYER + "self_attn.v_proj.weight", "(heads dim) embed -> embed heads dim"),
    TensorMap(BLOCK + "attn/o/kernel", LAYER + "self_attn.o_proj.weight", "embed (heads dim) -> heads dim embed"),
    TensorMap(BLOCK + "attn/q/bias", LAYER + "self_attn.q_proj.bias", "(heads dim) -> heads dim", optional=True),
    TensorMap(BLOCK + "attn/k/bias", LAYER + "self_attn.k_proj.bias", "(heads dim) -> heads dim", optional=True),
    TensorMap(BLOCK + "attn/v/bias", LAYER + "self_attn.v_proj.bias", "(heads dim) -> heads dim", optional=True),
    TensorMap(BLOCK + "attn/o/bias", LAYER + "self_attn.o_proj.bias", optional=True),
    TensorMap(BLOCK + "mlp/gate/kernel", LAYER + "mlp.gate_proj.weight", "mlp embed -> embed mlp"),
    TensorMap(BLOCK + "mlp/up/kernel", LAYER + "mlp.up_proj.weight", "mlp embed -> embed mlp"),
    TensorMap(BLOCK + "mlp/down/kernel", LAYER + "mlp.down_proj.weight", "embed mlp -> mlp embed"),
    TensorMap(BLOCK + "mlp/gate/bias", LAYER + "mlp.gate_proj.bias", optional=True),
    TensorMap(BLOCK + "mlp/up/bias", LAYER + "mlp.up_proj.bias", optional=True),
    TensorMap(BLOCK + "mlp/down/bias", LAYER + "mlp.down_proj.bias", optional=True),
)


def config_from_hf(raw: dict, where: str = "config.json") -> LlamaConfig:
    f = HFConfigFields(raw, where)
    f.expect("hidden_act", ["silu"], "silu")
    f.expect("attention_dropout", [0, 0.0], 0.0)
    heads = f.get("num_attention_heads")
    embed = f.get("hidden_size")
    theta, scaling = rope_from_hf(f)
    cfg = LlamaConfig(
        vocab_size=f.get("vocab_size"),
        embed=embed,
        layers=f.get("num_hidden_layers"),
        heads=heads,
        kv_heads=f.get("num_key_value_heads", heads),
        head_dim=f.get("head_dim", embed // heads),
        mlp=f.get("intermediate_size"),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=f.get("rms_norm_eps", 1e-6),
        tie_embeddings=f.get("tie_word_embeddings", False),
        attention_bias=f.get("attention_bias", False),
        mlp_bias=f.get("mlp_bias", False),
        init_std=f.get("initializer_range", 0.02),
    )
    f.check_all_understood("llama")
    return cfg


def config_to_hf(cfg: LlamaConfig) -> dict:
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.embed,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "intermediate_size": cfg.mlp,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": rope_to_hf(cfg.rope_theta, cfg.rope_scaling),
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
        "pretraining_tp": 1,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
    }


FAMILY = Family(
    model_type="llama",
    architecture="LlamaForCausalLM",
    config_class=LlamaConfig,
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    tensors=lambda cfg: TENSORS,
    ignored_hf_tensors=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",),  # old checkpoints' rope cache
)
