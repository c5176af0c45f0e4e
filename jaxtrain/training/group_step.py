"""The train and eval steps over device groups with uneven batch shares
(jaxtrain/training/device_groups.py).

One optimizer step:

  1. each group counts its rows' loss tokens; a tiny program over all devices sums the counts,
     so every group divides by the whole batch's token count T (on device: no host sync);
  2. each group accumulates the gradient over its own microbatches (AccumulatedGradients: the
     one loss formula, (nll + z) / T + aux / M with M the microbatches of all groups);
  3. one program over all devices sums the groups' gradients, token sums and aux outputs and
     applies the update every step shares (step.make_update: optimizer, the layers'
     post-update, the non-finite guard, the metrics).

So the step is the step of one program with M microbatches on the whole batch. A process runs
the programs of its own groups only (in one process all of them: async dispatch runs them side
by side on their disjoint devices) and every program over all devices.
"""
from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain.training.device_groups import GROUP_AXIS, BatchShares, GroupLayout
from jaxtrain.training.step import AccumulatedGradients, eval_sums, loss_tokens, make_update
from jaxtrain.training.trained_params import AllParams
from jaxtrain.meshes.context_layout import ContextParallel, use_context_parallel
from jaxtrain.meshes.rules import RuleSet, use_rules


def _with_group_axis(fn):
    """fn with a leading axis of 1 on every output: one group's entry of a [G, ...] array."""
    return lambda *args: jax.tree.map(lambda x: x[None], fn(*args))


def _sum_over_groups(tree):
    return jax.tree.map(lambda x: x.sum(0), tree)


def group_gradients(shares: BatchShares, graphdef, *, loss_chunk: int, z_loss: float,
                    trained=AllParams()) -> list[AccumulatedGradients]:
    """Each group's gradient strategy: its own microbatches, the aux loss over all of them, the
    gradient of the `trained` parameters (jaxtrain/training/trained_params.py)."""
    return [AccumulatedGradients(graphdef, microbatches=m, step_microbatches=shares.total_microbatches,
                                 loss_chunk=loss_chunk, z_loss=z_loss, trained=trained) for m in shares.microbatches]


class GroupedTrainStep:
    """`step(state, batches) -> (new state, metrics)`: `state` on the global mesh (replicated over
    groups), `batches` {group: its rows as group-mesh arrays} for this process's groups."""

    def __init__(self, layout: GroupLayout, gradients: list[AccumulatedGradients], graphdef, tx, schedule, *,
                 rules: RuleSet, state_shardings, batch_shardings: dict,
                 context_parallel: ContextParallel = ContextParallel(), trained=AllParams()):
        """`trained`: the parameters the groups' gradients are for (the update leaves the rest)."""
        self.layout = layout
        params_shardings = state_shardings.params
        self._count, self._gradients = {}, {}
        for g in layout.own:
            mesh = layout.meshes[g]
            replicated = NamedSharding(mesh, PartitionSpec())
            params = layout.group_shardings(params_shardings, g)
            grads = jax.tree.map(lambda s, mesh=mesh: NamedSharding(mesh, PartitionSpec(None, *s.spec)),
                                 trained.select(params))

            def gradients_of_group(params, batch, total_tokens, mesh=mesh, gradients=gradients[g]):
                with use_rules(mesh, rules), use_context_parallel(context_parallel):
                    return gradients(params, batch, total_tokens)

            self._count[g] = jax.jit(_with_group_axis(lambda batch: batch["loss_mask"].sum()),
                                     in_shardings=(batch_shardings[g],), out_shardings=replicated)
            self._gradients[g] = jax.jit(_with_group_axis(gradients_of_group),
                                         in_shardings=(params, batch_shardings[g], replicated),
                                         out_shardings=(grads, replicated, replicated))

        everywhere = NamedSharding(layout.mesh, PartitionSpec())
        by_group = NamedSharding(layout.mesh, PartitionSpec(GROUP_AXIS))
        stacked_grads = jax.tree.map(lambda s: NamedSharding(layout.mesh, PartitionSpec(GROUP_AXIS, *s.spec)),
                                     trained.select(params_shardings))
        self._total_tokens = jax.jit(lambda counts: loss_tokens(counts.sum()), in_shardings=(by_group,),
                                     out_shardings=everywhere)
        # With the parameters' layouts the update's norms are one collective each (step.make_update)
        update = make_update(graphdef, tx, schedule, rules=rules, opt_state_shardings=state_shardings.opt_state,
                             params_shardings=params_shardings, trained=trained)
        metrics_of = gradients[0].metrics  # every group's strategy averages over all M microbatches

        def apply(state, grads, sums, aux, total_tokens):
            grads, sums, aux = _sum_over_groups((grads, sums, aux))  # the all-reduce across groups
            with use_rules(layout.mesh, rules):
                return update(state, grads, sums, aux, total_tokens, metrics_of(aux))

        self._apply = jax.jit(apply, in_shardings=(state_shardings, stacked_grads, by_group, by_group, everywhere),
                              out_shardings=(state_shardings, everywhere), donate_argnums=(0,))

    def __call__(self, state: dict, batches: dict):
        return self._apply(state, *self.update_inputs(state, batches))

    def lower_update(self, state: dict, grads, sums, aux, total_tokens):
        """The program over all devices that sums the groups' outputs and updates, lowered for
        these inputs (update_inputs), to inspect or run it on its own."""
        return self._apply.lower(state, grads, sums, aux, total_tokens)

    def update_inputs(self, state: dict, batches: dict):
        """(grads, sums, aux stacked over groups, total tokens): the update program's inputs,
        from the groups' own programs (step phases 1 and 2)."""
        layout = self.layout
        counts = layout.stack({g: self._count[g](batches[g]) for g in layout.own})
        total_tokens = self._total_tokens(counts)
        outputs = {g: self._gradients[g](layout.view(state.params, g), batches[g], layout.view(total_tokens, g))
                   for g in layout.own}
        grads, sums, aux = layout.stack(outputs)
        return grads, sums, aux, total_tokens


class GroupedEvalStep:
    """`eval(params, batches) -> {nll, tokens, correct}` summed over every group's rows."""

    def __init__(self, layout: GroupLayout, gradients: list[AccumulatedGradients], *, rules: RuleSet,
                 params_shardings, batch_shardings: dict, context_parallel: ContextParallel = ContextParallel()):
        self.layout = layout
        self._sums = {}
        for g in layout.own:
            mesh = layout.meshes[g]
            sums = eval_sums(gradients[g].sums, mesh=mesh, rules=rules, context_parallel=context_parallel)
            self._sums[g] = jax.jit(_with_group_axis(sums),
                                    in_shardings=(layout.group_shardings(params_shardings, g), batch_shardings[g]),
                                    out_shardings=NamedSharding(mesh, PartitionSpec()))
        self._total = jax.jit(_sum_over_groups, out_shardings=NamedSharding(layout.mesh, PartitionSpec()))

    def __call__(self, params: dict, batches: dict) -> dict:
        layout = self.layout
        return self._total(layout.stack({g: self._sums[g](layout.view(params, g), batches[g]) for g in layout.own}))
