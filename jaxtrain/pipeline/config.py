"""Pipeline parallelism settings (used when `MeshConfig.pipeline > 1`) and the stage plan they give.

    Experiment.pipeline = @PipelineConfig()
    PipelineConfig.schedule = @Interleaved()      # or @GPipe() (the default)
    Interleaved.virtual_stages = 2
    PipelineConfig.stages_layers = (14, 13)       # or None: balanced by per-layer cost
    PipelineConfig.remat = "stage"                # none | layer | stage
    PipelineConfig.stage_loop = "runs"            # auto | runs | switched | kinds (models/stage_program.py)

Microbatches are `TrainConfig.microbatches`: with a pipeline they flow through the stages
instead of being accumulated one after another.
"""
from __future__ import annotations

import dataclasses

import gin
from flax import nnx

from jaxtrain.meshes.pipeline_schedules import GPipe, Interleaved
from jaxtrain.meshes.pipeline_split import StagePlan, chunk_counts, plan_stages
from jaxtrain.models.stage_program import LOOPS, STAGE_REMAT, layer_cost, layer_sequence, layer_stacks

gin.external_configurable(GPipe, module="meshes")
gin.external_configurable(Interleaved, module="meshes")


@gin.configurable(module="jaxtrain")
@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    schedule: object = GPipe()  # GPipe() | Interleaved(virtual_stages)
    # Layers per chunk in model order, one chunk per (virtual) stage: `pipeline` numbers for GPipe,
    # `pipeline x virtual_stages` for Interleaved (chunk c runs on stage c mod pipeline).
    # None: the split whose common slot pattern costs least per tick, by each layer's cost (the
    # parameters a token passes through): for one kind of layer, the balanced split.
    stages_layers: tuple[int, ...] | None = None
    remat: str = "none"  # none | layer | stage (models/stage_program.py)
    # How a stage with alternating layer kinds loops over its slots: "auto" (`stage_loop`: under
    # remat full the kinds loop, one scan with a switch, which compiles one layer per kind and keeps
    # FSDP gathers inside the tick loop: models/stage_program.stage_loop; else run by run), or
    # "runs", "kinds", "switched".
    stage_loop: str = "auto"

    def validate(self, stages: int, microbatches: int) -> None:
        if self.remat not in STAGE_REMAT:
            raise ValueError(f"PipelineConfig.remat={self.remat!r}: choose one of {STAGE_REMAT}")
        if self.stage_loop not in ("auto",) + LOOPS:
            raise ValueError(f"PipelineConfig.stage_loop={self.stage_loop!r}: choose one of {('auto',) + LOOPS}")
        if not hasattr(self.schedule, "ticks"):
            raise ValueError(f"PipelineConfig.schedule={self.schedule!r} is not a schedule (GPipe or Interleaved)")
        self.schedule.validate(stages, microbatches)

    def plan(self, model_cfg, stages: int) -> StagePlan:
        """The stage plan for `stages` pipeline stages; raises ValueError on a bad split."""
        model = nnx.eval_shape(lambda: model_cfg.build(nnx.Rngs(0)))
        cost = {kind: layer_cost(stack) for kind, stack in layer_stacks(model).items()}
        sequence = layer_sequence(model)
        repeats = self.schedule.virtual_stages
        kinds = [kind for kind, _ in sequence]
        counts = chunk_counts([cost[k] for k in kinds], stages * repeats, self.stages_layers, kinds)
        return plan_stages(sequence, stages, repeats, counts)

