"""HF `NemotronHForCausalLM` (model_type "nemotron_h") <-> models/nemotron_h.py.

What transformers (5.25 and later: the version pyproject.toml pins) actually computes, which this
mapping follows where the config says otherwise:
* the Mamba mixer clamps dt to `time_step_limit` (`time_step_min` only initializes dt's bias);
  transformers before 5.25 clamped to [time_step_min, inf) instead and ignored `time_step_limit`;
* attention has no rotary embedding and no biases (`attention_bias`, `rope_theta` are not read);
* every MoE layer has exactly one shared expert of width moe_shared_expert_intermediate_size
  (`n_shared_experts` is not read), and the router always has its score-correction bias;
* `mlp_bias` reaches the MLPs, the shared expert and the latent projections, never the experts.
Configs written by NVIDIA's remote code name some fields differently (`mamba_d_conv`,
`attention_head_dim`, ...; LEGACY_NAMES): they are read as today's names, an error if both disagree.
`sliding_window` must be null (transformers ignores it; a set value means the checkpoint was not
trained with the full attention we compute). On disk `save_pretrained` writes `backbone.` names and one tensor per expert
(`experts.{e}.up_proj.weight`), which is what is read and written here.
"""
from __future__ import annotations


from jaxtrain.hf.config_fields import HFConfigFields, decode_float
from jaxtrain.hf.errors import HFConfigError
from jaxtrain.hf.families.mamba2_mixer_maps import mixer_maps, time_step_limit, time_step_limit_to_hf
from jaxtrain.hf.mapping import Family, TensorMap
from jaxtrain.models.layers.mamba2 import SSMConfig
from jaxtrain.models.layers.router import RouterConfig
from jaxtrain.models.nemotron_h import NemotronHConfig

# HF layer type -> our kind; transformers 4 names (and the one-letter hybrid_override_pattern) too.
HF_KINDS = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention", "attention": "attention",
            "mlp": "mlp", "moe": "moe"}
PATTERN_LETTERS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
OUR_TO_HF = {"mamba": "linear_attention", "attention": "full_attention", "mlp": "mlp", "moe": "moe"}
ACTIVATIONS = ("relu2", "silu")  # HF names whose math ours matches exactly (HF "gelu" is the erf form)

# Read by transformers only to initialize weights, to cache or to schedule, or legacy duplicates
# it never reads: they do not change the math. MTP layers are not run by transformers' forward
# and their tensors are skipped (see ignored_hf_tensors).
_NO_MATH = ("time_step_max", "time_step_floor", "rescale_prenorm_residual", "use_mamba_kernels",
            "mamba_ssm_cache_dtype", "num_logits_to_keep", "output_router_logits", "moe_shared_expert_overlap",
            "n_shared_experts", "residual_in_fp32", "mamba_proj_bias", "attention_bias",
            "rope_theta", "rope_parameters", "rope_scaling", "partial_rotary_factor", "norm_eps", "expand",
            "num_hidden_layers", "num_nextn_predict_layers", "mtp_layers_block_type",
            "mtp_hybrid_override_pattern")
# The names NVIDIA's remote-code config took (transformers 5 renames them on load) -> today's. Its
# attention_head_dim is the attention head size (transformers 5 reads only head_dim).
LEGACY_NAMES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
                "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max", "mamba_dt_limit": "time_step_limit",
                "mamba_dt_init_floor": "time_step_floor", "mamba_conv_bias": "use_conv_bias",
                "mamba_chunk_size": "chunk_size", "attention_head_dim": "head_dim"}

LAYER = "backbone.layers.{layer}."


