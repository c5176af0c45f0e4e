"""Pipeline parallelism, one idea: the layer stacks cut into stages over the `pipeline` axis,
microbatches flowing through them in one SPMD program.

Entry point: `build_pipeline(model_cfg, plan, tx, mesh, rules, loss, trained)` (below), which the one
assembly function (jaxtrain/training/train_setup.py) calls when the mesh has pipeline > 1. It
returns the two strategies a pipelined run swaps in, with the interfaces of the unpipelined
ones:

  StagedState (staged_state.py)        the train state with each stack regrouped into stages
                                       (layout.py: canonical layers <-> [stages, repeats, slots]);
                                       checkpoints stay canonical
  PipelinedGradients (gradients.py)    the batch's loss and gradient with the microbatches run
                                       through the stages (meshes/pipeline.py) — the same numbers
                                       as gradient accumulation over as many microbatches

Settings are `PipelineConfig` (config.py: schedule, layer split, stage remat), part of the
run's ParallelPlan. Below this package, meshes/ holds what moves data across the axis (the
stage loop, the schedules GPipe / Interleaved, the split of layers into stages) and
models/stage_program.py what one stage computes.
"""
from __future__ import annotations

from jaxtrain.pipeline.config import PipelineConfig
from jaxtrain.pipeline.gradients import PipelinedGradients
from jaxtrain.pipeline.staged_state import StagedState


def build_pipeline(model_cfg, plan, tx, mesh, rules, loss, trained) -> tuple[StagedState, PipelinedGradients, str]:
    """(state layout, gradient strategy, a one-line summary for the log) of a pipelined run of
    `plan` (a ParallelPlan, validated) with `loss`'s settings (a LossConfig), differentiating
    the `trained` parameters (jaxtrain/training/trained_params.py)."""
    stages, pipeline = mesh.shape["pipeline"], plan.pipeline
    state = StagedState(model_cfg, tx, mesh, rules, pipeline.plan(model_cfg, stages))
    gradients = PipelinedGradients(state.graphdef, state.layout, pipeline.schedule, remat=pipeline.remat,
                                   loop=pipeline.stage_loop, microbatches=plan.microbatches, loss_chunk=loss.loss_chunk, z_loss=loss.z_loss,
                                   trained=trained)
    stage_plan = state.layout.plan
    padding = {"/".join(k[1:]): p for k, p in stage_plan.padding().items() if any(p)}
    summary = (f"pipeline {type(pipeline.schedule).__name__}, {stages} stages x {stage_plan.repeats} passes, "
               f"{plan.microbatches} microbatches (bubble {gradients.bubble:.3f}), layers per chunk "
               f"{stage_plan.counts}, padded slots per stage {padding or 'none'}")
    return state, gradients, summary


__all__ = ["PipelineConfig", "PipelinedGradients", "StagedState", "build_pipeline"]
