"""hf.load / hf.save against transformers: logits, on one device and on a 16-device mesh, and
the round trip HF -> jaxtrain -> HF."""
from __future__ import annotations

import os
import types

import jax
import numpy as np
import pytest
from flax import nnx

from hf_tiny_models import forward, random_tokens, relative_error, save_tiny_llama
from jaxtrain import hf
from jaxtrain.hf.safetensors_io import SafetensorsDir
from jaxtrain.hf.verify import compare_logits, transformers_logits
from jaxtrain.meshes.mesh import MeshConfig, build_mesh
from jaxtrain.models.layers.rope import Llama3Scaling, LinearScaling

pytestmark = [pytest.mark.slow]

CASES = {
    # GQA, untied head, Llama-3 rope (original length 64 puts frequencies in all three bands),
    # an odd vocabulary (stays unsharded on tensor=4), attention biases.
    "gqa_llama3_untied_odd_vocab": dict(
        vocab_size=97, num_attention_heads=8, num_key_value_heads=4, attention_bias=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # MHA, tied embeddings, linear rope scaling, MLP biases, head_dim != hidden / heads.
    "mha_tied_linear": dict(
        vocab_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=8, tie_word_embeddings=True,
        mlp_bias=True, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    directory = save_tiny_llama(tmp_path_factory.mktemp(request.param), seed=len(request.param), **CASES[request.param])
    _, config = hf.read_config(directory)
    tokens = random_tokens(config.vocab_size)
    return types.SimpleNamespace(name=request.param, dir=directory, config=config, tokens=tokens,
                                 reference=transformers_logits(directory, tokens))


@pytest.fixture(scope="module")
def mesh():
    return build_mesh(MeshConfig(data=4, tensor=4))


@pytest.fixture(scope="module")
def sharded(case, mesh):
    return hf.load(case.dir, mesh=mesh)


EXPECTED = {
    "gqa_llama3_untied_odd_vocab": dict(
        vocab_size=97, heads=8, kv_heads=4, head_dim=8, tie_embeddings=False, attention_bias=True, mlp_bias=False,
        rope_theta=500000.0, rope_scaling=Llama3Scaling(8.0, 1.0, 4.0, 64)),
    "mha_tied_linear": dict(
        vocab_size=128, heads=4, kv_heads=4, head_dim=8, tie_embeddings=True, attention_bias=False, mlp_bias=True,
        rope_theta=10000.0, rope_scaling=LinearScaling(2.0)),
}


def test_config_translated(case):
    for field, value in EXPECTED[case.name].items():
        assert getattr(case.config, field) == value, field


def test_logits_match_transformers_on_one_device(case):
    ours = forward(hf.load(case.dir), case.tokens)
    assert relative_error(ours, case.reference) < 1e-4
    metrics = compare_logits(ours, case.reference)
    assert metrics["top1_agreement"] == 1.0 and metrics["kl_divergence"] < 1e-8


def test_logits_match_transformers_on_16_devices(case, mesh, sharded):
    q = nnx.to_pure_dict(nnx.state(sharded))["stacks"]["blocks"]["layers"]["attn"]["q"]["kernel"]
    assert q.sharding.spec[2] == "tensor"  # heads split 4 ways: no device holds the whole tensor
    assert q.addressable_shards[0].data.shape[2] == case.config.heads // 4
    assert relative_error(forward(sharded, case.tokens, mesh), case.reference) < 1e-4


def test_save_then_transformers_loads_same_logits(case, sharded, tmp_path):
    out = tmp_path / "exported"
    hf.save(sharded, out, max_shard_bytes=40_000)  # several shards + index, as large models get
    assert (out / "model.safetensors.index.json").exists()
    assert relative_error(transformers_logits(str(out), case.tokens), case.reference) < 1e-6


def test_tensors_byte_equal_after_hf_jaxtrain_hf(case, sharded, tmp_path):
    hf.save(sharded, tmp_path)
    before, after = SafetensorsDir(case.dir), SafetensorsDir(tmp_path)
    assert sorted(before.tensors) == sorted(after.tensors)
    for name in before.tensors:
        a, b = before.read(name), after.read(name)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name


def test_iter_params_streams_the_loaded_values(case, sharded):
    params = nnx.to_pure_dict(nnx.state(sharded))
    pieces = list(hf.iter_params(case.dir))
    assert {p.path for p in pieces} == {"/".join(k) for k in _paths(params)}
    for piece in pieces[:6]:
        leaf = params
        for key in piece.path.split("/"):
            leaf = leaf[key]
        np.testing.assert_array_equal(np.asarray(leaf)[piece.index], piece.array)


def _paths(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _paths(v, prefix + (k,))
        else:
            yield prefix + (k,)


def test_bf16_export_loads_in_transformers(case, sharded, tmp_path):
    hf.save(sharded, tmp_path, dtype="bfloat16")
    assert SafetensorsDir(tmp_path).tensors["model.embed_tokens.weight"].dtype.name == "bfloat16"
    assert os.path.exists(tmp_path / "config.json")
    assert relative_error(transformers_logits(str(tmp_path), case.tokens), case.reference) < 0.05


def test_verify_cli_passes_and_fails_by_tolerance(case, capsys):
    from jaxtrain.hf import verify

    assert verify.main([case.dir, "--length=8"]) == 0
    out = capsys.readouterr().out
    assert "max_relative_error" in out and "kl_divergence" in out and "top5_agreement" in out and "PASS" in out
    assert verify.main([case.dir, "--length=8", "--tolerance=1e-12"]) == 1


def test_load_sets_compute_dtype_and_keeps_float32_params(case):
    model = hf.load(case.dir, dtype="bfloat16")
    assert model.config.dtype == "bfloat16"
    assert {leaf.dtype for leaf in jax.tree.leaves(nnx.to_pure_dict(nnx.state(model)))} == {np.dtype("float32")}


def test_bf16_checkpoint_imports_exactly_and_exports_byte_equal(tmp_path):
    from jaxtrain.hf.exporter import ExportPlan, write_hf_dir
    from jaxtrain.hf.memory_check import RandomRows
    from jaxtrain.hf.saving import ParamsSource
    from jaxtrain.hf.trees import unflatten
    from jaxtrain.models.llama import LlamaConfig

    config = LlamaConfig(vocab_size=64, embed=32, layers=2, heads=4, kv_heads=2, mlp=48)
    plan = ExportPlan(hf.family_for_config(config), config, dtype="bfloat16")
    write_hf_dir(plan, RandomRows(plan), str(tmp_path / "bf16"))
    imported = hf.import_plan(tmp_path / "bf16")
    params = {path: imported.read_region(path, (slice(None),) * len(leaf.shape))
              for path, leaf in imported.leaves.items()}
    assert {p.dtype for p in params.values()} == {np.dtype("float32")}
    write_hf_dir(plan, ParamsSource(unflatten(params)), str(tmp_path / "again"))
    before, after = SafetensorsDir(tmp_path / "bf16"), SafetensorsDir(tmp_path / "again")
    assert all(before.read(n).tobytes() == after.read(n).tobytes() for n in before.tensors)
