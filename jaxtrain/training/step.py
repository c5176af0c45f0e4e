"""The jitted train and eval steps.

The loss is the token-mean cross-entropy over the whole global batch. With gradient
accumulation each microbatch contributes (sum of its token losses) / (tokens in the whole
batch), so the accumulated gradient equals the one-batch gradient exactly.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain.microbatching import ROW, split_microbatches, training_loss
from jaxtrain.training.guarded_update import guarded_step
from jaxtrain.training.trained_params import AllParams
from jaxtrain.meshes.context_layout import ContextParallel, to_device_order, use_context_parallel
from jaxtrain.meshes.leaf_sums import leaf_sums, squares
from jaxtrain.meshes.rules import RuleSet, named_sharding, use_rules
from jaxtrain.models.layers.aux_outputs import aux_metrics, has_after_update

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


def batch_shardings(mesh, rules: RuleSet, global_batch: int, seq_len: int) -> dict:
    s = named_sharding(mesh, ROW, (global_batch, seq_len), rules.activations)
    return {k: s for k in BATCH_KEYS}


def _forward_sums(graphdef, params, batch, *, loss_chunk, z_loss):
    """Token sums (nll, z-loss, correct) and the model's typed auxiliary outputs (MoE statistics)."""
    model = nnx.merge(graphdef, params)
    batch = to_device_order(batch)  # the context layout's token order; every key moves alike
    x, aux = model.run_stacks(model.embed_inputs(batch["inputs"]), batch["positions"], batch["segment_ids"])
    sums = model.head_sums(x, batch["targets"], batch["loss_mask"], chunk=loss_chunk, z_loss=z_loss)
    return sums, aux


class AccumulatedGradients:
    """The whole batch's gradient with its microbatches run one after another and summed
    (gradient accumulation); one microbatch runs the batch at once. The pipelined counterpart,
    with the same interface, is jaxtrain/pipeline/gradients.py."""

    def __init__(self, graphdef, *, microbatches: int, loss_chunk: int, z_loss: float,
                 step_microbatches: int | None = None, trained=AllParams()):
        """`step_microbatches`: the microbatches of the whole optimizer step when this strategy
        runs only some of them (one device group's share: jaxtrain/training/group_step.py); the
        aux losses are averaged over all of them. Default: `microbatches`. `trained`: which
        parameters get gradients (jaxtrain/training/trained_params.py); the gradient tree is theirs."""
        self.graphdef, self.microbatches, self.trained = graphdef, microbatches, trained
        self.step_microbatches = step_microbatches or microbatches
        self.loss_chunk, self.z_loss = loss_chunk, z_loss

    def sums(self, params, batch):
        """(nll, z, correct) token sums of the batch without gradients (evaluation)."""
        return _forward_sums(self.graphdef, params, batch, loss_chunk=self.loss_chunk, z_loss=0.0)[0]

    def _loss(self, trained, rest, mb, total_tokens):
        params = self.trained.merge(rest, trained)
        sums, aux = _forward_sums(self.graphdef, params, mb, loss_chunk=self.loss_chunk, z_loss=self.z_loss)
        return training_loss(sums, aux, total_tokens, self.step_microbatches), (sums, aux)

    def __call__(self, params, batch, total_tokens):
        """(grads, (nll, z, correct) sums, aux laid out like params' stacks)."""
        grad_fn = jax.value_and_grad(self._loss, has_aux=True)
        trained, rest = self.trained.split(params)
        if self.microbatches == 1:
            (_, (sums, aux)), grads = grad_fn(trained, rest, batch, total_tokens)
            return grads, sums, aux

        # Every statistic is a sum over tokens (or a per-microbatch loss), so they add up.
        def accumulate(carry, mb):
            (_, out), grads = grad_fn(trained, rest, mb, total_tokens)
            return jax.tree.map(jnp.add, carry, (grads, out)), None

        microbatched = split_microbatches(batch, self.microbatches)
        (_, out_shape), grads_shape = jax.eval_shape(
            grad_fn, trained, rest, jax.tree.map(lambda x: x[0], microbatched), total_tokens)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (grads_shape, out_shape))
        (grads, (sums, aux)), _ = jax.lax.scan(accumulate, zeros, microbatched)
        return grads, sums, aux

    def metrics(self, aux) -> dict:
        return aux_metrics(aux, self.step_microbatches)