def _kind_maps(kind: str, cfg: NemotronHConfig, indices: tuple[int, ...]) -> list[TensorMap]:
    ours = f"stacks/blocks/{kind}/layers/"
    at = {"layer": indices}
    tm = lambda o, n, pattern="", **kw: TensorMap(ours + o, LAYER + n, pattern, hf_indices=at, **kw)
    maps = [tm("norm/scale", "norm.weight")]
    if kind == "mamba":
        return maps + mixer_maps(ours + "mixer/", LAYER + "mixer.", cfg.ssm, indices)
    if kind == "attention":
        return maps + [
            tm("attn/q/kernel", "mixer.q_proj.weight", "(heads dim) embed -> embed heads dim"),
            tm("attn/k/kernel", "mixer.k_proj.weight", "(heads dim) embed -> embed heads dim"),
            tm("attn/v/kernel", "mixer.v_proj.weight", "(heads dim) embed -> embed heads dim"),
            tm("attn/o/kernel", "mixer.o_proj.weight", "embed (heads dim) -> heads dim embed"),
        ]
    if kind == "mlp":
        return maps + _plain_mlp(tm, "mlp/", "mixer.")
    return maps + [
        tm("moe/router/kernel", "mixer.gate.weight", "experts embed -> embed experts"),
        tm("moe/router/correction_bias", "mixer.gate.e_score_correction_bias"),
        tm("moe/experts/up", "mixer.experts.{expert}.up_proj.weight", "mlp embed -> embed mlp"),
        tm("moe/experts/down", "mixer.experts.{expert}.down_proj.weight", "embed mlp -> mlp embed"),
        *_plain_mlp(tm, "moe/shared/", "mixer.shared_experts."),
        tm("moe/latent_down/kernel", "mixer.fc1_latent_proj.weight", "latent embed -> embed latent", optional=True),
        tm("moe/latent_down/bias", "mixer.fc1_latent_proj.bias", optional=True),
        tm("moe/latent_up/kernel", "mixer.fc2_latent_proj.weight", "embed latent -> latent embed", optional=True),
        tm("moe/latent_up/bias", "mixer.fc2_latent_proj.bias", optional=True),
    ]


def _plain_mlp(tm, ours: str, hf: str) -> list[TensorMap]:
    return [tm(ours + "up/kernel", hf + "up_proj.weight", "mlp embed -> embed mlp"),
            tm(ours + "down/kernel", hf + "down_proj.weight", "embed mlp -> mlp embed"),
            tm(ours + "up/bias", hf + "up_proj.bias", optional=True),
            tm(ours + "down/bias", hf + "down_proj.bias", optional=True)]


def tensors(cfg: NemotronHConfig) -> list[TensorMap]:
    maps = [TensorMap("embed/table", "backbone.embeddings.weight"),
            TensorMap("head/kernel", "lm_head.weight", "vocab embed -> embed vocab"),
            TensorMap("final_norm/scale", "backbone.norm_f.weight")]
    for kind in dict.fromkeys(cfg.pattern):
        maps += _kind_maps(kind, cfg, tuple(j for j, k in enumerate(cfg.pattern) if k == kind))
    return maps


def _pattern(f: HFConfigFields) -> tuple[str, ...]:
    types = f.get("layers_block_type", None)
    legacy = f.get("hybrid_override_pattern", None)
    if types is None and legacy is None:
        raise HFConfigError(f"{f.where}: neither layers_block_type nor hybrid_override_pattern is set")
    if types is None:
        bad = sorted(set(legacy) - set(PATTERN_LETTERS))
        if bad:
            raise HFConfigError(f"{f.where}: hybrid_override_pattern has unknown letters {bad} "
                                f"(known: {sorted(PATTERN_LETTERS)})")
        return tuple(PATTERN_LETTERS[c] for c in legacy)
    bad = sorted(set(types) - set(HF_KINDS))
    if bad:
        raise HFConfigError(f"{f.where}: layers_block_type has unsupported types {bad} (supported: {sorted(HF_KINDS)})")
    return tuple(HF_KINDS[t] for t in types)


def _with_current_names(raw: dict, where: str) -> dict:
    out = dict(raw)
    for old, new in LEGACY_NAMES.items():
        value = out.pop(old, None)
        if value is None:
            continue
        if out.get(new) is not None and out[new] != value:
            raise HFConfigError(f"{where}: {old}={value!r} and {new}={out[new]!r} disagree (both name one setting)")
        out[new] = value
    return out


