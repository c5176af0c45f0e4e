"""config.json fields across the HF families (jaxtrain/hf/config_fields.py): the configs transformers
writes, plus the fields published checkpoints carry (provenance, tokenizer ids, generation settings,
exporters' markers), convert to the same model; a field that changes the math with a value we do not
implement is refused, naming it. The harmless set is checked against transformers' own modeling code."""
from __future__ import annotations

import json
import logging
import os
import re

import pytest

from jaxtrain.hf.config_fields import CHECKED_FIELDS, NO_MATH_FIELDS
from jaxtrain.hf.errors import HFConfigError
from jaxtrain.hf.registry import families

pytestmark = [pytest.mark.slow]

# transformers config classes at tiny sizes (those of tests/hf_tiny_models.py and test_hf_deepseek.py)
TINY = {
    "llama": ("LlamaConfig", dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=8, num_key_value_heads=4)),
    "deepseek_v2": ("DeepseekV2Config", dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                             q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                             v_head_dim=8, intermediate_size=48, moe_intermediate_size=16,
                                             n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                             first_k_dense_replace=1)),
    "mamba2": ("Mamba2Config", dict(vocab_size=96, hidden_size=32, num_heads=8, head_dim=8, expand=2, state_size=8,
                                    n_groups=2, num_hidden_layers=2, chunk_size=6)),
    "nemotron_h": ("NemotronHConfig", dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=8, intermediate_size=48, mamba_num_heads=8, mamba_head_dim=8,
                                           ssm_state_size=8, n_groups=2, chunk_size=6, n_routed_experts=8,
                                           num_experts_per_tok=2, moe_intermediate_size=16,
                                           moe_shared_expert_intermediate_size=24,
                                           layers_block_type=["linear_attention", "moe", "full_attention", "mlp"])),
}

# What published config.json files add that transformers' save does not write (or writes differently).
PUBLISHED_EXTRAS = {
    "_name_or_path": "some-org/some-model", "_model_name_or_path": "/home/someone/ckpt", "_commit_hash": "0" * 40,
    "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "unk_token_id": 0, "pad_token_id": None,
    "sep_token_id": 5, "use_cache": False, "temperature": 0.7, "top_p": 0.9, "top_k": 50, "do_sample": True,
    "max_length": 2048, "num_beams": 1, "repetition_penalty": 1.1, "tokenizer_class": "LlamaTokenizer",
    "pretraining_tp": 2,  # transformers 4 summed the same products in slices; 5 does not read it
}

# SmolLM2-135M's config.json as published (nanotron export: rope_interleaved, is_llama_config).
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0,
    "eos_token_id": 0, "head_dim": 64, "hidden_act": "silu", "hidden_size": 576,
    "initializer_range": 0.041666666666666664, "intermediate_size": 1536, "is_llama_config": True,
    "max_position_embeddings": 8192, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 9,
    "num_hidden_layers": 30, "num_key_value_heads": 3, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_interleaved": False, "rope_scaling": None, "rope_theta": 100000, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.42.3", "use_cache": True, "vocab_size": 49152,
}

# Mamba-Codestral-7B's config.json as published (transformers 4.44: norm_before_gate's default True,
# which transformers never applied; mamba_ssm's dt-init settings; intermediate_size).
MAMBA_CODESTRAL = {
    "_name_or_path": "/raid/mamba2-hf/", "architectures": ["Mamba2ForCausalLM"], "bos_token_id": 0,
    "chunk_size": 256, "conv_kernel": 4, "eos_token_id": 0, "expand": 2, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.1, "intermediate_size": 8192, "layer_norm_epsilon": 1e-05,
    "model_type": "mamba2", "n_groups": 8, "norm_before_gate": True, "num_heads": 128, "num_hidden_layers": 64,
    "pad_token_id": 0, "rescale_prenorm_residual": False, "residual_in_fp32": True, "rms_norm": True,
    "state_size": 128, "tie_word_embeddings": False, "time_step_floor": 0.0001, "time_step_init_scheme": "random",
    "time_step_limit": [0.0, float("inf")], "time_step_max": 0.1, "time_step_min": 0.001, "time_step_rank": 256,
    "time_step_scale": 1.0, "torch_dtype": "bfloat16", "transformers_version": "4.44.0.dev0", "use_bias": False,
    "use_cache": True, "use_conv_bias": True, "vocab_size": 32768,
}