def loss_tokens(count):
    """The tokens the loss is a mean over, from the batch's loss-mask sum: at least 1, so an
    all-masked batch has loss 0, not NaN."""
    return jnp.maximum(count, 1.0)


def gradient_layouts(params_shardings, opt_state_shardings):
    """The layouts the gradients reach the update in: the optimizer's moments' (Adam's `mu`, the
    first subtree of the optimizer state laid out like the parameters), else the parameters'.
    Under a sharded optimizer (ZeRO-1) XLA reduce-scatters each gradient into its moment's layout;
    taking the norm's shard_map over the parameters' layouts instead would make XLA hold every
    gradient unreduced in the step's temp, next to the reduced copy the update needs."""
    if params_shardings is None or opt_state_shardings is None:
        return params_shardings
    target = jax.tree.structure(params_shardings)
    like_params = lambda t: not isinstance(t, NamedSharding) and jax.tree.structure(t) == target
    moments = [t for t in jax.tree.leaves(opt_state_shardings, is_leaf=like_params) if like_params(t)]
    return moments[0] if moments else params_shardings


def make_update(graphdef, tx, schedule, *, rules: RuleSet, opt_state_shardings, params_shardings=None,
                grads_shardings=None, trained=AllParams()):
    """The second half of every train step: `update(state, grads, sums, aux, total_tokens,
    aux_metrics) -> (new state, metrics)` applies the optimizer to the whole batch's gradient,
    runs the layers' post-update, keeps the old state if anything is not finite, and computes the
    step's metrics. Shared by the one-program step (make_train_step) and the step over device
    groups (jaxtrain/training/group_step.py). Call it under `use_rules` of the state's mesh.

    `params_shardings`: the parameters' layouts. With them the step's gradient norm and parameter
    norm run as one collective each (meshes/leaf_sums.py) instead of one per leaf group, each over
    its tree's own layouts (gradient_layouts); the optimizer's clip takes the gradient norm from
    here (optim.clip_by_global_norm) rather than reducing it again. `grads_shardings`: the
    gradients' layouts when not the moments' (default: gradient_layouts). `trained`: which
    parameters the gradients and the optimizer state are for (jaxtrain/training/trained_params.py);
    the others pass through the step unchanged."""
    tx = optax.with_extra_args_support(tx)
    if grads_shardings is None:
        grads_shardings = gradient_layouts(trained.select(params_shardings), opt_state_shardings)
    sum_params = lambda local_sum, tree: leaf_sums(local_sum, tree, params_shardings)
    # Optimizer state kept in host memory (rules `+opt_host`) comes to the device for the update;
    # the step's out_shardings write the new state back (XLA moves each leaf as its update needs it).
    if rules.optimizer_memory == "device":
        to_device = lambda opt: opt
    else:
        on_device = jax.tree.map(lambda s: s.with_memory_kind("device"), opt_state_shardings)
        to_device = lambda opt: jax.tree.map(jax.device_put, opt, on_device)

    def update(state, grads, sums, aux, total_tokens, aux_metrics: dict):
        def apply(params, opt_state, grads):
            updated = trained.select(params)
            updates, opt_state = tx.update(grads, opt_state, updated, global_norm=grad_norm)
            new_params = trained.merge(params, optax.apply_updates(updated, updates))
            if has_after_update(aux):  # e.g. the MoE routers' correction biases follow the load
                # aux is laid out like the params (canonical stacks, or pipeline stages: the
                # update is elementwise per layer either way)
                model = nnx.merge(graphdef, new_params)
                model.after_update(aux)
                # an untrained parameter (a frozen base's router bias) stays as it was
                new_params = trained.merge(params, trained.select(nnx.to_pure_dict(nnx.state(model))))
            return new_params, opt_state

        nll, z, correct = sums
        grad_squares = leaf_sums(squares, grads, grads_shardings)
        grad_norm = jnp.sqrt(grad_squares.sum())
        loss = nll / total_tokens
        # A finite gradient norm bounds every gradient element, and so Adam's moments; with the
        # loss and the new parameters finite the whole new state is. Otherwise the update is
        # dropped on device (the policy acts when the host sees it: jaxtrain/resilience/nonfinite.py),
        # checked before the update so the old and new state are never held together
        # (jaxtrain/training/guarded_update.py).
        new_params, new_opt_state, param_norm, finite = guarded_step(
            apply, state.params, to_device(state.opt_state), grads, jnp.isfinite(loss) & jnp.isfinite(grad_norm),
            sum_leaves=sum_params)
        metrics = {
            "loss": loss,
            "z_loss": z / total_tokens,
            "accuracy": correct / total_tokens,
            "grad_norm": grad_norm,
            "param_norm": param_norm,
            "learning_rate": schedule(state.step),
            "loss_tokens": total_tokens,
            "nonfinite": 1.0 - finite.astype(jnp.float32),
            # index into jax.tree.leaves(params) of the first non-finite gradient, -1 if none
            "first_nonfinite_grad": jnp.where(jnp.isfinite(grad_squares).all(), -1,
                                              jnp.argmax(~jnp.isfinite(grad_squares))),
            **aux_metrics,
        }
        new_state = state.replace(step=state.step + 1, params=new_params, opt_state=new_opt_state)
        return new_state, metrics

    return update


