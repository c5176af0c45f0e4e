"""Long context memory, compile-only (XLA's per-device temp memory of the whole train step):
attention and the Mamba scan grow linearly in length, and the context axis divides them."""
import dataclasses

import pytest

from jaxtrain.planner.layout_bench import bench_layout
from jaxtrain.training.config import Experiment, TrainConfig
from jaxtrain.data.packing import DataConfig
from jaxtrain.training.optim import OptimizerConfig
from jaxtrain.training.parallel_plan import ParallelPlan
from jaxtrain.pipeline.config import PipelineConfig
from jaxtrain.meshes.mesh import MeshConfig
from jaxtrain.models.layers.mamba2 import SSMConfig
from jaxtrain.models.llama import LlamaConfig
from jaxtrain.models.mamba2 import Mamba2Config

pytestmark = [pytest.mark.slow]

MODELS = {
    "llama": LlamaConfig(vocab_size=96, embed=64, layers=2, heads=4, kv_heads=2, mlp=128),
    "mamba2": Mamba2Config(vocab_size=96, embed=64, layers=2,
                           ssm=SSMConfig(heads=4, head_dim=16, state=16, groups=1, chunk_size=256)),
}


def temp_gib(model, context: int, length: int) -> float:
    """Per-device temp of one train step on 16 devices: `context` x data, one row per data rank."""
    data = 16 // context
    exp = Experiment(model=model, mesh=MeshConfig(context=context, data=data),
                     train=TrainConfig(global_batch=data, seq_len=length),
                     optimizer=OptimizerConfig(), pipeline=PipelineConfig(), data=DataConfig())
    return bench_layout(exp, ParallelPlan.from_experiment(exp), steps=0, compile_only=True)["temp_gb"]


# the Mamba-2 model runs in `make test-extended` (the suite's budget; tests/test_context_mamba.py
# keeps the mixer's per-device memory under context parallelism in the suite)
@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.extended] if name == "mamba2" else [])
                                  for name in sorted(MODELS)])
def test_temp_memory_is_linear_in_length_and_divided_by_context(name):
    model = MODELS[name]
    short, long = temp_gib(model, 4, 16384), temp_gib(model, 4, 65536)
    assert long <= 4.5 * short, (short, long)  # the materialized scores would give 16x
    whole, split = temp_gib(model, 1, 32768), temp_gib(model, 4, 32768)
    assert split <= 0.3 * whole, (whole, split)


def test_materialized_attention_is_what_grows_quadratically():
    """The check above can fail: the reference implementation's temp grows ~16x for 4x length."""
    from jaxtrain.models.layers.attention_impl import MaterializedAttention
    model = dataclasses.replace(MODELS["llama"], attention=MaterializedAttention())
    assert temp_gib(model, 4, 8192) > 8 * temp_gib(model, 4, 2048)
