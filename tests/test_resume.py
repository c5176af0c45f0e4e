"""Resume: 6 steps straight equal 3 steps + restart + 3 steps (params, optimizer, step and
data iterator all restored), also when the restart uses another mesh layout.

The model trains on the corpus (byte tokens, 259 ids), so its vocabulary covers them: with
fewer ids every run is NaN and NaN compares equal to NaN whatever restore does. Checked by
breaking restore on purpose: skipping the data iterator, or starting the optimizer state
fresh, fails both cases."""
import jax
import numpy as np
import pytest

from helpers import TINY_LLAMA_BYTES, TINY_OPT, assert_finite, assert_trees_close
from jaxtrain.training.config import Experiment, TrainConfig
from jaxtrain.training.run_configs import CheckpointConfig, ObserveConfig
from jaxtrain.data.packing import DataConfig
from jaxtrain.data.tokenizer import ByteTokenizer
from jaxtrain.training.trainer import Trainer
from jaxtrain.meshes.mesh import MeshConfig

pytestmark = [pytest.mark.slow]


def experiment(mesh: MeshConfig, rules="dp") -> Experiment:
    train = TrainConfig(steps=6, global_batch=16, seq_len=32, rules=rules)
    return Experiment(model=TINY_LLAMA_BYTES, mesh=mesh, train=train, data=DataConfig(), optimizer=TINY_OPT,
                      checkpoint=CheckpointConfig(checkpoint_every=0, async_checkpoint=True),
                      observe=ObserveConfig(eval_every=0, eval_batches=1, log_every=100))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    assert TINY_LLAMA_BYTES.vocab_size >= ByteTokenizer.vocab_size
    trainer = Trainer(experiment(MeshConfig(data=8, tensor=2)), str(tmp_path_factory.mktemp("straight")))
    history = trainer.run()
    losses, params = [h["loss"] for h in history], jax.device_get(trainer.final_state.params)
    assert_finite(losses, "straight losses")
    assert_finite(params, "straight params")
    assert losses[-1] < losses[0]  # it trains: later steps depend on the optimizer state
    return losses, params


@pytest.mark.parametrize("second_mesh, rules", [
    (MeshConfig(data=8, tensor=2), "dp"),
    (MeshConfig(data=2, context=2, tensor=4), "fsdp"),
])
def test_restart_continues_identically(straight, tmp_path, second_mesh, rules):
    losses, params = straight
    first = Trainer(experiment(MeshConfig(data=8, tensor=2)), str(tmp_path)).run(stop_after=3)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["3"]
    second_trainer = Trainer(experiment(second_mesh, rules), str(tmp_path))
    second = second_trainer.run()
    assert [h["step"] for h in first + second] == [1, 2, 3, 4, 5, 6]
    resumed = [h["loss"] for h in first + second]
    assert_finite(resumed, "resumed losses")
    np.testing.assert_allclose(resumed, losses, rtol=1e-5)
    assert_trees_close(jax.device_get(second_trainer.final_state.params), params, rtol=1e-4, atol=1e-4)


def test_a_trainer_that_ran_restarts_its_data_with_a_data_reset(tmp_path):
    """A resume that resets the data (or restores a checkpoint without it) starts the iterator at
    its first batch, as the count does: also in a Trainer whose iterator earlier runs moved on.
    Compared with a fresh Trainer resuming a copy of the same checkpoint."""
    import dataclasses
    import shutil

    exp = experiment(MeshConfig(data=8, tensor=2))
    exp = dataclasses.replace(exp, train=dataclasses.replace(exp.train, steps=4),
                              checkpoint=dataclasses.replace(exp.checkpoint, reset_on_resume=("data",)))
    ran = Trainer(exp, str(tmp_path / "ran"))
    ran.run(stop_after=2)
    shutil.copytree(tmp_path / "ran", tmp_path / "fresh")
    again = [h["loss"] for h in ran.run()]
    fresh = [h["loss"] for h in Trainer(exp, str(tmp_path / "fresh")).run()]
    assert_finite(again, "losses after the reset")
    assert len(again) == len(fresh) == 2
    np.testing.assert_array_equal(again, fresh)