def config_from_hf(raw: dict, where: str = "config.json") -> NemotronHConfig:
    f = HFConfigFields(_with_current_names(raw, where), where)
    f.expect("mamba_hidden_act", ["silu"], "silu")
    f.expect("tie_word_embeddings", [False], False)  # NemotronHForCausalLM never ties its head
    f.expect("attention_dropout", [0, 0.0], 0.0)
    f.expect("hidden_dropout", [0, 0.0], 0.0)
    activation = f.expect("mlp_hidden_act", ACTIVATIONS, "relu2")
    embed = f.get("hidden_size")
    heads = f.get("num_attention_heads", 32)
    dt_min = float(decode_float(f.get("time_step_min", 0.001)))
    limit = time_step_limit(f)
    ssm = SSMConfig(
        heads=f.get("mamba_num_heads", 128), head_dim=f.get("mamba_head_dim", 64), state=f.get("ssm_state_size", 128),
        groups=f.get("n_groups", 8), conv_kernel=f.get("conv_kernel", 4), chunk_size=f.get("chunk_size", 128),
        time_step_limit=limit,
        conv_bias=f.get("use_conv_bias", True), proj_bias=f.get("use_bias", False),
        dt_init_range=(dt_min, f.get("time_step_max", 0.1)), dt_init_floor=f.get("time_step_floor", 1e-4))
    latent = f.get("moe_latent_size", None)
    router = RouterConfig(
        num_experts=f.get("n_routed_experts", 8), top_k=f.get("num_experts_per_tok", 2), score_fn="sigmoid",
        n_group=f.get("n_group", 1), topk_group=f.get("topk_group", 1), norm_topk_prob=f.get("norm_topk_prob", True),
        routed_scaling_factor=float(f.get("routed_scaling_factor", 1.0)), correction_bias=True,
        bias_update_rate=0.0)  # keep the imported bias fixed; bind RouterConfig.bias_update_rate to train it
    for name in _NO_MATH:
        f.get(name, None)
    cfg = NemotronHConfig(
        vocab_size=f.get("vocab_size"), embed=embed, pattern=_pattern(f), heads=heads,
        kv_heads=f.get("num_key_value_heads", heads), head_dim=f.get("head_dim", 128),  # transformers' default
        mlp=f.get("intermediate_size", 21504), mlp_activation=activation, mlp_bias=f.get("mlp_bias", False), ssm=ssm,
        expert_mlp=f.get("moe_intermediate_size", 7688),
        shared_expert_mlp=f.get("moe_shared_expert_intermediate_size", 7688), moe_latent=latent, router=router,
        norm_eps=f.get("layer_norm_epsilon", 1e-5), init_std=f.get("initializer_range", 0.02))
    f.check_all_understood("nemotron_h")
    return cfg


def config_to_hf(cfg: NemotronHConfig) -> dict:
    r, s = cfg.router, cfg.ssm
    problems = []
    if cfg.count("moe") and (r.score_fn != "sigmoid" or not r.correction_bias):
        problems.append("the MoE router must be sigmoid with a correction bias (RouterConfig.score_fn='sigmoid', "
                        "correction_bias=True)")
    if cfg.count("moe") and not cfg.shared_expert_mlp:
        problems.append("every HF Nemotron-H MoE layer has a shared expert (shared_expert_mlp > 0)")
    if cfg.tie_embeddings:
        problems.append("NemotronHForCausalLM does not tie its head to the embeddings (tie_embeddings=False)")
    if problems:
        raise HFConfigError("cannot express this NemotronHConfig in HF's nemotron_h: " + "; ".join(problems))
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.embed,
        "layers_block_type": [OUR_TO_HF[k] for k in cfg.pattern],
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "attention_bias": False, "attention_dropout": 0.0, "hidden_dropout": 0.0,
        "intermediate_size": cfg.mlp, "mlp_hidden_act": cfg.mlp_activation, "mlp_bias": cfg.mlp_bias,
        "mamba_num_heads": s.heads, "mamba_head_dim": s.head_dim, "ssm_state_size": s.state, "n_groups": s.groups,
        "conv_kernel": s.conv_kernel, "chunk_size": s.chunk_size, "use_conv_bias": s.conv_bias,
        "use_bias": s.proj_bias, "mamba_hidden_act": "silu",
        "time_step_min": s.dt_init_range[0], "time_step_max": s.dt_init_range[1],
        "time_step_floor": s.dt_init_floor, "time_step_limit": time_step_limit_to_hf(s.time_step_limit),
        "n_routed_experts": r.num_experts, "num_experts_per_tok": r.top_k, "n_group": r.n_group,
        "topk_group": r.topk_group, "norm_topk_prob": r.norm_topk_prob,
        "routed_scaling_factor": r.routed_scaling_factor,
        "moe_intermediate_size": cfg.expert_mlp, "moe_shared_expert_intermediate_size": cfg.shared_expert_mlp,
        "n_shared_experts": 1, "moe_latent_size": cfg.moe_latent,
        "layer_norm_epsilon": cfg.norm_eps, "tie_word_embeddings": False, "initializer_range": cfg.init_std,
        "num_nextn_predict_layers": 0,
    }


FAMILY = Family(
    model_type="nemotron_h",
    architecture="NemotronHForCausalLM",
    config_class=NemotronHConfig,
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    tensors=tensors,
    ignored_hf_tensors=(r"mtp\..*",),  # multi-token-prediction layers: not run by transformers' forward
)
