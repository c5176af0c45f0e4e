"""A blended run stopped after 2 steps and resumed on another layout: each step's per-source
token counts in metrics.jsonl equal the trained tokens of that source's rows in the
uninterrupted data iterator (so the resume also continued the blend where it stopped). That
the blended iterator resumes at any step on any process count is tests/test_blend.py's; that a
resumed run equals a straight one given the same batches is tests/test_resume.py's."""
import json

import jax
import pytest

from helpers import TINY_LLAMA_BYTES, TINY_OPT, assert_finite
from jaxtrain.data.packing import DataConfig, make_train_iterator
from jaxtrain.training.config import Experiment, TrainConfig
from jaxtrain.training.run_configs import CheckpointConfig, ObserveConfig
from jaxtrain.training.trainer import Trainer
from meshes.mesh import MeshConfig

pytestmark = [pytest.mark.slow]

STEPS, BATCH, SEQ = 4, 16, 32


@pytest.fixture(scope="module")
def blend(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpora")
    paths = []
    for name, words, count in (("prose", "the cat sat on a mat", 30), ("code", "def f(x): return x + 1", 12)):
        path = root / f"{name}.txt"
        path.write_text("\n\n".join(f"{words} {i}" for i in range(count)), encoding="utf-8")
        paths.append(str(path))
    return (0.75, paths[0], 0.25, paths[1])


def experiment(blend, mesh: MeshConfig) -> Experiment:
    train = TrainConfig(steps=STEPS, global_batch=BATCH, seq_len=SEQ)
    data = DataConfig(blend=blend, eval_files=(blend[1],))
    return Experiment(model=TINY_LLAMA_BYTES, mesh=mesh, train=train, data=data, optimizer=TINY_OPT,
                      checkpoint=CheckpointConfig(checkpoint_every=0, async_checkpoint=False),
                      observe=ObserveConfig(eval_every=0, eval_batches=1, log_every=100))


def test_blended_run_counts_tokens_per_source_across_a_resume(blend, tmp_path):
    resumed_dir = tmp_path / "resumed"
    two = jax.devices()[:2]  # (small meshes compile fastest)
    first = Trainer(experiment(blend, MeshConfig(data=2)), str(resumed_dir), devices=two).run(stop_after=2)
    second = Trainer(experiment(blend, MeshConfig(tensor=2)), str(resumed_dir), devices=two).run()
    assert [h["step"] for h in first + second] == list(range(1, STEPS + 1))
    assert_finite([h["loss"] for h in first + second], "resumed losses")

    iterator = make_train_iterator(experiment(blend, MeshConfig(data=2)).data, seq_len=SEQ, global_batch=BATCH,
                                   seed=TrainConfig().seed)
    rows = [json.loads(line) for line in (resumed_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == list(range(1, STEPS + 1))
    for row in train_rows:
        batch = next(iterator)
        for j in range(2):
            want = float(batch["loss_mask"][batch["source_ids"] == j].sum())
            assert row[f"source_tokens_{j}"] == want, (row["step"], j)
        assert row["source_tokens_0"] > 0 and row["source_tokens_1"] > 0
