"""Everything a user sets, as gin configurables with defaults that run on a laptop CPU."""
from __future__ import annotations

import dataclasses
from typing import Any

import gin

from jaxtrain.data import DataConfig
from jaxtrain.mesh_configurable import GinMeshConfig
from jaxtrain.optim import OptimizerConfig
from jaxtrain.pipeline_config import PipelineConfig
from meshes.context_layout import AllGatherKV, ContextParallel, Contiguous, LoadBalanced, RingKV
from meshes.mesh_config import MeshConfig
from models.layers.attention_impl import AutoAttention, BlockwiseAttention, MaterializedAttention, PallasAttention
from models.layers.rope import Llama3Scaling, LinearScaling, NoScaling, YarnScaling
from models.deepseek import DeepSeekConfig
from models.layers.router import RouterConfig
from models.layers.mamba2 import SSMConfig
from models.llama import LlamaConfig
from models.mamba2 import Mamba2Config
from models.nemotron_h import NemotronHConfig

for _cls in (LlamaConfig, DeepSeekConfig, RouterConfig, NoScaling, LinearScaling, Llama3Scaling, YarnScaling,
             NemotronHConfig, Mamba2Config, SSMConfig, AutoAttention, BlockwiseAttention, MaterializedAttention,
             PallasAttention):
    gin.external_configurable(_cls, module="models")
for _cls in (ContextParallel, Contiguous, LoadBalanced, RingKV, AllGatherKV):
    gin.external_configurable(_cls, module="meshes")
GinDataConfig = gin.external_configurable(DataConfig, name="DataConfig", module="jaxtrain")
GinOptimizerConfig = gin.external_configurable(OptimizerConfig, name="OptimizerConfig", module="jaxtrain")


@gin.configurable(module="jaxtrain")
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    global_batch: int = 8
    seq_len: int = 128
    microbatches: int = 1  # gradient accumulation steps per optimizer step
    seed: int = 0
    rules: str = "dp"  # rule table in meshes/rules.py: dp | zero1 | fsdp | dp_sp | fsdp_sp
    z_loss: float = 0.0
    loss_chunk: int = 1024  # tokens of sequence per chunk in the chunked cross-entropy
    log_every: int = 10
    eval_every: int = 100  # 0 disables periodic eval (a final eval still runs)
    eval_batches: int = 4
    checkpoint_every: int = 100  # 0: only at the end
    keep_checkpoints: int = 3
    async_checkpoint: bool = True
    peak_flops_per_device: float | None = None  # overrides the device table for MFU
    # The sequence over the `context` axis: layout (LoadBalanced | Contiguous) and how ranks see
    # each other's keys (RingKV | AllGatherKV); meshes/context_layout.py.
    context_parallel: ContextParallel = ContextParallel()
    # resilience (jaxtrain/resilience/): a missing or dead peer, or a failure reported by one, ends
    # every process within peer_timeout_s; a step slower than hang_factor x the median step (and
    # than hang_min_s) dumps every thread's stack and exits.
    peer_timeout_s: float = 60.0
    hang_factor: float = 10.0
    hang_min_s: float = 120.0

    def validate(self) -> None:
        for name in ("steps", "global_batch", "seq_len", "microbatches", "log_every", "eval_batches",
                     "keep_checkpoints", "loss_chunk"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TrainConfig.{name} must be positive, got {getattr(self, name)}")
        for name in ("eval_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.global_batch % self.microbatches:
            raise ValueError(f"TrainConfig.global_batch={self.global_batch} is not divisible by "
                             f"microbatches={self.microbatches}")


@gin.configurable(module="jaxtrain")
@dataclasses.dataclass(frozen=True)
class Experiment:
    model: Any = None
    mesh: MeshConfig | None = None
    train: TrainConfig | None = None
    data: DataConfig | None = None
    optimizer: OptimizerConfig | None = None
    pipeline: PipelineConfig | None = None  # used when MeshConfig.pipeline > 1


def load_experiment() -> Experiment:
    """The experiment the parsed gin config describes, unbound parts taking their defaults."""
    exp = Experiment()
    if exp.model is None:
        raise ValueError("no model configured: bind Experiment.model (e.g. `Experiment.model = @LlamaConfig()`)")
    return dataclasses.replace(
        exp,
        mesh=exp.mesh or GinMeshConfig(),
        train=exp.train or TrainConfig(),
        data=exp.data or GinDataConfig(),
        optimizer=exp.optimizer or GinOptimizerConfig(),
        pipeline=exp.pipeline or PipelineConfig(),
    )


def parse_gin(files, bindings) -> None:
    gin.parse_config_files_and_bindings(list(files), list(bindings), finalize_config=False)
