"""No involuntary full rematerialization: XLA's SPMD partitioner compiles tiny MLA (DeepSeek-V2)
train steps on the layouts that combined context with pipeline or sequence parallelism without
replicating a tensor it cannot reshard ("Involuntary full rematerialization", a C++ warning on
stderr while compiling). Compile only; XLA's own log is the evidence, read from fd 2.

What replicated (models/layers/embed.py, models/causal_lm.py):
- pipeline x data x context, ZeRO-1: the token embeddings' gradient [microbatches, batch,
  length, embed], scattered into a table gradient split over `embed` like the optimizer state;
- data x context x tensor, `fsdp_sp`: the embedding lookup from the FSDP-split table, and the
  layers' saved inputs and incoming gradients, asked for split over `embed` by the weight
  gradients of the first and last matmuls (and the LM head).
The pipeline layout runs in the `full_size` lane (make test-full-size): a pipeline compile is slow.
"""
import pytest

from jaxtrain.planner.layout_bench import bench_layout
from jaxtrain.data.packing import DataConfig
from jaxtrain.pipeline.config import PipelineConfig
from jaxtrain.training.config import Experiment, TrainConfig
from jaxtrain.training.optim import OptimizerConfig
from jaxtrain.training.parallel_plan import ParallelPlan
from jaxtrain.meshes.mesh import MeshConfig
from jaxtrain.models.deepseek import DeepSeekConfig

pytestmark = [pytest.mark.slow]

WARNING = "Involuntary full rematerialization"
# Two dense MLA layers (one per pipeline stage): the replicated tensors were outside MLA.
MODEL = DeepSeekConfig(vocab_size=64, embed=64, layers=2, first_k_dense=2, heads=4, kv_lora_rank=32,
                       qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mlp=128)
LAYOUTS = [
    # Reaches every line of the fix (each reverted alone fails it): ~10 s.
    "data=2,context=2,tensor=4,rules=fsdp_sp",
    # The layout; a pipeline compile (~20 s on 2 loaded cores) is too slow for `make test`.
    pytest.param("pipeline=2,data=4,context=2,rules=zero1+experts_folded,microbatches=2", marks=pytest.mark.full_size),
]


@pytest.mark.parametrize("spec", LAYOUTS)
def test_mla_layout_compiles_without_involuntary_rematerialization(spec, capfd):
    exp = Experiment(model=MODEL, mesh=MeshConfig(), train=TrainConfig(global_batch=16, seq_len=32),
                     optimizer=OptimizerConfig(), pipeline=PipelineConfig(), data=DataConfig())
    capfd.readouterr()  # only this compile's log
    result = bench_layout(exp, ParallelPlan.from_experiment(exp).with_spec(spec), steps=0, compile_only=True)
    log = capfd.readouterr().err
    assert result["temp_gb"] > 0  # it compiled
    replicated = [line[:400] for line in log.splitlines() if WARNING in line]
    assert not replicated, "\n".join(replicated)
