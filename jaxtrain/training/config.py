"""Everything a user sets, as gin configurables with defaults that run on a laptop CPU."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import gin

from jaxtrain.training.config_types import check_config_types
from jaxtrain.training.device_groups import DeviceGroups
from jaxtrain.bundled import ROOT as BUNDLED_ROOT, gin_file
from jaxtrain.data.packing import DataConfig
from jaxtrain.training.mesh_configurable import GinMeshConfig
from jaxtrain.training.optim import OptimizerConfig
from jaxtrain.training.moved_bindings import apply_moved, split_moved
from jaxtrain.training.parallel_plan import ParallelPlan
from jaxtrain.training.run_configs import RUN_CONFIGS, CheckpointConfig, LossConfig, ObserveConfig, ResilienceConfig
from jaxtrain.pipeline.config import PipelineConfig
from jaxtrain.meshes.context_settings import ContextParallel
from jaxtrain.meshes.mesh_config import MeshConfig
from jaxtrain.models.family import families
from jaxtrain.models.lora import LoraConfig, with_lora

# Each model family's record registers its config and the parts its gin files name with gin
# (models/family.py); mesh_configurable.py registers the mesh and context settings and
# jaxtrain/resilience/nonfinite.py its policies.
families()
GinDataConfig = gin.external_configurable(DataConfig, name="DataConfig", module="jaxtrain")
GinOptimizerConfig = gin.external_configurable(OptimizerConfig, name="OptimizerConfig", module="jaxtrain")
GinDeviceGroups = gin.external_configurable(DeviceGroups, name="DeviceGroups", module="jaxtrain")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The run's shape and layout. The loss settings, checkpointing, resilience and observability
    have their own configurables (jaxtrain/training/run_configs.py)."""
    steps: int = 100  # optimizer steps of the whole run (a resumed run stops here too)
    global_batch: int = 8  # sequences per optimizer step, over all devices and microbatches
    seq_len: int = 128  # tokens per training sequence
    # The layout fields (rules, microbatches, context_parallel) are read through the run's
    # ParallelPlan (jaxtrain/training/parallel_plan.py), with MeshConfig and Experiment.pipeline.
    microbatches: int = 1  # gradient accumulation steps per optimizer step
    seed: int = 0  # parameter initialization and data order
    rules: str = "dp"  # rule table in meshes/rules.py: dp | zero1 | fsdp | dp_sp | fsdp_sp
    # The sequence over the `context` axis: layout (LoadBalanced | Contiguous) and how ranks see
    # each other's keys (RingKV | AllGatherKV | LatentKV: MLA gathers its latent); meshes/context_layout.py.
    context_parallel: ContextParallel = ContextParallel()
    # Old-style bindings of fields that moved (jaxtrain/training/moved_bindings.py), as
    # ((name, value), ...): load_experiment hands them to their new configurables.
    moved_bindings: Any = dataclasses.field(default=(), repr=False, compare=False)

    def validate(self) -> None:
        check_config_types(self)
        for name in ("steps", "global_batch", "seq_len", "microbatches"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TrainConfig.{name} must be positive, got {getattr(self, name)}")


@gin.configurable("TrainConfig", module="jaxtrain")
def gin_train_config(**bindings) -> TrainConfig:
    """TrainConfig as gin builds it: also accepts the bindings of fields that moved to
    LossConfig / CheckpointConfig / ResilienceConfig / ObserveConfig (saved config.gin files)."""
    own, moved = split_moved(bindings)
    fields = [f.name for f in dataclasses.fields(TrainConfig) if f.name != "moved_bindings"]
    unknown = sorted(set(own) - set(fields))
    if unknown:
        raise ValueError(f"TrainConfig has no field {unknown[0]!r} (its fields: {', '.join(fields)}; see also "
                         f"LossConfig, CheckpointConfig, ResilienceConfig, ObserveConfig)")
    return TrainConfig(**own, moved_bindings=moved)


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
    # The run's settings by concern (jaxtrain/training/run_configs.py); unbound: their gin
    # bindings and defaults.
    loss: LossConfig | None = None
    checkpoint: CheckpointConfig | None = None
    resilience: ResilienceConfig | None = None
    observe: ObserveConfig | None = None
    # Low-rank adapters on a frozen base (models/lora.py; configs/lora.gin): `model` is then the
    # adapted model, and checkpoints hold the adapters alone on top of a recorded base
    # (jaxtrain/checkpoints/adapter_base.py).
    lora: LoraConfig | None = None
    # The workdir whose newest checkpoint is the base a LoRA run adapts (e.g. one written by
    # `python -m jaxtrain.convert --hf_dir`); None: the run's own workdir's converted step.
    lora_base: str | None = None

    def __post_init__(self):
        if self.lora is not None and self.model is not None and not hasattr(self.model, "lora"):
            # the one place the adapted model is made: every program that builds the run's model
            # (train, eval, generate, export) builds this one
            object.__setattr__(self, "model", with_lora(self.model, self.lora))
        for part, make in RUN_CONFIGS.items():
            if getattr(self, part) is None:
                object.__setattr__(self, part, make())

    def validate(self) -> None:
        """The run's settings, each named by its configurable on error."""
        self.train.validate()
        for part in RUN_CONFIGS:
            getattr(self, part).validate()

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
    except ValueError as e:  # a config's own check (gin adds an "In call to configurable" line)
        raise ValueError(str(e).split("\n")[0]) from None
    if exp.model is None:
        raise ValueError("no model configured: bind Experiment.model (e.g. `Experiment.model = @LlamaConfig()`)")
    try:
        train = exp.train or gin_train_config()
    except ValueError as e:
        raise ValueError(str(e).split("\n")[0]) from None
    exp = dataclasses.replace(
        exp,
        mesh=exp.mesh or GinMeshConfig(),
        train=train,
        data=exp.data or GinDataConfig(),
        optimizer=exp.optimizer or GinOptimizerConfig(),
        pipeline=exp.pipeline or PipelineConfig(),
        groups=exp.groups or GinDeviceGroups(),
    )
    exp = apply_moved(exp, exp.train.moved_bindings)
    for part in (exp.model, exp.mesh, exp.train, exp.data, exp.optimizer, exp.pipeline, exp.groups,
                 *(getattr(exp, part) for part in RUN_CONFIGS)):
        check_config_types(part)
    exp.plan  # built and kept here, so a bad Experiment.layout string is a config error at load
    return exp


def parse_gin(files, bindings) -> None:
    add_config_search_path()
    gin.parse_config_files_and_bindings([gin_file(f) for f in files], list(bindings), finalize_config=False)


@functools.cache
def add_config_search_path() -> None:
    """Bundled configs `include 'configs/x.gin'`: resolve that from any working directory (once)."""
    gin.add_config_file_search_path(str(BUNDLED_ROOT))
