"""Everything a training run compiles, for any layout: state layout, gradient strategy, steps.

Shared by the Trainer, the bench and the tests so that a pipelined and an unpipelined run
differ only in the two strategies chosen here.
"""
from __future__ import annotations

import dataclasses

from jaxtrain.pipeline_config import PipelineConfig
from jaxtrain.pipeline_step import PipelinedGradients
from jaxtrain.state_layouts import CanonicalState, StagedState
from jaxtrain.step import AccumulatedGradients, batch_shardings, make_eval_step, make_train_step
from meshes.rules import RuleSet


@dataclasses.dataclass
class TrainSetup:
    state: CanonicalState | StagedState
    gradients: AccumulatedGradients | PipelinedGradients
    batch_sharding: dict
    train_step: object
    eval_step: object
    summary: str = ""  # the pipeline layout in a line, for the log (empty without one)


def build_train_setup(model_cfg, train, tx, lr_schedule, mesh, rules: RuleSet,
                      pipeline: PipelineConfig | None = None) -> TrainSetup:
    """`train`: a TrainConfig (batch, microbatches, loss); `pipeline` applies when the mesh has
    pipeline > 1 (defaults: GPipe, balanced split)."""
    stages = mesh.shape["pipeline"]
    kw = dict(microbatches=train.microbatches, loss_chunk=train.loss_chunk, z_loss=train.z_loss)
    if stages > 1:
        pipeline = pipeline or PipelineConfig()
        pipeline.validate(stages, train.microbatches)
        state = StagedState(model_cfg, tx, mesh, rules, pipeline.plan(model_cfg, stages))
        gradients = PipelinedGradients(state.graphdef, state.layout, pipeline.schedule, remat=pipeline.remat, **kw)
        plan = state.layout.plan
        padding = {"/".join(k[1:]): p for k, p in plan.padding().items() if any(p)}
        summary = (f"pipeline {type(pipeline.schedule).__name__}, {stages} stages x {plan.repeats} passes, "
                   f"{train.microbatches} microbatches (bubble {gradients.bubble:.3f}), layers per chunk "
                   f"{plan.counts}, padded slots per stage {padding or 'none'}")
    else:
        state = CanonicalState(model_cfg, tx, mesh, rules)
        gradients = AccumulatedGradients(state.graphdef, **kw)
        summary = ""
    bsh = batch_shardings(mesh, rules, train.global_batch, train.seq_len)
    cp = train.context_parallel
    train_step = make_train_step(state.graphdef, tx, lr_schedule, mesh=mesh, rules=rules,
                                 state_shardings=state.shardings, batch_sharding=bsh, gradients=gradients,
                                 context_parallel=cp)
    eval_step = make_eval_step(state.graphdef, mesh=mesh, rules=rules, params_shardings=state.shardings["params"],
                               batch_sharding=bsh, loss_chunk=train.loss_chunk, forward=gradients.sums,
                               context_parallel=cp)
    return TrainSetup(state, gradients, bsh, train_step, eval_step, summary)
