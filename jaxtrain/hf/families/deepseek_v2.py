"""HF `DeepseekV2ForCausalLM` (model_type "deepseek_v2") <-> models/deepseek.py.

Layers: HF layers 0 .. first_k_dense_replace-1 are our `dense_blocks` stack, the rest our
`moe_blocks` stack. Attention: HF's kv_a_proj_with_mqa is our kv_down (its first kv_lora_rank
rows) and k_rope (the last qk_rope_head_dim rows); every other projection maps one to one,
transposed, with heads split out. HF's rotary dims are interleaved pairs, and so are our MLA's
(rope.apply_rope_interleaved): no permutation. Experts: one tensor per expert
(`mlp.experts.{j}.{gate,up,down}_proj.weight`), as published checkpoints hold them and as
transformers' save_pretrained writes them (it fuses gate_up_proj in memory only).

Routing is what transformers 5 computes: softmax scores; `greedy` top-k or
`group_limited_greedy` (experts in n_group groups ranked by their best score, only the best
topk_group groups eligible); weights = the top-k scores x routed_scaling_factor.

norm_topk_prob: transformers 5 ignores it (never renormalizes), while DeepSeek's reference
code renormalizes the top-k weights (and then skips routed_scaling_factor). Every published
DeepSeek-V2 checkpoint sets it false, where all agree. When a config sets it true we follow
transformers — the implementation that defines this model_type, that `verify` compares
against, and that loads what hf.save writes — keep renormalization off, and warn. Exporting a
model whose router renormalizes is an error: transformers' DeepseekV2 cannot express it.

Read but not translated (they change no forward math): the training-only aux-loss settings
`aux_loss_alpha` and `seq_aux` (set our RouterConfig's losses for training), `ep_size` (a
parallel layout), `output_router_logits`, and `head_dim` / `qk_head_dim` (transformers derives
both from the qk head dims and ignores what the file says).
"""
from __future__ import annotations

import warnings

from jaxtrain.hf.config_fields import HFConfigFields
from jaxtrain.hf.errors import HFConfigError
from jaxtrain.hf.mapping import Family, TensorMap
from jaxtrain.hf.yarn_params import rope_from_hf_with_yarn, rope_to_hf_with_yarn
from jaxtrain.models.deepseek import DeepSeekConfig
from jaxtrain.models.layers.rope import YarnScaling
from jaxtrain.models.layers.router import RouterConfig

LAYER = "model.layers.{layer}."
STACKS = "stacks/{}/layers/"
LATENT_NORM_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm ignore rms_norm_eps
NO_FORWARD_MATH_FIELDS = ("aux_loss_alpha", "seq_aux", "ep_size", "output_router_logits", "head_dim", "qk_head_dim")
PER_HEAD = "(heads dim) {} -> {} heads dim"


def _attention(cfg: DeepSeekConfig, tm) -> list[TensorMap]:
    kv, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    attn = "self_attn."
    maps = []
    if cfg.q_lora_rank is None:
        maps.append(tm("attn/q/kernel", attn + "q_proj.weight", PER_HEAD.format("embed", "embed")))
    else:
        maps += [tm("attn/q_down/kernel", attn + "q_a_proj.weight", "rank embed -> embed rank"),
                 tm("attn/q_norm/scale", attn + "q_a_layernorm.weight"),
                 tm("attn/q_up/kernel", attn + "q_b_proj.weight", PER_HEAD.format("rank", "rank"))]
    maps += [
        tm("attn/kv_down/kernel", attn + "kv_a_proj_with_mqa.weight", "rank embed -> embed rank", hf_slice=(0, 0, kv)),
        tm("attn/k_rope/kernel", attn + "kv_a_proj_with_mqa.weight", "rope embed -> embed rope",
           hf_slice=(0, kv, kv + rope)),
        tm("attn/kv_norm/scale", attn + "kv_a_layernorm.weight"),
        tm("attn/kv_up/kernel", attn + "kv_b_proj.weight", PER_HEAD.format("rank", "rank")),
        tm("attn/o/kernel", attn + "o_proj.weight", "embed (heads dim) -> heads dim embed"),
    ]
    if cfg.attention_bias:  # transformers' attention_bias: on the projections that read x or write out
        if cfg.q_lora_rank is not None:
            maps.append(tm("attn/q_down/bias", attn + "q_a_proj.bias"))
        maps += [tm("attn/kv_down/bias", attn + "kv_a_proj_with_mqa.bias", hf_slice=(0, 0, kv)),
                 tm("attn/k_rope/bias", attn + "kv_a_proj_with_mqa.bias", hf_slice=(0, kv, kv + rope)),
                 tm("attn/o/bias", attn + "o_proj.bias")]
    return maps


