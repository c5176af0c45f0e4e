"""HF `Mamba2ForCausalLM` (model_type "mamba2") <-> models/mamba2.py."""
from __future__ import annotations

from jaxtrain.hf.config_fields import HFConfigFields
from jaxtrain.hf.errors import HFConfigError
from jaxtrain.hf.families.mamba2_mixer_maps import mixer_maps, time_step_limit, time_step_limit_to_hf
from jaxtrain.hf.mapping import Family, TensorMap
from jaxtrain.models.layers.mamba2 import SSMConfig
from jaxtrain.models.mamba2 import Mamba2Config

LAYER = "backbone.layers.{layer}."
BLOCK = "stacks/blocks/layers/"

# Read by transformers only to initialize weights or to cache at inference, or never read (mamba_ssm's
# dt-init settings): no effect on the math. norm_before_gate: transformers' Mamba-2 always gates, then
# normalizes (its kernels get norm_before_gate=False), while transformers 4.44-4.4x wrote its default
# True into every config (Mamba-Codestral's included), so the field says nothing about a checkpoint.
_NO_MATH = ("time_step_rank", "rescale_prenorm_residual", "time_step_init_scheme", "time_step_scale",
            "norm_before_gate")


def tensors(cfg: Mamba2Config) -> list[TensorMap]:
    return [
        TensorMap("embed/table", "backbone.embeddings.weight"),
        TensorMap("head/kernel", "lm_head.weight", "vocab embed -> embed vocab", optional=True),  # absent when tied
        TensorMap("final_norm/scale", "backbone.norm_f.weight"),
        TensorMap(BLOCK + "norm/scale", LAYER + "norm.weight"),
        *mixer_maps(BLOCK + "mixer/", LAYER + "mixer.", cfg.ssm),
    ]


def config_from_hf(raw: dict, where: str = "config.json") -> Mamba2Config:
    f = HFConfigFields(raw, where)
    f.expect("hidden_act", ["silu"], "silu")
    embed = f.get("hidden_size")
    heads, head_dim = f.get("num_heads"), f.get("head_dim")
    expand = f.get("expand", 2)
    if expand * embed != heads * head_dim:
        raise HFConfigError(f"{where}: expand * hidden_size = {expand * embed} must equal num_heads * head_dim = "
                            f"{heads * head_dim}")
    inner = f.get("intermediate_size", expand * embed)  # older configs state it; transformers derives it
    if inner != expand * embed:
        raise HFConfigError(f"{where}: intermediate_size={inner} must equal expand * hidden_size = {expand * embed}")
    lo = f.get("time_step_min", 0.001)
    ssm = SSMConfig(
        heads=heads, head_dim=head_dim, state=f.get("state_size"), groups=f.get("n_groups", 8),
        conv_kernel=f.get("conv_kernel", 4), chunk_size=f.get("chunk_size", 256),
        time_step_limit=time_step_limit(f), conv_bias=f.get("use_conv_bias", True), proj_bias=f.get("use_bias", False),
        dt_init_range=(lo, f.get("time_step_max", 0.1)), dt_init_floor=f.get("time_step_floor", 1e-4))
    # residual_in_fp32: keeps HF's residual stream in float32 under bf16; our residual stream
    # is the compute dtype. Identical in float32, so read but not translated.
    f.get("residual_in_fp32", True)
    for name in _NO_MATH:
        f.get(name, None)
    cfg = Mamba2Config(
        vocab_size=f.get("vocab_size"), embed=embed, layers=f.get("num_hidden_layers"), ssm=ssm,
        norm_eps=f.get("layer_norm_epsilon", 1e-5), tie_embeddings=f.get("tie_word_embeddings", False),
        init_std=f.get("initializer_range", 0.1))
    f.check_all_understood("mamba2")
    return cfg


def config_to_hf(cfg: Mamba2Config) -> dict:
    s = cfg.ssm
    if s.inner % cfg.embed:
        raise HFConfigError(f"HF Mamba2 needs ssm.heads * ssm.head_dim = {s.inner} to be a multiple (expand) of "
                            f"embed = {cfg.embed}")
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.embed, "num_hidden_layers": cfg.layers,
        "num_heads": s.heads, "head_dim": s.head_dim, "state_size": s.state, "n_groups": s.groups,
        "expand": s.inner // cfg.embed, "conv_kernel": s.conv_kernel, "chunk_size": s.chunk_size,
        "use_conv_bias": s.conv_bias, "use_bias": s.proj_bias, "hidden_act": "silu",
        "time_step_limit": time_step_limit_to_hf(s.time_step_limit),
        "time_step_min": s.dt_init_range[0], "time_step_max": s.dt_init_range[1], "time_step_floor": s.dt_init_floor,
        "layer_norm_epsilon": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "residual_in_fp32": False, "initializer_range": cfg.init_std,
    }


FAMILY = Family(
    model_type="mamba2",
    architecture="Mamba2ForCausalLM",
    config_class=Mamba2Config,
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    tensors=tensors,
)
