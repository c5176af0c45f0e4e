"""Checkpoints stay canonical under a pipeline: a run with pipeline=2 saves at step 3; restoring
that checkpoint at pipeline=1 and at pipeline=4 continues with the losses and parameters of the
uninterrupted pipeline=2 run (params, optimizer state, step and data iterator all restored)."""
import dataclasses
import shutil

import jax
import numpy as np
import pytest

from helpers import TINY_LLAMA, assert_trees_close
from jaxtrain.config import Experiment, TrainConfig
from jaxtrain.data import DataConfig
from jaxtrain.pipeline_config import PipelineConfig
from jaxtrain.trainer import Trainer
from meshes.mesh import MeshConfig
from meshes.pipeline_schedules import GPipe, Interleaved
from pipeline_helpers import PIPELINE_OPT

LLAMA4 = dataclasses.replace(TINY_LLAMA, layers=4, vocab_size=320)  # byte tokens need >= 259 ids


def experiment(mesh: MeshConfig, pipeline: PipelineConfig) -> Experiment:
    train = TrainConfig(steps=6, global_batch=16, seq_len=16, microbatches=4, eval_every=0, eval_batches=1,
                        checkpoint_every=3, rules="dp", log_every=100)
    return Experiment(model=LLAMA4, mesh=mesh, train=train, data=DataConfig(), optimizer=PIPELINE_OPT,
                      pipeline=pipeline)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Six uninterrupted steps at pipeline=2 (interleaved), saving at steps 3 and 6."""
    workdir = tmp_path_factory.mktemp("straight")
    trainer = Trainer(experiment(MeshConfig(pipeline=2, data=4, tensor=2), PipelineConfig(schedule=Interleaved(2))),
                      str(workdir))
    history = trainer.run()
    return workdir, [h["loss"] for h in history], jax.device_get(trainer.canonical(trainer.final_state)["params"])


@pytest.mark.parametrize("mesh", [MeshConfig(pipeline=1, data=4, tensor=4), MeshConfig(pipeline=4, data=2, tensor=2)],
                         ids=["pipeline1", "pipeline4"])
def test_pipeline2_checkpoint_resumes_on_another_pipeline(straight, tmp_path, mesh):
    workdir, losses, params = straight
    shutil.copytree(workdir / "checkpoints" / "3", tmp_path / "checkpoints" / "3")  # as if stopped at step 3
    trainer = Trainer(experiment(mesh, PipelineConfig(schedule=GPipe())), str(tmp_path))
    resumed = trainer.run()
    assert [h["step"] for h in resumed] == [4, 5, 6]
    np.testing.assert_allclose([h["loss"] for h in resumed], losses[3:], rtol=1e-5)
    assert_trees_close(jax.device_get(trainer.canonical(trainer.final_state)["params"]), params, rtol=1e-4, atol=1e-4)
