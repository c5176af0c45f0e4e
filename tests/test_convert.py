"""python -m jaxtrain.convert: HF -> checkpoint -> the trainer resumes from it with the HF
model's loss -> checkpoint -> HF again."""
from __future__ import annotations

import logging
import shutil

import gin
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from helpers import transformers_loss
from hf_tiny_models import save_tiny_llama
from jaxtrain.checkpoints.checkpointer import Checkpointer, CorruptCheckpoint
from jaxtrain.checkpoints.fingerprint import tree_fingerprints
from jaxtrain.cli import convert
from jaxtrain.training.config import Experiment, TrainConfig
from jaxtrain.training.run_configs import CheckpointConfig, ObserveConfig
from jaxtrain.data.packing import DataConfig, make_train_iterator
from jaxtrain.hf.safetensors_io import SafetensorsDir
from jaxtrain.training.optim import OptimizerConfig
from jaxtrain.training.trainer import Trainer
from jaxtrain.meshes.mesh import MeshConfig

pytestmark = [pytest.mark.slow]

SEQ_LEN, BATCH = 16, 4


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    # byte tokens (ids < 259) need vocab >= 259; heads and mlp divide tensor=4
    hf_dir = save_tiny_llama(root / "hf", seed=3, vocab_size=320, rope_parameters={"rope_type": "default",
                                                                                     "rope_theta": 10000.0})
    workdir = root / "work"
    assert convert.main([f"--hf_dir={hf_dir}", f"--workdir={workdir}"]) == 0
    # One document longer than the batch, so every row is a single sequence as transformers sees it.
    text = " ".join(f"token{i % 97}" for i in range(600))
    (root / "train.txt").write_text(text)
    (root / "valid.txt").write_text(text[:400])
    return root, hf_dir, workdir


def test_config_gin_describes_the_model(converted):
    _, hf_dir, workdir = converted
    try:
        model = convert.model_config_from_gin([str(workdir / "config.gin")])
    finally:
        gin.clear_config()
    assert (model.vocab_size, model.embed, model.heads, model.kv_heads, model.layers) == (320, 64, 8, 4, 2)
    assert (workdir / "checkpoints" / "0" / "params").is_dir()


def converted_abstract_params(workdir):
    """The converted model's parameter tree as ShapeDtypeStructs on one device."""
    from flax import nnx

    from jaxtrain.training.state import abstract_model
    try:
        model = convert.model_config_from_gin([str(workdir / "config.gin")])
    finally:
        gin.clear_config()
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one),
                        nnx.to_pure_dict(abstract_model(model)[1]))


def restore_step_0(checkpoints, abstract):
    checkpointer = Checkpointer(str(checkpoints))
    try:
        return checkpointer.restore(0, {"params": abstract})
    finally:
        checkpointer.close()


def test_converted_checkpoint_is_fingerprinted_and_verified_on_restore(converted, tmp_path):
    _, _, workdir = converted
    abstract = converted_abstract_params(workdir)
    shutil.copytree(workdir / "checkpoints" / "0", tmp_path / "checkpoints" / "0")
    manifest = Checkpointer(str(tmp_path / "checkpoints")).manifest(0)
    restored = restore_step_0(tmp_path / "checkpoints", abstract)
    # recorded block by block while streaming (numpy) == computed from the restored arrays (device)
    assert manifest["kind"] == "converted" and manifest["fingerprints"] == tree_fingerprints(restored)

    # One element changed, every file readable: only the fingerprints can tell.
    params = jax.tree.map(np.array, jax.device_get(restored["params"]))  # writable copies
    params["final_norm"]["scale"][3] += 0.5
    shutil.rmtree(tmp_path / "checkpoints" / "0" / "params")
    with ocp.StandardCheckpointer() as writer:
        writer.save(tmp_path / "checkpoints" / "0" / "params", params)
    with pytest.raises(CorruptCheckpoint, match=r"1 array\(s\) differ .*first params/final_norm/scale$"):
        restore_step_0(tmp_path / "checkpoints", abstract)


