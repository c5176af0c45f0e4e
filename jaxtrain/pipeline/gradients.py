"""The batch's loss and gradient with its microbatches flowing through pipeline stages.

Same interface as `step.AccumulatedGradients`, and the same numbers: the microbatches are the
same rows, each MoE layer's statistics and aux loss are per microbatch, and the loss is
summed over all tokens, so a pipelined step equals an unpipelined one with as many
microbatches. Parameters arrive in the stage layout (jaxtrain/pipeline/layout.py).

The model's own pieces (CausalLM.embed_inputs, its stacks' layers, CausalLM.head_sums) and the
one loss formula (jaxtrain/microbatching.training_loss), so a pipelined step computes what the model defines:
embed (replicated over `pipeline`) -> stages (meshes/pipeline.py) -> final norm, head and
cross-entropy per microbatch, the microbatches split over `pipeline` when it divides them, so
no pipeline group computes the head for the whole batch.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.pipeline.layout import PipelineLayout
from jaxtrain.microbatching import split_microbatches, training_loss
from jaxtrain.meshes.context_layout import to_device_order
from jaxtrain.meshes.pipeline import run_pipeline
from jaxtrain.meshes.rules import constrain
from jaxtrain.models.causal_lm import RESIDUAL
from jaxtrain.models.layers.aux_outputs import aux_metrics
from jaxtrain.models.stage_program import StageProgram


class PipelinedGradients:
    def __init__(self, graphdef, layout: PipelineLayout, schedule, *, microbatches: int, loss_chunk: int,
                 z_loss: float, trained, remat: str = "none", loop: str = "auto"):
        """`trained`: which parameters get gradients (jaxtrain/training/trained_params.py; its
        paths are the same in the stage layout); the gradient tree is theirs."""
        self.graphdef, self.layout, self.schedule, self.loop = graphdef, layout, schedule, loop
        self.trained = trained
        self.microbatches, self.loss_chunk, self.z_loss, self.remat = microbatches, loss_chunk, z_loss, remat
        self.stages = layout.plan.stages
        self.bubble = schedule.bubble_fraction(self.stages, microbatches)

    def _forward(self, params, batch, z_loss):
        """((nll, z, correct) sums, aux per stack in the stage layout)."""
        plan = self.layout.plan
        model = nnx.merge(self.graphdef, params)
        mbs = split_microbatches(to_device_order(batch), self.microbatches)
        x = constrain(jax.vmap(model.embed_inputs)(mbs["inputs"]), (None,) + RESIDUAL)
        program = StageProgram(model, plan.pattern, plan.repeats, self.remat, loop=self.loop)
        stage_params = {kind: _subtree(params, kind + ("layers",)) for kind in plan.kinds}
        valid = {kind: jnp.asarray(plan.valid(kind)) for kind in plan.kinds}
        stage_fn = program.every_stage if program.all_stages else program
        final, aux = run_pipeline(lambda p, repeat, h, pos, seg: stage_fn(*p, repeat, h, pos, seg),
                                  (stage_params, valid), x, (mbs["positions"], mbs["segment_ids"]),
                                  self.schedule, stages=self.stages, all_stages=program.all_stages)

        def head(h, targets, mask):
            # The head takes the sequence whole over `tensor` (split over `context` only), as
            # the unpipelined model's head does implicitly. Stated here because XLA's SPMD
            # partitioner, left to choose with the microbatches split over `pipeline`, gets the
            # input gradient wrong for sequence parallel + FSDP over context (jax 0.10.2).
            h = constrain(h, ("batch", "length", "embed"))
            return jnp.stack(model.head_sums(h, targets, mask, chunk=self.loss_chunk, z_loss=z_loss))

        spread = "pipeline" if self.microbatches % self.stages == 0 else None
        sums = jax.vmap(head, spmd_axis_name=spread)(final, mbs["targets"], mbs["loss_mask"]).sum(0)
        return (sums[0], sums[1], sums[2]), _nest(aux)

    def sums(self, params, batch):
        return self._forward(params, batch, 0.0)[0]

    def _loss(self, params, batch, total_tokens):
        sums, aux = self._forward(params, batch, self.z_loss)
        return training_loss(sums, aux, total_tokens, self.microbatches), (sums, aux)

    def __call__(self, params, batch, total_tokens):
        trained, rest = self.trained.split(params)

        def loss(trained):
            return self._loss(self.trained.merge(rest, trained), batch, total_tokens)

        (_, (sums, aux)), grads = jax.value_and_grad(loss, has_aux=True)(trained)
        return grads, sums, aux

    def metrics(self, aux) -> dict:
        return {**aux_metrics(self.layout.aux_to_canonical(aux), self.microbatches),
                "pipeline_bubble": jnp.asarray(self.bubble, jnp.float32)}


def _subtree(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _nest(by_kind: dict) -> dict:
    """{("stacks", name[, kind]): aux} -> {name: aux} / {name: {kind: aux}}, as the model nests it."""
    out: dict = {}
    for kind, aux in by_kind.items():
        node = out
        for key in kind[1:-1]:
            node = node.setdefault(key, {})
        node[kind[-1]] = aux
    return out