def _swiglu(tm, ours: str, hf: str) -> list[TensorMap]:
    return [tm(f"{ours}/gate/kernel", f"{hf}.gate_proj.weight", "hidden embed -> embed hidden"),
            tm(f"{ours}/up/kernel", f"{hf}.up_proj.weight", "hidden embed -> embed hidden"),
            tm(f"{ours}/down/kernel", f"{hf}.down_proj.weight", "embed hidden -> hidden embed")]


def _moe(tm) -> list[TensorMap]:
    experts = "mlp.experts.{expert}."
    return [
        tm("moe/router/kernel", "mlp.gate.weight", "experts embed -> embed experts"),
        tm("moe/experts/gate", experts + "gate_proj.weight", "hidden embed -> embed hidden"),
        tm("moe/experts/up", experts + "up_proj.weight", "hidden embed -> embed hidden"),
        tm("moe/experts/down", experts + "down_proj.weight", "embed hidden -> hidden embed"),
        *_swiglu(tm, "moe/shared", "mlp.shared_experts"),
    ]


def tensors(cfg: DeepSeekConfig) -> list[TensorMap]:
    maps = [TensorMap("embed/table", "model.embed_tokens.weight"),
            TensorMap("head/kernel", "lm_head.weight", "vocab embed -> embed vocab", optional=True),  # tied: absent
            TensorMap("final_norm/scale", "model.norm.weight")]
    stacks = [("dense_blocks", range(0, cfg.first_k_dense)), ("moe_blocks", range(cfg.first_k_dense, cfg.layers))]
    for name, hf_layers in stacks:
        if not hf_layers:
            continue
        rows = {"layer": tuple(hf_layers)}

        def tm(ours, hf, pattern="", **kw):
            return TensorMap(STACKS.format(name) + ours, LAYER + hf, pattern, hf_indices=rows, **kw)

        maps += [tm("attn_norm/scale", "input_layernorm.weight"), tm("mlp_norm/scale", "post_attention_layernorm.weight")]
        maps += _attention(cfg, tm)
        maps += _moe(tm) if name == "moe_blocks" else _swiglu(tm, "mlp", "mlp")
    return maps


# ---- config ----------------------------------------------------------------------------------