def written(model_type: str, directory, **overrides) -> dict:
    """The config.json transformers' save_pretrained writes for a tiny config of this family."""
    import transformers

    name, base = TINY[model_type]
    getattr(transformers, name)(**{**base, **overrides}).save_pretrained(str(directory))
    with open(os.path.join(directory, "config.json")) as f:
        return json.load(f)


def translate(raw: dict, where: str = "/d/config.json"):
    return families()[raw["model_type"]].config_from_hf(raw, where)


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_written_config_with_published_extras_converts_to_the_same_model(model_type, tmp_path, caplog):
    raw = written(model_type, tmp_path)
    plain = translate(raw)
    with caplog.at_level(logging.INFO, logger="jaxtrain.hf.config_fields"):
        assert translate({**raw, **PUBLISHED_EXTRAS}) == plain
    lines = [r.getMessage() for r in caplog.records if r.name == "jaxtrain.hf.config_fields"]
    assert len(lines) == 1, lines  # one info line lists what was not used
    for name in ("_model_name_or_path", "unk_token_id", "temperature", "top_p", "tokenizer_class"):
        assert name in lines[0]


def test_published_smollm_config_converts():
    cfg = translate(SMOLLM2_135M)
    assert (cfg.vocab_size, cfg.embed, cfg.layers, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp) == (
        49152, 576, 30, 9, 3, 64, 1536)
    assert cfg.tie_embeddings and cfg.rope_theta == 100000 and cfg.norm_eps == 1e-5
    assert cfg.init_std == SMOLLM2_135M["initializer_range"] and not cfg.mlp_bias and not cfg.attention_bias


def test_published_mamba_codestral_config_converts():
    cfg = translate(MAMBA_CODESTRAL)
    s = cfg.ssm
    assert (cfg.vocab_size, cfg.embed, cfg.layers, s.heads, s.head_dim, s.state, s.groups, s.chunk_size) == (
        32768, 4096, 64, 128, 64, 128, 8, 256)
    assert s.time_step_limit == (0.0, None) and not cfg.tie_embeddings


def test_convert_cli_imports_a_checkpoint_with_published_fields(tmp_path, capfd):
    """The reported failure: `python -m jaxtrain.convert --hf_dir=D` on a real Llama checkpoint;
    the fields it accepted without using are named in one line the user sees."""
    from hf_tiny_models import save_tiny_llama
    from jaxtrain.cli import convert

    hf_dir = save_tiny_llama(tmp_path / "hf")
    path = os.path.join(hf_dir, "config.json")
    with open(path) as f:
        raw = json.load(f)
    with open(path, "w") as f:
        json.dump({**raw, **PUBLISHED_EXTRAS, "is_llama_config": True, "rope_interleaved": False}, f)
    assert convert.main([f"--hf_dir={hf_dir}", f"--workdir={tmp_path / 'w'}"]) == 0
    assert os.path.isdir(tmp_path / "w" / "checkpoints" / "0")
    notes = [line for line in capfd.readouterr().err.splitlines() if "do not change the computation" in line]
    assert len(notes) == 1 and "unk_token_id" in notes[0] and "_model_name_or_path" in notes[0], notes


