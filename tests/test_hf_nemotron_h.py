"""hf.load / hf.save / convert / verify for nemotron_h against transformers' NemotronHForCausalLM:
a tiny model with all four block kinds, 2 B/C groups, a chunk (6) that does not divide the
sequence (16), a latent MoE projection, biases, group-limited sigmoid routing with a correction
bias, and dt clamped from below; plus the strict config translation both ways."""
from __future__ import annotations

import json
import types

import pytest
from flax import nnx

from hf_tiny_models import forward, random_tokens, relative_error, save_tiny_nemotron_h
from jaxtrain import hf
from jaxtrain.cli import convert
from jaxtrain.hf.errors import HFConfigError
from jaxtrain.hf.families import nemotron_h as family
from jaxtrain.hf.safetensors_io import SafetensorsDir
from jaxtrain.hf.verify import transformers_logits
from jaxtrain.meshes.mesh import MeshConfig, build_mesh
from jaxtrain.models.layers.router import RouterConfig

pytestmark = [pytest.mark.slow]

# dt clamped on both sides (time_step_limit), so that both bounds change the logits
HF_CONFIG = dict(moe_latent_size=16, mlp_bias=True, use_bias=True, time_step_limit=(0.6, 1.2), n_routed_experts=8,
                 n_group=2, topk_group=1, routed_scaling_factor=2.5)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    directory = save_tiny_nemotron_h(tmp_path_factory.mktemp("nemotron_h"), seed=5, **HF_CONFIG)
    tokens = random_tokens(96, batch=8, length=16)  # 8 rows: the batch splits over data=8 on 16 devices
    return types.SimpleNamespace(dir=directory, tokens=tokens, reference=transformers_logits(directory, tokens))


def test_config_translated(case):
    _, cfg = hf.read_config(case.dir)
    assert cfg.pattern == ("mamba", "moe", "attention", "mlp", "mamba", "moe")
    assert (cfg.ssm.groups, cfg.ssm.chunk_size, cfg.ssm.time_step_limit, cfg.ssm.proj_bias) == (2, 6, (0.6, 1.2), True)
    assert (cfg.moe_latent, cfg.mlp_bias, cfg.shared_expert_mlp, cfg.mlp_activation) == (16, True, 24, "relu2")
    assert cfg.router == RouterConfig(num_experts=8, top_k=2, score_fn="sigmoid", n_group=2, topk_group=1,
                                      norm_topk_prob=True, routed_scaling_factor=2.5, correction_bias=True,
                                      bias_update_rate=0.0)


def test_logits_match_transformers_on_one_and_16_devices(case):
    assert relative_error(forward(hf.load(case.dir), case.tokens), case.reference) < 1e-4
    mesh = build_mesh(MeshConfig(data=8, tensor=2))
    sharded = hf.load(case.dir, mesh=mesh)
    in_x = nnx.to_pure_dict(nnx.state(sharded))["stacks"]["blocks"]["mamba"]["layers"]["mixer"]["in_x"]["kernel"]
    assert in_x.sharding.spec[2] == "tensor" and in_x.addressable_shards[0].data.shape[2] == 4  # 8 SSM heads / 2
    assert relative_error(forward(sharded, case.tokens, mesh), case.reference) < 1e-4


def test_save_then_transformers_loads_same_logits_and_bytes(case, tmp_path):
    hf.save(hf.load(case.dir), tmp_path, max_shard_bytes=40_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert relative_error(transformers_logits(str(tmp_path), case.tokens), case.reference) < 1e-6
    before, after = SafetensorsDir(case.dir), SafetensorsDir(tmp_path)
    assert sorted(before.tensors) == sorted(after.tensors)  # per-expert tensors, backbone.* names
    assert "backbone.layers.1.mixer.experts.7.up_proj.weight" in after.tensors
    assert all(before.read(n).tobytes() == after.read(n).tobytes() for n in before.tensors)


def test_convert_round_trip_and_verify_cli(case, tmp_path, capsys):
    from jaxtrain.hf import verify

    work = tmp_path / "work"
    assert convert.main([f"--hf_dir={case.dir}", f"--workdir={work}"]) == 0
    assert convert.main([f"--workdir={work}", f"--hf_out={tmp_path / 'out'}"]) == 0
    before, after = SafetensorsDir(case.dir), SafetensorsDir(tmp_path / "out")
    assert all(before.read(n).tobytes() == after.read(n).tobytes() for n in before.tensors)
    assert verify.main([case.dir, "--length=16", "--batch=2"]) == 0
    assert "PASS" in capsys.readouterr().out


# ----------------------------------------------------------------------------- config strictness

def _raw(case, **changes) -> dict:
    with open(f"{case.dir}/config.json") as f:
        raw = json.load(f)
    raw.update(changes)
    return {k: v for k, v in raw.items() if v is not ...}


def test_legacy_pattern_and_layer_names_read_the_same(case):
    _, cfg = hf.read_config(case.dir)
    legacy = family.config_from_hf(_raw(case, layers_block_type=..., hybrid_override_pattern="ME*-ME"))
    transformers4_names = ["mamba", "moe", "attention", "mlp", "mamba", "moe"]
    old_names = family.config_from_hf(_raw(case, layers_block_type=transformers4_names))
    assert legacy == cfg == old_names


@pytest.mark.parametrize("changes, message", [
    (dict(mlp_hidden_act="gelu"), "mlp_hidden_act='gelu' is not supported"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings=True is not supported"),
    (dict(hidden_dropout=0.1), "hidden_dropout"),
    (dict(layers_block_type=["mamba", "sliding_attention"]), "unsupported types \\['sliding_attention'\\]"),
    (dict(some_new_switch=True), "'some_new_switch' are not understood by the nemotron_h mapping"),
])
def test_unsupported_config_fields_are_named(case, changes, message):
    with pytest.raises(HFConfigError, match=message):
        family.config_from_hf(_raw(case, **changes))


def test_export_refuses_what_hf_cannot_express(case):
    import dataclasses

    _, cfg = hf.read_config(case.dir)
    softmax = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, score_fn="softmax"))
    with pytest.raises(HFConfigError, match="sigmoid with a correction bias"):
        family.config_to_hf(softmax)
    unbounded = dataclasses.replace(cfg, ssm=dataclasses.replace(cfg.ssm, time_step_limit=(0.0, None)))
    assert family.config_from_hf(family.config_to_hf(unbounded)).ssm.time_step_limit == (0.0, None)
