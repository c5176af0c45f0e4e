"""Everything a user sets, as gin configurables with defaults that run on a laptop CPU."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import gin

from jaxtrain.training.config_types import check_config_types
from jaxtrain.training.device_groups import DeviceGroups
from jaxtrain.data.packing import REPO_ROOT, DataConfig
from jaxtrain.training.mesh_configurable import GinMeshConfig
from jaxtrain.training.optim import OptimizerConfig
from jaxtrain.training.parallel_plan import ParallelPlan
from jaxtrain.pipeline.config import PipelineConfig
from jaxtrain.resilience.nonfinite import Halt
from meshes.context_layout import AllGatherKV, ContextParallel, Contiguous, LoadBalanced, RingKV
from meshes.mesh_config import MeshConfig
from models.family import families

# Each model family's record registers its config and the parts its gin files name with gin
# (models/family.py); jaxtrain/resilience/nonfinite.py registers its policies itself.
families()
for _cls in (ContextParallel, Contiguous, LoadBalanced, RingKV, AllGatherKV):
    gin.external_configurable(_cls, module="meshes")
GinDataConfig = gin.external_configurable(DataConfig, name="DataConfig", module="jaxtrain")
GinOptimizerConfig = gin.external_configurable(OptimizerConfig, name="OptimizerConfig", module="jaxtrain")
GinDeviceGroups = gin.external_configurable(DeviceGroups, name="DeviceGroups", module="jaxtrain")


@gin.configurable(module="jaxtrain")
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    global_batch: int = 8
    seq_len: int = 128
    # The layout fields (rules, microbatches, context_parallel) are read through the run's
    # ParallelPlan (jaxtrain/training/parallel_plan.py), with MeshConfig and Experiment.pipeline.
    microbatches: int = 1  # gradient accumulation steps per optimizer step
    seed: int = 0
    rules: str = "dp"  # rule table in meshes/rules.py: dp | zero1 | fsdp | dp_sp | fsdp_sp
    z_loss: float = 0.0
    loss_chunk: int = 1024  # tokens of sequence per chunk in the chunked cross-entropy
    log_every: int = 10
    eval_every: int = 100  # 0 disables periodic eval (a final eval still runs)
    eval_batches: int = 4
    # Greedy samples of sample_prompts every sample_every steps (0: none), sample_tokens new tokens
    # each, to metrics.jsonl (kind "sample") and TensorBoard's text tab (jaxtrain/generate/).
    sample_every: int = 0
    sample_prompts: tuple[str, ...] = ()
    sample_tokens: int = 32
    checkpoint_every: int = 100  # 0: only at the end
    keep_checkpoints: int = 3
    async_checkpoint: bool = True
    peak_flops_per_device: float | None = None  # overrides the device table for MFU
    # The sequence over the `context` axis: layout (LoadBalanced | Contiguous) and how ranks see
    # each other's keys (RingKV | AllGatherKV); meshes/context_layout.py.
    context_parallel: ContextParallel = ContextParallel()
    # resilience (jaxtrain/resilience/): a missing or dead peer, or a failure reported by one, ends
    # every process within peer_timeout_s; a step slower than hang_factor x the median step (and
    # than hang_min_s) dumps every thread's stack and exits (jaxtrain/resilience/watchdog.py), as
    # does each of the first steps (compilation included) past hang_first_steps_s, and a restore,
    # a save (with its wait for the write) or an eval past its own bound.
    peer_timeout_s: float = 60.0
    hang_factor: float = 10.0
    hang_min_s: float = 120.0
    hang_first_steps_s: float = 3600.0
    hang_restore_s: float = 3600.0
    hang_save_s: float = 1800.0
    hang_eval_s: float = 1800.0
    # A step whose loss, gradient norm or new parameters are not finite is never applied; then
    # @Halt() (exit 3), @Skip() (drop the batch) or @Rollback() (newest checkpoint, skip the batch).
    nonfinite: Any = Halt()
    # Checkpoint items to start fresh on resume, on purpose ("opt_state", "data"); a step
    # lacking an item the run needs is otherwise an error.
    reset_on_resume: tuple[str, ...] = ()
    strict_restore: bool = False  # a corrupt newest checkpoint is an error, not a fallback
    # A step without a manifest (or fingerprints) cannot be verified: refused (exit 4) unless True,
    # then restored with a warning.
    allow_unverified_restore: bool = False
    # (start, stop): a jax.profiler trace of steps start..stop into <workdir>/profile (jaxtrain/observe/profiling.py)
    profile_steps: tuple[int, int] | None = None

    def validate(self) -> None:
        check_config_types(self)
        for name in ("steps", "global_batch", "seq_len", "microbatches", "log_every", "eval_batches",
                     "keep_checkpoints", "loss_chunk"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TrainConfig.{name} must be positive, got {getattr(self, name)}")
        for name in ("peer_timeout_s", "hang_factor", "hang_min_s", "hang_first_steps_s", "hang_restore_s",
                     "hang_save_s", "hang_eval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"TrainConfig.{name} must be positive, got {getattr(self, name)}")
        if self.sample_every < 0 or self.sample_tokens < 1:
            raise ValueError(f"TrainConfig.sample_every must be >= 0 and sample_tokens >= 1, got "
                             f"{self.sample_every} and {self.sample_tokens}")
        if self.sample_every and not self.sample_prompts:
            raise ValueError("TrainConfig.sample_every is set but sample_prompts is empty")
        for name in ("eval_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.profile_steps is not None and not 1 <= self.profile_steps[0] <= self.profile_steps[1]:
            raise ValueError(f"TrainConfig.profile_steps must be (start, stop) with 1 <= start <= stop, "
                             f"got {self.profile_steps}")
        unknown = set(self.reset_on_resume) - {"opt_state", "data"}
        if unknown:
            raise ValueError(f"TrainConfig.reset_on_resume may hold 'opt_state' and 'data', got {sorted(unknown)}")
        if not hasattr(self.nonfinite, "decide"):
            raise ValueError(f"TrainConfig.nonfinite must be @Halt(), @Skip() or @Rollback(), got {self.nonfinite!r}")


@gin.configurable(module="jaxtrain")
@dataclasses.dataclass(frozen=True)
class Experiment:
    model: Any = None
    mesh: MeshConfig | None = None
    train: TrainConfig | None = None
    data: DataConfig | None = None
    optimizer: OptimizerConfig | None = None
    pipeline: PipelineConfig | None = None  # used when MeshConfig.pipeline > 1
    # A ParallelPlan spec string applied over the fields above (jaxtrain/training/parallel_plan.py), e.g.
    # "pipeline=2,data=2,context=2,tensor=2,rules=fsdp,split=14/13,microbatches=4".
    layout: str | None = None
    # Data parallelism over device groups with uneven batch shares (jaxtrain/training/device_groups.py):
    # `DeviceGroups.rows = (24, 8)` alone is enough (load_experiment picks it up).
    groups: DeviceGroups | None = None


    @functools.cached_property
    def plan(self) -> ParallelPlan:
        """The run's ParallelPlan: the layout fields above, Experiment.layout on top (kept once built;
        a replaced Experiment builds its own)."""
        return ParallelPlan.from_experiment(self)


def load_experiment() -> Experiment:
    """The experiment the parsed gin config describes, unbound parts taking their defaults."""
    try:
        exp = Experiment()
    except TypeError as e:  # a binding of the wrong kind, raised while gin builds a config
        raise ValueError(f"bad gin config: {e}") from None
    if exp.model is None:
        raise ValueError("no model configured: bind Experiment.model (e.g. `Experiment.model = @LlamaConfig()`)")
    exp = dataclasses.replace(
        exp,
        mesh=exp.mesh or GinMeshConfig(),
        train=exp.train or TrainConfig(),
        data=exp.data or GinDataConfig(),
        optimizer=exp.optimizer or GinOptimizerConfig(),
        pipeline=exp.pipeline or PipelineConfig(),
        groups=exp.groups or GinDeviceGroups(),
    )
    for part in (exp.model, exp.mesh, exp.train, exp.data, exp.optimizer, exp.pipeline, exp.groups):
        check_config_types(part)
    exp.plan  # built and kept: a bad Experiment.layout string is a config error now
    return exp


def parse_gin(files, bindings) -> None:
    add_config_search_path()
    gin.parse_config_files_and_bindings(list(files), list(bindings), finalize_config=False)


@functools.cache
def add_config_search_path() -> None:
    """Bundled configs `include 'configs/x.gin'`: resolve that from any working directory (once)."""
    gin.add_config_file_search_path(str(REPO_ROOT))