def test_restoring_a_converted_checkpoint_logs_no_warning(converted, caplog):
    """The restore generate and eval run on a converted workdir: Orbax finds every metadata file
    it reads (it logs a missing one as a WARNING on the `absl` logger)."""
    _, _, workdir = converted
    abstract = converted_abstract_params(workdir)
    with caplog.at_level(logging.WARNING):
        restored = restore_step_0(workdir / "checkpoints", abstract)
    assert jax.tree.structure(restored["params"]) == jax.tree.structure(abstract)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_fingerprints_missing_from_the_committed_metadata_are_put_in_after_the_save(converted, tmp_path):
    """The fallback should an Orbax release copy the manifest before the arrays are written."""
    import json

    from jaxtrain.hf.checkpoint_streaming import _check_manifest_written
    _, _, workdir = converted
    step_dir = tmp_path / "checkpoints" / "0"
    shutil.copytree(workdir / "checkpoints" / "0", step_dir)
    metadata = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())
    manifest = dict(metadata["custom_metadata"]["jaxtrain"])
    del metadata["custom_metadata"]["jaxtrain"]["fingerprints"]
    (step_dir / "_CHECKPOINT_METADATA").write_text(json.dumps(metadata))
    _check_manifest_written(str(step_dir), manifest)
    restored = restore_step_0(tmp_path / "checkpoints", converted_abstract_params(workdir))  # verified again
    assert Checkpointer(str(tmp_path / "checkpoints")).manifest(0)["fingerprints"] == tree_fingerprints(restored)


def test_converted_checkpoint_with_a_flipped_byte_is_corrupt(converted, tmp_path):
    _, _, workdir = converted
    shutil.copytree(workdir / "checkpoints" / "0", tmp_path / "checkpoints" / "0")
    data_files = [p for p in (tmp_path / "checkpoints" / "0" / "params").rglob("*") if p.is_file()]
    largest = max(data_files, key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    data[len(data) // 2] ^= 0x01
    largest.write_bytes(bytes(data))
    # a fingerprint mismatch, or a chunk that no longer decodes
    with pytest.raises(CorruptCheckpoint, match="step 0: "):
        restore_step_0(tmp_path / "checkpoints", converted_abstract_params(workdir))


def test_training_resumes_with_the_hf_models_loss(converted):
    root, hf_dir, workdir = converted
    try:
        model = convert.model_config_from_gin([str(workdir / "config.gin")])
    finally:
        gin.clear_config()
    data = DataConfig(train_files=(str(root / "train.txt"),), eval_files=(str(root / "valid.txt"),))
    exp = Experiment(model=model, mesh=MeshConfig(data=4, tensor=4), data=data,
                     train=TrainConfig(steps=1, global_batch=BATCH, seq_len=SEQ_LEN),
                     checkpoint=CheckpointConfig(checkpoint_every=0, async_checkpoint=False),
                     observe=ObserveConfig(eval_batches=1, eval_every=0, log_every=1),
                     optimizer=OptimizerConfig(warmup_steps=0))
    history = Trainer(exp, str(workdir)).run()
    batch = next(make_train_iterator(data, seq_len=SEQ_LEN, global_batch=BATCH, seed=exp.train.seed))
    assert batch["segment_ids"].max() == 1  # one document per row: plain causal attention is exact
    assert history[0]["loss"] == pytest.approx(transformers_loss(hf_dir, batch), rel=1e-5)


def test_export_round_trip_and_trained_step(converted, tmp_path):
    _, hf_dir, workdir = converted
    assert convert.main([f"--workdir={workdir}", f"--hf_out={tmp_path / 'step0'}", "--step=0"]) == 0
    before, after = SafetensorsDir(hf_dir), SafetensorsDir(tmp_path / "step0")
    assert sorted(before.tensors) == sorted(after.tensors)
    assert all(before.read(n).tobytes() == after.read(n).tobytes() for n in before.tensors)
    # the latest step, after training, exports too and transformers reads it
    assert convert.main([f"--workdir={workdir}", f"--hf_out={tmp_path / 'latest'}", "--hf_dtype=bfloat16"]) == 0
    trained = SafetensorsDir(tmp_path / "latest")
    assert trained.tensors["model.norm.weight"].dtype.name == "bfloat16"
    assert not np.array_equal(trained.read("model.norm.weight").astype(np.float32), before.read("model.norm.weight"))
