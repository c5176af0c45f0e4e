"""Bad HF input fails before anything is built or written, with a message naming the tensor,
field or file."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxtrain import hf
from jaxtrain.cli import convert
from jaxtrain.hf.errors import HFCheckpointError, HFConfigError
from jaxtrain.hf.memory_check import write_random_hf_dir
from jaxtrain.models.llama import LlamaConfig

pytestmark = [pytest.mark.fast]

TINY = LlamaConfig(vocab_size=64, embed=32, layers=2, heads=4, kv_heads=2, mlp=48)


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("good"))
    write_random_hf_dir(TINY, directory)
    return directory


@pytest.fixture
def bad_dir(good_dir, tmp_path):
    directory = str(tmp_path / "bad")
    shutil.copytree(good_dir, directory)
    return directory


def edit_tensors(directory, edit):
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def edit_config(directory, **changes):
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        raw = json.load(f)
    raw.update(changes)
    with open(path, "w") as f:
        json.dump(raw, f)


def test_good_dir_loads(good_dir):
    assert hf.import_plan(good_dir).config.layers == 2


def test_missing_tensor(bad_dir):
    edit_tensors(bad_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(HFCheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        hf.load(bad_dir)


def test_wrong_shape(bad_dir):
    edit_tensors(bad_dir, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((8, 32), np.float32)}))
    with pytest.raises(HFCheckpointError) as err:
        hf.load(bad_dir)
    message = str(err.value)
    assert "'model.layers.0.self_attn.k_proj.weight' has shape [8, 32]" in message and "[16, 32]" in message


def test_unexpected_tensor_is_an_error_but_old_rope_caches_are_ignored(bad_dir):
    edit_tensors(bad_dir, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)}))
    hf.import_plan(bad_dir)
    edit_tensors(bad_dir, lambda t: t.update({"model.layers.0.mystery.weight": np.ones(4, np.float32)}))
    with pytest.raises(HFCheckpointError, match=r"unexpected tensor\(s\) \['model\.layers\.0\.mystery\.weight'\]"):
        hf.import_plan(bad_dir)


def test_unknown_model_type(bad_dir):
    edit_config(bad_dir, model_type="gpt_neox")
    with pytest.raises(HFConfigError, match=r"model_type='gpt_neox' is not supported \(supported: .*'llama'.*\)"):
        hf.load(bad_dir)


def test_unsupported_config_field(bad_dir):
    edit_config(bad_dir, hidden_act="gelu_new")
    with pytest.raises(HFConfigError, match=r"config\.json: hidden_act='gelu_new' is not supported"):
        hf.load(bad_dir)


def test_truncated_safetensors_file(bad_dir):
    path = os.path.join(bad_dir, "model.safetensors")
    os.truncate(path, os.path.getsize(path) - 100)
    with pytest.raises(HFCheckpointError, match=r"model\.safetensors: not a readable safetensors file, truncated"):
        hf.load(bad_dir)


def test_shard_listed_in_index_is_missing(good_dir, tmp_path):
    directory = str(tmp_path / "sharded")
    write_random_hf_dir(TINY, directory, max_shard_bytes=20_000)
    shard = sorted(f for f in os.listdir(directory) if f.startswith("model-"))[1]
    os.remove(os.path.join(directory, shard))
    with pytest.raises(HFCheckpointError, match=f"safetensors file .*{shard} is missing"):
        hf.import_plan(directory)


def test_convert_cli_reports_and_writes_nothing(bad_dir, tmp_path, capsys):
    edit_tensors(bad_dir, lambda t: t.pop("model.norm.weight"))
    workdir = tmp_path / "work"
    assert convert.main([f"--hf_dir={bad_dir}", f"--workdir={workdir}"]) == 2
    assert "error:" in capsys.readouterr().err and not workdir.exists()


def test_convert_refuses_a_workdir_with_checkpoints(good_dir, tmp_path, capsys):
    os.makedirs(tmp_path / "checkpoints" / "7")
    assert convert.main([f"--hf_dir={good_dir}", f"--workdir={tmp_path}"]) == 2
    assert "already holds step(s) ['7']" in capsys.readouterr().err