def _router_from_hf(f: HFConfigFields) -> RouterConfig:
    f.expect("scoring_func", ["softmax"], "softmax")  # DeepSeek-V2 (reference code and transformers)
    experts, top_k = f.get("n_routed_experts"), f.get("num_experts_per_tok")
    method = f.expect("topk_method", ["greedy", "group_limited_greedy"], "greedy")
    n_group, topk_group = f.get("n_group", None), f.get("topk_group", None)  # greedy: unused, as in transformers
    if method == "greedy":
        n_group = topk_group = 1
    elif n_group is None or topk_group is None:
        raise HFConfigError(f"{f.where}: topk_method='group_limited_greedy' needs n_group and topk_group")
    elif experts % n_group or not 1 <= topk_group <= n_group or top_k > topk_group * (experts // n_group):
        raise HFConfigError(f"{f.where}: n_group={n_group}, topk_group={topk_group} do not fit n_routed_experts="
                            f"{experts} and num_experts_per_tok={top_k} (n_group must divide the experts, topk_group "
                            f"be in [1, n_group], and the kept groups hold at least num_experts_per_tok experts)")
    if f.get("norm_topk_prob", False) and top_k > 1:
        warnings.warn(f"{f.where}: norm_topk_prob=true is ignored, as transformers' DeepseekV2 ignores it (DeepSeek's "
                      f"reference code would renormalize the top-k weights); routing weights are the top-k "
                      f"softmax scores x routed_scaling_factor", stacklevel=3)
    return RouterConfig(num_experts=experts, top_k=top_k, score_fn="softmax", n_group=n_group, topk_group=topk_group,
                        norm_topk_prob=False, routed_scaling_factor=float(f.get("routed_scaling_factor", 1.0)))


def config_from_hf(raw: dict, where: str = "config.json") -> DeepSeekConfig:
    f = HFConfigFields(raw, where)
    f.expect("hidden_act", ["silu"], "silu")
    f.expect("attention_dropout", [0, 0.0], 0.0)
    f.expect("mlp_bias", [False], False)
    f.expect("moe_layer_freq", [1], 1)  # the reference code's every-k-th-layer MoE; transformers assumes 1
    for name in NO_FORWARD_MATH_FIELDS:
        f.get(name, None)
    heads = f.get("num_attention_heads")
    if f.get("num_key_value_heads", heads) != heads:
        raise HFConfigError(f"{where}: num_key_value_heads={raw['num_key_value_heads']} must equal "
                            f"num_attention_heads={heads} (MLA expands its latent to every head)")
    if "q_lora_rank" not in raw:  # null is meaningful (direct queries); absent would mean transformers' 1536
        raise HFConfigError(f"{where}: required field 'q_lora_rank' is missing (null for direct queries)")
    layers, first_dense = f.get("num_hidden_layers"), f.get("first_k_dense_replace", 0)
    if not 0 <= first_dense <= layers:
        raise HFConfigError(f"{where}: first_k_dense_replace={first_dense} must be in [0, num_hidden_layers={layers}]")
    shared = f.get("n_shared_experts")
    if first_dense < layers and shared < 1:
        raise HFConfigError(f"{where}: n_shared_experts={shared} is not supported (at least 1)")
    theta, scaling = rope_from_hf_with_yarn(f)
    cfg = DeepSeekConfig(
        vocab_size=f.get("vocab_size"),
        embed=f.get("hidden_size"),
        layers=layers,
        first_k_dense=first_dense,
        heads=heads,
        q_lora_rank=f.get("q_lora_rank", None),
        kv_lora_rank=f.get("kv_lora_rank"),
        qk_nope_head_dim=f.get("qk_nope_head_dim"),
        qk_rope_head_dim=f.get("qk_rope_head_dim"),
        v_head_dim=f.get("v_head_dim"),
        mlp=f.get("intermediate_size"),
        expert_mlp=f.get("moe_intermediate_size"),
        shared_experts=shared,
        router=_router_from_hf(f),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=f.get("rms_norm_eps"),
        latent_norm_eps=LATENT_NORM_EPS,
        tie_embeddings=f.get("tie_word_embeddings", False),
        attention_bias=f.get("attention_bias", False),
        init_std=f.get("initializer_range", 0.02),
    )
    f.check_all_understood("deepseek_v2")
    return cfg


def config_to_hf(cfg: DeepSeekConfig) -> dict:
    r = cfg.router
    unsupported = {
        "router.score_fn": r.score_fn != "softmax",
        "router.correction_bias": r.correction_bias,
        "router.norm_topk_prob": r.norm_topk_prob and r.top_k > 1,
        "shared_experts": cfg.moe_layers > 0 and cfg.shared_experts < 1,
        "latent_norm_eps": cfg.latent_norm_eps != LATENT_NORM_EPS,
    }
    bad = [name for name, is_bad in unsupported.items() if is_bad]
    if bad:
        raise HFConfigError(f"DeepSeekConfig field(s) {bad} have no transformers DeepseekV2 equivalent "
                            f"(it routes by softmax without renormalization or a selection bias, always has a "
                            f"shared expert, and normalizes the attention latents with eps {LATENT_NORM_EPS})")
    out = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.embed,
        "num_hidden_layers": cfg.layers,
        "first_k_dense_replace": cfg.first_k_dense,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "intermediate_size": cfg.mlp,
        "moe_intermediate_size": cfg.expert_mlp,
        "n_shared_experts": cfg.shared_experts,
        "n_routed_experts": r.num_experts,
        "num_experts_per_tok": r.top_k,
        "topk_method": "greedy" if r.n_group == 1 else "group_limited_greedy",
        "n_group": r.n_group,
        "topk_group": r.topk_group,
        "routed_scaling_factor": float(r.routed_scaling_factor),
        "norm_topk_prob": False,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": rope_to_hf_with_yarn(cfg.rope_theta, cfg.rope_scaling),
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
    }
    if isinstance(cfg.rope_scaling, YarnScaling):  # the stretched context, so transformers sees a consistent factor
        out["max_position_embeddings"] = int(cfg.rope_scaling.factor * cfg.rope_scaling.original_max_position)
    return out


FAMILY = Family(
    model_type="deepseek_v2",
    architecture="DeepseekV2ForCausalLM",
    config_class=DeepSeekConfig,
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    tensors=tensors,
    ignored_hf_tensors=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",),  # old checkpoints' rope cache
)