def make_train_step(graphdef, tx, schedule, gradients, *, mesh, rules: RuleSet, state_shardings, batch_sharding,
                    context_parallel: ContextParallel = ContextParallel(), trained=AllParams()):
    """`gradients`: how the batch's gradient is computed (AccumulatedGradients, or
    jaxtrain/pipeline/gradients.py PipelinedGradients); `context_parallel`: the sequence layout
    and K/V exchange over the `context` axis; `trained`: the parameters `gradients` differentiates
    (jaxtrain/training/trained_params.py)."""
    update = make_update(graphdef, tx, schedule, rules=rules, opt_state_shardings=state_shardings.opt_state,
                         params_shardings=state_shardings.params, trained=trained)

    def step(state, batch):
        with use_rules(mesh, rules), use_context_parallel(context_parallel):
            total_tokens = loss_tokens(batch["loss_mask"].sum())
            grads, sums, aux = gradients(state.params, batch, total_tokens)
            return update(state, grads, sums, aux, total_tokens, gradients.metrics(aux))

    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(step, in_shardings=(state_shardings, batch_sharding),
                   out_shardings=(state_shardings, replicated), donate_argnums=(0,))


def eval_sums(forward, *, mesh, rules: RuleSet, context_parallel: ContextParallel = ContextParallel()):
    """`sums(params, batch) -> {nll, tokens, correct}` over a batch (callers divide after summing
    batches); `forward(params, batch) -> (nll, z, correct)`: the gradient strategy's `sums`."""

    def sums(params, batch):
        with use_rules(mesh, rules), use_context_parallel(context_parallel):
            nll, _, correct = forward(params, batch)
        return {"nll": nll, "tokens": batch["loss_mask"].sum(), "correct": correct}

    return sums


def make_eval_step(forward, *, mesh, rules: RuleSet, params_shardings, batch_sharding,
                   context_parallel: ContextParallel = ContextParallel()):
    """eval_sums jitted for one mesh."""
    return jax.jit(eval_sums(forward, mesh=mesh, rules=rules, context_parallel=context_parallel),
                   in_shardings=(params_shardings, batch_sharding), out_shardings=NamedSharding(mesh, PartitionSpec()))
