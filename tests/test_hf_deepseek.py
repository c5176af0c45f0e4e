"""The deepseek_v2 HF mapping: config translation (both config layouts, every math-changing field,
clear errors), and tiny DeepseekV2ForCausalLM checkpoints against transformers: hf.load logits,
a 16-device load, and hf.save back to what transformers loads (fp32, 1e-4 relative)."""
from __future__ import annotations

import json
import types

import jax
import numpy as np
import pytest
from flax import nnx

from hf_tiny_models import random_tokens, relative_error
from jaxtrain import hf
from jaxtrain.hf.errors import HFConfigError
from jaxtrain.hf.families.deepseek_v2 import config_from_hf, config_to_hf
from jaxtrain.hf.safetensors_io import SafetensorsDir
from jaxtrain.hf.verify import transformers_logits
from jaxtrain.meshes.mesh import MeshConfig, build_mesh
from jaxtrain.models.deepseek import DeepSeekConfig
from jaxtrain.models.layers.rope import NoScaling, YarnScaling
from jaxtrain.models.layers.router import RouterConfig

pytestmark = [pytest.mark.slow]

# DeepSeek-V2-Lite's config.json as published (remote-code layout: rope_scaling, top-level
# rope_theta, the reference code's extra fields), only made small.
PUBLISHED_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV2Config"}, "aux_loss_alpha": 0.001,
    "bos_token_id": 100000, "eos_token_id": 100001, "ep_size": 1, "first_k_dense_replace": 1, "hidden_act": "silu",
    "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96, "kv_lora_rank": 32,
    "max_position_embeddings": 1024, "model_type": "deepseek_v2", "moe_intermediate_size": 16, "moe_layer_freq": 1,
    "n_group": 1, "n_routed_experts": 8, "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 4,
    "num_experts_per_tok": 3, "num_hidden_layers": 3, "num_key_value_heads": 4, "pretraining_tp": 1,
    "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 16, "vocab_size": 128,
}


# ---- config translation (no torch) ----------------------------------------------------------

def test_published_layout_translates_every_field():
    cfg = config_from_hf(PUBLISHED_LITE)
    assert (cfg.vocab_size, cfg.embed, cfg.layers, cfg.first_k_dense, cfg.heads) == (128, 64, 3, 1, 4)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (
        None, 32, 16, 8, 16)
    assert (cfg.mlp, cfg.expert_mlp, cfg.shared_experts) == (96, 16, 2)
    assert cfg.router == RouterConfig(num_experts=8, top_k=3, score_fn="softmax", n_group=1, topk_group=1,
                                      norm_topk_prob=False, routed_scaling_factor=1.0)
    assert cfg.rope_theta == 10000 and cfg.rope_scaling == YarnScaling(
        factor=40, original_max_position=4096, beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707)
    assert cfg.norm_eps == 1e-6 and not cfg.tie_embeddings and not cfg.attention_bias


def test_group_limited_routing_and_scaling_factor():
    raw = {**PUBLISHED_LITE, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
           "routed_scaling_factor": 16.0, "q_lora_rank": 24, "rope_scaling": None}
    cfg = config_from_hf(raw)
    assert (cfg.router.n_group, cfg.router.topk_group, cfg.router.routed_scaling_factor) == (4, 2, 16.0)
    assert cfg.q_lora_rank == 24 and cfg.rope_scaling == NoScaling()


def test_norm_topk_prob_follows_transformers_with_a_warning():
    with pytest.warns(UserWarning, match="norm_topk_prob"):
        cfg = config_from_hf({**PUBLISHED_LITE, "norm_topk_prob": True})
    assert cfg.router.norm_topk_prob is False


