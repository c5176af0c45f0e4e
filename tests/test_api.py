"""The Python API (jaxtrain/api.py): a run stepped on caller-provided batches gives the losses of
an independent single-device run, under any plan, and its checkpoints move between plans."""
import dataclasses

import jax
import numpy as np
import pytest

from helpers import TINY_LLAMA, random_packed_batch, train_losses
from jaxtrain.api import Run
from jaxtrain.training.config import TrainConfig
from jaxtrain.meshes.mesh import MeshConfig
from pipeline_helpers import PIPELINE_OPT, initial_params

pytestmark = [pytest.mark.slow]

TRAIN = TrainConfig(steps=4, global_batch=8, seq_len=16)
MODEL = dataclasses.replace(TINY_LLAMA, layers=4)


@pytest.fixture(scope="module")
def reference():
    params0 = initial_params(MODEL, seed=1)
    losses, params = train_losses(MeshConfig(data=1), model=MODEL, train=TRAIN, opt=PIPELINE_OPT, init_params=params0,
                                  devices=jax.devices()[:1], steps=3)
    return params0, losses, params


def batch(i):
    return random_packed_batch(100 + i, TRAIN.global_batch, TRAIN.seq_len, MODEL.vocab_size)


@pytest.mark.parametrize("plan", ["data=4,tensor=2,rules=fsdp", "pipeline=2,data=2,tensor=2,microbatches=2"])
def test_steps_on_caller_batches_equal_a_single_device_run(reference, plan):
    params0, want_losses, want_params = reference
    run = Run.create(MODEL, plan, train=TRAIN, optimizer=PIPELINE_OPT, params=params0)
    losses = []
    for i in range(3):
        before = run.evaluate(batch(i))["loss"]
        metrics = run.step(batch(i))
        np.testing.assert_allclose(before, metrics["loss"], rtol=1e-5)  # loss at the pre-update params
        losses.append(metrics["loss"])
    assert run.step_count == 3
    np.testing.assert_allclose(losses, want_losses, rtol=2e-5)
    got = jax.device_get(run.params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6), got, want_params)


def test_checkpoint_saved_under_one_plan_continues_under_another(reference, tmp_path):
    params0, want_losses, _ = reference
    first = Run.create(MODEL, "data=8", train=TRAIN, optimizer=PIPELINE_OPT, params=params0)
    for i in range(2):
        first.step(batch(i))
    assert first.save(str(tmp_path)) == 2
    second = Run.create(MODEL, "pipeline=2,data=2,tensor=2,microbatches=2", train=TRAIN, optimizer=PIPELINE_OPT)
    assert second.restore(str(tmp_path)) == 2 and second.step_count == 2
    np.testing.assert_allclose(second.step(batch(2))["loss"], want_losses[2], rtol=2e-5)


def test_a_partial_batch_takes_defaults_and_bad_batches_are_named():
    run = Run.create(MODEL, "data=8", train=TRAIN, optimizer=PIPELINE_OPT)
    full = batch(0)
    one_doc = {**full, "segment_ids": np.ones_like(full["segment_ids"]),
               "positions": np.broadcast_to(np.arange(16, dtype=np.int32), (8, 16)), "loss_mask": np.ones((8, 16))}
    np.testing.assert_allclose(run.evaluate({"inputs": full["inputs"], "targets": full["targets"]})["loss"],
                               run.evaluate(one_doc)["loss"], rtol=1e-6)
    with pytest.raises(ValueError, match=r"needs \['targets'\]"):
        run.step({"inputs": full["inputs"]})
    with pytest.raises(ValueError, match=r"batch\['inputs'\] has shape \(4, 16\); this run takes"):
        run.step({"inputs": full["inputs"][:4], "targets": full["targets"][:4]})
    with pytest.raises(ValueError, match="outside"):
        run.step({"inputs": full["inputs"] + MODEL.vocab_size, "targets": full["targets"]})
    with pytest.raises(ValueError, match="unknown batch keys"):
        run.step({**full, "labels": full["targets"]})
