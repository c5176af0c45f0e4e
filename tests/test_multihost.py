"""Two processes on localhost (8 simulated CPU devices each, gloo collectives) train the same
steps as one process with 16 devices: distributed init, the hybrid ICI x DCN mesh, per-process
data shards and process-local batches assembled into global arrays; also with one pipeline
stage per process, where both processes feed the same rows. A two-process checkpoint resumes
in one process (the data iterator's position comes from another process count's files)."""
import json
import shutil

import gin
import numpy as np
import pytest

from jaxtrain.training.config import load_experiment, parse_gin
from jaxtrain.cli.launch import DEFAULT_GIN
from jaxtrain.training.trainer import Trainer
from ports import reserved_port
from processes import start_train_processes, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.end_to_end]

BINDINGS = ["LlamaConfig.embed=32", "LlamaConfig.layers=2", "LlamaConfig.mlp=64", "LlamaConfig.heads=4",
            "LlamaConfig.kv_heads=2", "TrainConfig.seq_len=32",
            "ObserveConfig.eval_batches=1", "TrainConfig.steps=6", "CheckpointConfig.checkpoint_every=3", "MeshConfig.data=8"]


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """The losses of one process on 16 devices, data=8 x tensor=2 (a pipelined run with as many
    microbatches has the same losses: tests/test_pipeline_llama.py)."""
    gin.clear_config()
    parse_gin([DEFAULT_GIN], BINDINGS)
    try:
        return [h["loss"] for h in Trainer(load_experiment(), str(tmp_path_factory.mktemp("single"))).run()]
    finally:
        gin.clear_config()


@pytest.mark.parametrize("layout", [
    [],  # data=8 x 2 processes: each process feeds half the rows
    # a stage per process: `make test-extended` (the suite's budget)
    pytest.param(["MeshConfig.pipeline=2", "MeshConfig.data=4", "TrainConfig.microbatches=2"],
                 marks=pytest.mark.extended),
], ids=["data", "pipeline_across_processes"])
def test_two_processes_match_one(tmp_path, layout, single_process):
    bindings = BINDINGS + layout
    with reserved_port() as port:  # held until the coordinator has come and gone
        procs = start_train_processes(tmp_path / "multi", bindings, port)
        outputs = wait_for(procs)
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-2000:] for o in outputs)
    rows = [json.loads(line) for line in (tmp_path / "multi" / "metrics.jsonl").read_text().splitlines()]
    multi = [r["loss"] for r in rows if r["kind"] == "train"]

    assert np.isfinite(single_process).all() and np.isfinite(multi).all(), (single_process, multi)
    np.testing.assert_allclose(multi, single_process, rtol=1e-5)
    assert (tmp_path / "multi" / "checkpoints" / "3" / "data" / "process_1-of-2.json").exists()
    if layout:
        return
    # Resume the two-process run's step 3 in one process: steps 4-6 as the two processes ran them.
    shutil.copytree(tmp_path / "multi" / "checkpoints" / "3", tmp_path / "resumed" / "checkpoints" / "3")
    gin.clear_config()
    parse_gin([DEFAULT_GIN], bindings)
    try:
        resumed = Trainer(load_experiment(), str(tmp_path / "resumed")).run()
    finally:
        gin.clear_config()
    assert [h["step"] for h in resumed] == [4, 5, 6]
    np.testing.assert_allclose([h["loss"] for h in resumed], multi[3:], rtol=1e-5)