@pytest.mark.parametrize("change, field", [
    ({"scoring_func": "sigmoid"}, "scoring_func"),
    ({"topk_method": "noaux_tc"}, "topk_method"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"n_shared_experts": 0}, "n_shared_experts"),
    ({"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 1}, "n_group"),
    ({"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 1}, "num_experts_per_tok"),
    ({"rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 64, "low_freq_factor": 1}},
     "low_freq_factor"),
    ({"rope_scaling": {"type": "dynamic", "factor": 4}}, "dynamic"),
    ({"some_new_knob": 1}, "some_new_knob"),
])
def test_unsupported_values_name_the_field(change, field):
    with pytest.raises(HFConfigError, match=field):
        config_from_hf({**PUBLISHED_LITE, **change})


def test_missing_q_lora_rank_is_an_error_not_a_default():
    raw = {k: v for k, v in PUBLISHED_LITE.items() if k != "q_lora_rank"}
    with pytest.raises(HFConfigError, match="q_lora_rank"):
        config_from_hf(raw)


@pytest.mark.parametrize("router, field", [
    (RouterConfig(num_experts=8, top_k=2, score_fn="sigmoid"), "score_fn"),
    (RouterConfig(num_experts=8, top_k=2, norm_topk_prob=True), "norm_topk_prob"),
    (RouterConfig(num_experts=8, top_k=2, correction_bias=True), "correction_bias"),
])
def test_export_refuses_what_transformers_cannot_express(router, field):
    with pytest.raises(HFConfigError, match=field):
        config_to_hf(DeepSeekConfig(router=router))


def test_save_refuses_before_writing_anything(tmp_path):
    cfg = DeepSeekConfig(vocab_size=32, embed=16, layers=2, heads=2, kv_lora_rank=8, qk_nope_head_dim=4,
                         qk_rope_head_dim=4, v_head_dim=4, mlp=16, expert_mlp=8,
                         router=RouterConfig(num_experts=4, top_k=2, norm_topk_prob=True))
    with pytest.raises(HFConfigError, match="norm_topk_prob"):
        hf.save(cfg.build(nnx.Rngs(0)), tmp_path / "out", config=cfg)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("cfg", [
    DeepSeekConfig(),
    DeepSeekConfig(q_lora_rank=24, first_k_dense=0, tie_embeddings=True, attention_bias=True,
                   router=RouterConfig(num_experts=8, top_k=3, n_group=4, topk_group=2, routed_scaling_factor=2.0),
                   rope_scaling=YarnScaling(factor=8.0, original_max_position=512, mscale=1.0, mscale_all_dim=0.5,
                                            beta_fast=16.0, truncate=False, attention_factor_override=1.2)),
])
def test_round_trip_through_hf_config(cfg):
    from transformers import DeepseekV2Config

    raw = {"model_type": "deepseek_v2", **config_to_hf(cfg)}
    assert config_from_hf(raw) == cfg
    theirs = DeepseekV2Config(**config_to_hf(cfg)).to_dict()  # transformers accepts and keeps every field
    assert config_from_hf(theirs) == cfg


def test_gin_description_rebuilds_the_config(tmp_path):
    """What `jaxtrain.cli.convert` writes for an imported model (YaRN and the router nested) parses back."""
    import gin

    from jaxtrain.cli import convert
    from jaxtrain.hf.gin_config import model_gin

    cfg = config_from_hf({**PUBLISHED_LITE, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2})
    (tmp_path / "model.gin").write_text(model_gin(cfg))
    try:
        assert convert.model_config_from_gin([str(tmp_path / "model.gin")]) == cfg
    finally:
        gin.clear_config()


# ---- whole models against transformers ------------------------------------------------------

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, moe_intermediate_size=12, n_routed_experts=8,
            n_shared_experts=1, max_position_embeddings=256)
CASES = {
    # V2-Lite shape: direct queries, greedy routing, one dense layer, tied embeddings.
    "lite_greedy_tied": dict(num_hidden_layers=3, q_lora_rank=None, first_k_dense_replace=1, num_experts_per_tok=2,
                             topk_method="greedy", tie_word_embeddings=True),
    # V2 shape: query LoRA, group-limited routing, scaling factor, two dense layers, attention
    # biases, YaRN (mscale != mscale_all_dim, so both temperature corrections act), and the
    # published config.json layout.
    "v2_group_limited_yarn": dict(
        num_hidden_layers=4, q_lora_rank=12, first_k_dense_replace=2, num_experts_per_tok=3,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=2.5, attention_bias=True,
        rms_norm_eps=1e-5,  # the block norms use it; the MLA latent norms keep 1e-6
        max_position_embeddings=128,
        rope_parameters={"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0,  # theta 100: the ramp blends
                         "original_max_position_embeddings": 32, "mscale": 0.8, "mscale_all_dim": 1.0}),
}


def save_tiny_deepseek(directory, seed: int, published_layout: bool = False, **config) -> str:
    """A random DeepseekV2ForCausalLM saved by save_pretrained; norms and biases random too."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**{**BASE, **config}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.15 * torch.randn_like(p))
    model.save_pretrained(str(directory))
    if published_layout:  # as DeepSeek publishes it: transformers 4 rope fields plus the reference code's extras
        path = f"{directory}/config.json"
        with open(path) as f:
            raw = json.load(f)
        rope = raw.pop("rope_parameters")
        raw["rope_theta"] = rope.pop("rope_theta")
        raw["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
        raw.update(aux_loss_alpha=0.001, seq_aux=True, scoring_func="softmax", moe_layer_freq=1, ep_size=1)
        with open(path, "w") as f:
            json.dump(raw, f)
    return str(directory)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    directory = save_tiny_deepseek(tmp_path_factory.mktemp(request.param), seed=len(request.param),
                                   published_layout="yarn" in request.param, **CASES[request.param])
    tokens = random_tokens(BASE["vocab_size"], batch=2, length=12)
    model = hf.load(directory)
    return types.SimpleNamespace(name=request.param, dir=directory, tokens=tokens, model=model,
                                 reference=transformers_logits(directory, tokens))


def logits(model, tokens):
    graphdef, state = nnx.split(model)
    return np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens))


def test_load_matches_transformers(case):
    assert relative_error(logits(case.model, case.tokens), case.reference) < 1e-4


def test_save_writes_what_transformers_wrote_and_loads(case, tmp_path):
    hf.save(case.model, tmp_path, max_shard_bytes=60_000)
    before, after = SafetensorsDir(case.dir), SafetensorsDir(tmp_path)
    assert sorted(before.tensors) == sorted(after.tensors)  # per-expert names, biases, no lm_head when tied
    for name in before.tensors:
        assert before.read(name).tobytes() == after.read(name).tobytes(), name
    assert relative_error(transformers_logits(str(tmp_path), case.tokens), case.reference) < 1e-5


@pytest.mark.parametrize("mesh_cfg, rules, gate_shard", [
    (MeshConfig(data=2, expert=4, tensor=2), "dp", (1 / 4, 1)),  # experts over expert, heads over tensor
    (MeshConfig(data=4, context=2, tensor=2), "fsdp+experts_folded", (1 / 8, 1 / 2)),  # EP 8, FSDP over EDP
], ids=["expert4_dp", "folded_fsdp"])
def test_sharded_load_equals_single_device_load(case, mesh_cfg, rules, gate_shard):
    """On 16 devices each device reads its own slice of every tensor (its experts, and under
    FSDP its slice of their embed dimension over the expert-data-parallel axis), and every
    parameter equals the single-device load."""
    sharded = nnx.to_pure_dict(nnx.state(hf.load(case.dir, mesh=build_mesh(mesh_cfg), rules=rules)))
    gate = sharded["stacks"]["moe_blocks"]["layers"]["moe"]["experts"]["gate"]
    layers, experts, embed, hidden = gate.shape
    assert gate.addressable_shards[0].data.shape == (layers, experts * gate_shard[0], embed * gate_shard[1], hidden)
    single = nnx.to_pure_dict(nnx.state(case.model))
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(single)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
