"""An empty DataConfig.eval_files means no evaluation: the run trains and writes no eval rows, and
asking its Trainer to evaluate names the field. (make_eval_batches' own error for an empty list:
tests/test_data.py.)"""
import json

import jax
import pytest

from helpers import TINY_LLAMA_BYTES, TINY_OPT, assert_finite
from jaxtrain.data.packing import DataConfig
from jaxtrain.training.config import Experiment, TrainConfig
from jaxtrain.training.run_configs import CheckpointConfig, ObserveConfig
from jaxtrain.training.trainer import Trainer
from jaxtrain.meshes.mesh import MeshConfig

pytestmark = [pytest.mark.slow]  # a whole (tiny) training run

STEPS = 2


def test_a_run_with_no_eval_files_trains_and_evaluates_nothing(tmp_path, capsys):
    # eval_every=1: without the empty list every step, and the end, would evaluate
    exp = Experiment(model=TINY_LLAMA_BYTES, mesh=MeshConfig(data=1),
                     train=TrainConfig(steps=STEPS, global_batch=2, seq_len=16),
                     data=DataConfig(eval_files=[]),  # a list, as gin hands it over
                     optimizer=TINY_OPT, checkpoint=CheckpointConfig(checkpoint_every=0, async_checkpoint=False),
                     observe=ObserveConfig(eval_every=1, eval_batches=1, log_every=1))
    trainer = Trainer(exp, str(tmp_path / "run"), devices=jax.devices()[:1])
    history = trainer.run()
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    assert_finite([h["loss"] for h in history], "losses")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["kind"]) for r in rows] == [(s, "train") for s in range(1, STEPS + 1)]
    assert "jaxtrain: no evaluation (DataConfig.eval_files is empty)" in capsys.readouterr().out

    with pytest.raises(ValueError, match=r"DataConfig\.eval_files is empty"):
        trainer.evaluate(trainer.final_state.params)