# (family, change to the written config, what the error must name)
REFUSED = [
    ("llama", {"rope_interleaved": True}, "rope_interleaved=True"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "rope_type='dynamic'"),
    ("llama", {"sliding_window": 16}, "sliding_window=16"),
    ("llama", {"use_sliding_window": True}, "use_sliding_window=True"),
    ("llama", {"qk_layernorm": True}, "qk_layernorm=True"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("llama", {"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ("llama", {"pretraining_tp": 0}, "pretraining_tp=0"),
    ("llama", {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ("llama", {"quantization_config": {"quant_method": "gptq"}}, "'quantization_config'"),
    ("deepseek_v2", {"mlp_bias": True}, "mlp_bias=True"),
    ("deepseek_v2", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type='longrope'"),
    ("deepseek_v2", {"scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),
    ("mamba2", {"rms_norm": False}, "rms_norm=False"),
    ("mamba2", {"intermediate_size": 48}, "intermediate_size=48 must equal expand * hidden_size = 64"),
    ("mamba2", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("nemotron_h", {"tie_word_embeddings": True}, "tie_word_embeddings=True"),
    ("nemotron_h", {"sliding_window": 1024}, "sliding_window=1024"),
    ("nemotron_h", {"attention_head_dim": 16}, "attention_head_dim=16 and head_dim=8 disagree"),
    ("nemotron_h", {"mlp_hidden_act": "gelu"}, "mlp_hidden_act='gelu'"),
]


@pytest.fixture(scope="module")
def written_configs(tmp_path_factory):
    return {t: written(t, tmp_path_factory.mktemp(t)) for t in TINY}


@pytest.mark.parametrize("model_type, change, named", REFUSED, ids=[f"{t}-{next(iter(c))}" for t, c, _ in REFUSED])
def test_math_changing_fields_with_unsupported_values_are_refused(written_configs, model_type, change, named):
    raw = {**written_configs[model_type], **change}
    with pytest.raises(HFConfigError) as err:
        translate(raw, "/some/dir/config.json")
    assert named in str(err.value) and "/some/dir/config.json" in str(err.value)


def test_nemotron_h_remote_code_names_read_as_todays(written_configs):
    raw = written_configs["nemotron_h"]
    legacy = {k: v for k, v in raw.items() if k not in ("conv_kernel", "chunk_size", "n_groups", "head_dim")}
    legacy.update(mamba_d_conv=raw["conv_kernel"], mamba_chunk_size=raw["chunk_size"], mamba_n_groups=raw["n_groups"],
                  attention_head_dim=raw["head_dim"])
    assert translate(legacy) == translate(raw)


# transformers' modeling files for our families (and the rope helpers they call)
MODELING = ["models/llama/modeling_llama.py", "models/deepseek_v2/modeling_deepseek_v2.py",
            "models/mamba2/modeling_mamba2.py", "models/nemotron_h/modeling_nemotron_h.py",
            "modeling_rope_utils.py"]
# Read by that code, yet no forward result depends on them (why, each):
READ_BUT_HARMLESS = {
    "pad_token_id": "nn.Embedding padding_idx: only keeps that row's gradient at zero in torch",
    "max_position_embeddings": "the rotary cache's size, and the dynamic rope types, which we refuse",
    "initializer_range": "weight init (a family translates it to init_std)",
    "use_cache": "inference cache", "output_hidden_states": "what a forward returns",
    "return_dict": "what a forward returns",
}


def test_no_harmless_field_is_read_by_transformers_modeling_code():
    """The claim behind the accepted set: transformers' forward for our families never reads it."""
    import transformers

    root = os.path.dirname(transformers.__file__)
    read = set()
    for rel in MODELING:
        with open(os.path.join(root, rel)) as f:
            source = f.read()
        read |= set(re.findall(r"config\.([A-Za-z_]\w*)", source))
        read |= set(re.findall(r"getattr\(\s*(?:self\.)?config\s*,\s*[\"'](\w+)[\"']", source))
    assert {"mlp_bias", "attention_bias", "hidden_act", "rms_norm_eps"} <= read  # the scan sees the math fields
    leaked = sorted((read & NO_MATH_FIELDS) - set(READ_BUT_HARMLESS))
    assert not leaked, f"accepted as harmless, but transformers' modeling code reads: {leaked}"
    assert not set(CHECKED_FIELDS) & NO_MATH_FIELDS
