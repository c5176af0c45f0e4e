"""Checkpoints stay canonical under a pipeline: a run with pipeline=2 saves at steps 3, 6 and 9;
restoring its step 3 at pipeline=1 and at pipeline=4 continues with the losses and parameters
of the uninterrupted pipeline=2 run, and so does the reverse: the pipeline=1 run's own step-6
checkpoint restored at pipeline=2 (params, optimizer state, step and data iterator all
restored)."""
import dataclasses
import shutil

import jax
import numpy as np
import pytest

from helpers import TINY_LLAMA, assert_finite, assert_trees_close
from jaxtrain.training.config import Experiment, TrainConfig
from jaxtrain.training.run_configs import CheckpointConfig, ObserveConfig
from jaxtrain.data.packing import DataConfig
from jaxtrain.pipeline.config import PipelineConfig
from jaxtrain.training.trainer import Trainer
from jaxtrain.meshes.mesh import MeshConfig
from jaxtrain.meshes.pipeline_schedules import GPipe, Interleaved
from pipeline_helpers import PIPELINE_OPT

pytestmark = [pytest.mark.slow]

LLAMA4 = dataclasses.replace(TINY_LLAMA, layers=4, vocab_size=320)  # byte tokens need >= 259 ids
STEPS, EVERY = 9, 3


def experiment(mesh: MeshConfig, pipeline: PipelineConfig) -> Experiment:
    train = TrainConfig(steps=STEPS, global_batch=16, seq_len=16, microbatches=4, rules="dp")
    return Experiment(model=LLAMA4, mesh=mesh, train=train, data=DataConfig(), optimizer=PIPELINE_OPT,
                      pipeline=pipeline, checkpoint=CheckpointConfig(checkpoint_every=EVERY),
                      observe=ObserveConfig(eval_every=0, eval_batches=1, log_every=100))


def run(mesh: MeshConfig, pipeline: PipelineConfig, workdir):
    trainer = Trainer(experiment(mesh, pipeline), str(workdir))
    history = trainer.run()
    params = jax.device_get(trainer.canonical(trainer.final_state)["params"])
    assert_finite(([h["loss"] for h in history], params), "losses and params")  # NaN == NaN would pass
    return history, params


def resume_from(source, step: int, workdir, mesh: MeshConfig, pipeline: PipelineConfig):
    """Continues `source`'s checkpoint `step` in a fresh workdir, as if that run had stopped there."""
    shutil.copytree(source / "checkpoints" / str(step), workdir / "checkpoints" / str(step))
    history, params = run(mesh, pipeline, workdir)
    assert [h["step"] for h in history] == list(range(step + 1, STEPS + 1))
    return [h["loss"] for h in history], params


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Nine uninterrupted steps at pipeline=2 (interleaved)."""
    workdir = tmp_path_factory.mktemp("straight")
    history, params = run(MeshConfig(pipeline=2, data=4, tensor=2), PipelineConfig(schedule=Interleaved(2)), workdir)
    return workdir, [h["loss"] for h in history], params


@pytest.fixture(scope="module")
def on_pipeline1(straight, tmp_path_factory):
    """Steps 4-9 at pipeline=1 from the pipeline=2 checkpoint of step 3 (saving 6 and 9 itself)."""
    workdir = tmp_path_factory.mktemp("pipeline1")
    return (workdir,) + resume_from(straight[0], 3, workdir, MeshConfig(pipeline=1, data=4, tensor=4), None)


def test_pipeline2_checkpoint_resumes_at_pipeline1(straight, on_pipeline1):
    _, losses, params = straight
    _, resumed_losses, resumed_params = on_pipeline1
    np.testing.assert_allclose(resumed_losses, losses[3:], rtol=1e-5)
    assert_trees_close(resumed_params, params, rtol=1e-4, atol=1e-4)


def test_pipeline2_checkpoint_resumes_at_pipeline4(straight, tmp_path):
    workdir, losses, params = straight
    resumed_losses, resumed_params = resume_from(workdir, 3, tmp_path, MeshConfig(pipeline=4, data=2, tensor=2),
                                                 PipelineConfig(schedule=GPipe()))
    np.testing.assert_allclose(resumed_losses, losses[3:], rtol=1e-5)
    assert_trees_close(resumed_params, params, rtol=1e-4, atol=1e-4)


def test_pipeline1_checkpoint_resumes_at_pipeline2(straight, on_pipeline1, tmp_path):
    _, losses, params = straight
    resumed_losses, resumed_params = resume_from(on_pipeline1[0], 6, tmp_path, MeshConfig(pipeline=2, data=2, tensor=4),
                                                 PipelineConfig(schedule=GPipe()))
    np.testing.assert_allclose(resumed_losses, losses[6:], rtol=1e-5)
    assert_trees_close(resumed_params, params, rtol=1e-4, atol=1e-4)
