"""`python -m jaxtrain.bench step --layout ...`: each layout runs on the devices its own mesh names
(the first N of the process), whatever mesh the config itself asks for."""
import pytest
import json
import os

import gin
import jax

from jaxtrain.cli import bench
from jaxtrain.training.parallel_plan import ParallelPlan

pytestmark = [pytest.mark.slow]

# configs/default.gin (its own mesh: data=4 x tensor=2), shrunk so a step compiles in seconds
TINY = ["LlamaConfig.embed=32", "LlamaConfig.layers=1", "LlamaConfig.heads=2", "LlamaConfig.kv_heads=1",
        "LlamaConfig.mlp=64", "TrainConfig.global_batch=4", "TrainConfig.seq_len=16"]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_layout_smaller_than_the_devices_takes_a_prefix():
    devices = jax.devices()
    assert len(devices) == 16
    one = ParallelPlan().with_spec("context=1")
    assert bench.layout_devices(one) == devices[:1]
    assert bench.layout_devices(ParallelPlan().with_spec("data=4,tensor=2")) == devices[:8]
    assert bench.layout_devices(ParallelPlan().with_spec("data=16")) is None  # all of them
    assert bench.layout_devices(ParallelPlan()) is None  # data=-1 fills every device


def test_bench_runs_a_single_device_layout_of_an_8_device_config(tmp_path):
    out = tmp_path / "rows.jsonl"
    argv = ["step", f"--gin_file={REPO_ROOT}/configs/default.gin", *(f"--gin_param={p}" for p in TINY),
            "--layout", "context=1", "--layout", "data=32", "--steps", "1", "--json", str(out)]
    try:
        assert bench.main(argv) == 0
    finally:
        gin.clear_config()
    rows = {r["layout"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["context=1"]["devices"] == 1 and "error" not in rows["context=1"]
    assert rows["context=1"]["step_time_s"] > 0  # it ran, not only compiled
    assert "needs 32 devices but 16 are available" in rows["data=32"]["error"]
