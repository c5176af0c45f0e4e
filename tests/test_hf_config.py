"""HF config.json <-> LlamaConfig: every math-changing field, both transformers 4 and 5 layouts,
and a clear error for anything unsupported."""
from __future__ import annotations

import dataclasses

import gin
import pytest

from jaxtrain.hf.errors import HFConfigError
from jaxtrain.hf.families.llama import config_from_hf, config_to_hf
from jaxtrain.hf.gin_config import model_gin
from jaxtrain.models.layers.rope import Llama3Scaling, LinearScaling, NoScaling
from jaxtrain.models.llama import LlamaConfig

pytestmark = [pytest.mark.fast]

V5_LLAMA3 = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False, "head_dim": 128, "pretraining_tp": 1, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128009], "dtype": "bfloat16", "use_cache": True,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}


def test_llama3_fields():
    cfg = config_from_hf(V5_LLAMA3)
    assert (cfg.vocab_size, cfg.embed, cfg.mlp, cfg.layers, cfg.heads, cfg.kv_heads, cfg.head_dim) == (
        128256, 4096, 14336, 32, 32, 8, 128)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == Llama3Scaling(8.0, 1.0, 4.0, 8192)
    assert cfg.norm_eps == 1e-5 and not cfg.tie_embeddings


def test_transformers4_layout_top_level_rope_fields():
    v4 = {k: v for k, v in V5_LLAMA3.items() if k != "rope_parameters"}
    v4.update(rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 4.0}, head_dim=None)
    cfg = config_from_hf(v4)
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling == LinearScaling(4.0) and cfg.head_dim == 128
    v4.update(rope_scaling=None)
    del v4["rope_theta"]
    assert config_from_hf(v4).rope_scaling == NoScaling() and config_from_hf(v4).rope_theta == 10000.0


def test_llama3_original_length_falls_back_to_max_position_embeddings():
    raw = {**V5_LLAMA3, "rope_parameters": {**V5_LLAMA3["rope_parameters"]}}
    del raw["rope_parameters"]["original_max_position_embeddings"]
    assert config_from_hf(raw).rope_scaling.original_max_position == 131072


@pytest.mark.parametrize("cfg", [
    LlamaConfig(),
    LlamaConfig(vocab_size=97, tie_embeddings=True, attention_bias=True, mlp_bias=True, head_dim=48,
                rope_scaling=LinearScaling(2.0), norm_eps=1e-6),
    LlamaConfig(rope_theta=500000.0, rope_scaling=Llama3Scaling(8.0, 1.0, 4.0, 8192)),
])
def test_round_trip_through_hf_and_transformers(cfg):
    import transformers

    cfg = dataclasses.replace(cfg, head_dim=cfg.resolved_head_dim)  # read configs always name it
    raw = {"model_type": "llama", **config_to_hf(cfg)}
    assert config_from_hf(raw) == cfg
    # transformers reads what we write and writes back what we read
    theirs = transformers.LlamaConfig(**config_to_hf(cfg)).to_dict()
    assert config_from_hf(theirs) == cfg


def test_gin_rebuilds_the_config():
    import jaxtrain.training.config  # noqa: F401  (registers the configurables)

    cfg = LlamaConfig(vocab_size=97, embed=64, heads=8, kv_heads=4, head_dim=8, rope_theta=500000.0,
                      rope_scaling=Llama3Scaling(8.0, 1.0, 4.0, 64), tie_embeddings=True)
    gin.clear_config()
    try:
        gin.parse_config(model_gin(cfg, "header"))
        assert jaxtrain.training.config.Experiment().model == cfg
    finally:
        gin.clear_config()


@pytest.mark.parametrize("change, named", [
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"pretraining_tp": 0}, "pretraining_tp=0"),
    ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type='yarn'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "['factor']"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "mscale": 1.0}}, "mscale"),
    ({"quantization_config": {"quant_method": "gptq"}}, "'quantization_config'"),
    ({"num_hidden_layers": None}, "'num_hidden_layers' is missing"),
])
def test_unsupported_fields_are_named(change, named):
    raw = {**V5_LLAMA3, **change}
    with pytest.raises(HFConfigError, match=None) as err:
        config_from_hf(raw, "/some/dir/config.json")
    assert named in str(err.value) and "/some/dir/config.json" in str(err.value)


def test_written_config_has_every_math_field():
    written = config_to_hf(dataclasses.replace(LlamaConfig(), rope_scaling=LinearScaling(2.0)))
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
                  "mlp_bias", "hidden_act", "rope_parameters"):
        assert field in written
    assert written["rope_parameters"] == {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
