"""A blended run stopped after 2 steps and resumed on another layout: each step's per-source
token counts in metrics.jsonl equal the trained targets of that source's rows as the reference
rules give them (each source's documents packed by the reference packer in its seeded orders,
each global sample's source and rank from the assignment written out in exact fractions), so
the resume also continued the blend where it stopped. That the blended iterator resumes at any
step on any process count is tests/test_blend.py's; that a resumed run equals a straight one
given the same batches is tests/test_resume.py's."""
import json

import jax
import numpy as np
import pytest

from helpers import TINY_LLAMA_BYTES, TINY_OPT, assert_finite
from jaxtrain.data.packing import DataConfig
from jaxtrain.training.config import Experiment, TrainConfig
from jaxtrain.training.run_configs import CheckpointConfig, ObserveConfig
from jaxtrain.training.trainer import Trainer
from jaxtrain.meshes.mesh import MeshConfig
from data_reference import reference_blend_rows

pytestmark = [pytest.mark.slow]

STEPS, BATCH, SEQ = 4, 16, 32
BOS, EOS, PAD = 256, 257, 258  # the byte tokenizer's specials: a raw document is [bos] + UTF-8 + [eos]
SOURCES = (("prose", "the cat sat on a mat", 30, 0.75), ("code", "def f(x): return x + 1", 12, 0.25))


@pytest.fixture(scope="module")
def blend(tmp_path_factory):
    """(DataConfig.blend, each source's framed documents in file order)."""
    root = tmp_path_factory.mktemp("corpora")
    entries, documents = [], []
    for name, words, count, weight in SOURCES:
        texts = [f"{words} {i}" for i in range(count)]
        path = root / f"{name}.txt"
        path.write_text("\n\n".join(texts), encoding="utf-8")
        entries += [weight, str(path)]
        documents.append([[BOS, *t.encode("utf-8"), EOS] for t in texts])
    return tuple(entries), documents


def experiment(blend, mesh: MeshConfig) -> Experiment:
    train = TrainConfig(steps=STEPS, global_batch=BATCH, seq_len=SEQ)
    data = DataConfig(blend=blend, eval_files=(blend[1],))
    return Experiment(model=TINY_LLAMA_BYTES, mesh=mesh, train=train, data=data, optimizer=TINY_OPT,
                      checkpoint=CheckpointConfig(checkpoint_every=0, async_checkpoint=False),
                      observe=ObserveConfig(eval_every=0, eval_batches=1, log_every=100))


def test_blended_run_counts_tokens_per_source_across_a_resume(blend, tmp_path):
    entries, documents = blend
    resumed_dir = tmp_path / "resumed"
    two = jax.devices()[:2]  # (small meshes compile fastest)
    first = Trainer(experiment(entries, MeshConfig(data=2)), str(resumed_dir), devices=two).run(stop_after=2)
    second = Trainer(experiment(entries, MeshConfig(tensor=2)), str(resumed_dir), devices=two).run()
    assert [h["step"] for h in first + second] == list(range(1, STEPS + 1))
    assert_finite([h["loss"] for h in first + second], "resumed losses")

    weights = [weight for *_, weight in SOURCES]
    rows = reference_blend_rows([(docs, None, PAD) for docs in documents], weights, SEQ, TrainConfig().seed,
                                STEPS * BATCH)
    trained = np.array([sum(row["loss_mask"]) for row in rows]).reshape(STEPS, BATCH)
    source = np.array([row["source_ids"] for row in rows]).reshape(STEPS, BATCH)
    metrics = [json.loads(line) for line in (resumed_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in metrics if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == list(range(1, STEPS + 1))
    for step, row in enumerate(train_rows):
        want = [float(trained[step][source[step] == j].sum()) for j in range(len(SOURCES))]
        assert [row[f"source_tokens_{j}"] for j in range(len(SOURCES))] == want, row["step"]
        assert all(n > 0 for n in want)
