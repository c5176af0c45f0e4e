"""A scan over layers of several kinds, with a switch on the kind, whose backward pass keeps each
kind's residuals only at the steps that run that kind.

A differentiated `lax.switch` keeps the residuals of EVERY branch at every step (JAX transposes a
switch through a cond whose outputs are all branches' residuals; zeros for the ones not taken).
Under remat `none`/`dots` a hybrid stack then holds every kind's activations at every slot. Here
the loop has its own VJP (`jax.custom_vjp`):

- forward: one scan over the steps; at a step of kind k the switch's branch k runs `jax.vjp` of
  kind k's layer (under the remat policy) and writes the vjp's residual leaves into kind k's own
  buffers, stacked over that kind's occurrences (step -> occurrence is static). Only residuals
  that depend on the layer's input are stored; those computed from its weights, ctx and step
  alone (the weights, their sharding-constrained views, masks) are recomputed in the backward.
- backward: one reverse scan; branch k rebuilds kind k's vjp from its buffers' row and applies it,
  returning one layer's weight gradient (zeros for the other kinds), which `put` adds into each
  kind's stack gradient after the switch: the stacks' gradients are not the switch's operands
  (XLA copied them through every branch), and a step adds one layer's gradient, not a stack's
  (the transpose of `take` is a zero stack with one row set).

So the residuals are what a scan per run of one kind keeps, while XLA compiles one layer per kind.
`take` and `apply` may be vmapped (a pipeline's stages): the loop itself must not be, as a
`jax.vjp` traced before a `vmap(spmd_axis_name=...)` batches it fails on layers holding a
`shard_map` (jax 0.10: "vmap spmd_axis_name cannot appear in shard_map out_specs").
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
from jax._src.interpreters import partial_eval as pe  # dce_jaxpr: no public equivalent

from jaxtrain.models.layers.layer_scan import REMAT_POLICIES, check_remat

# take(k, stack_k, read, ctx) -> one layer's weights of kind k (views only: sliced again in the
#   backward pass instead of saved); read: the step's index into kind k's stack (traced).
# put(k, dstack, read, ctx, dw) -> dstack with dw (one layer's weight gradient) added where
#   take(k, ., read, ctx) reads: take's transpose, one layer's work; a read past the stack's end
#   (PAST_END: a step of another kind) adds nothing (a scatter that drops it).
# apply(k, x, weights, ctx, step) -> (y, aux): one layer of kind k, the step's mask included.
Take = Callable
Put = Callable
PAST_END = 2 ** 30
Apply = Callable


def scan_kinds(take: Take, put: Put, apply: Apply, x, stacks: Sequence, ctx, reads, kind_ids, remat: str = "none"):
    """Applies step s's layer (kind kind_ids[s], weights take(k, stacks[k], reads[s], ctx)) in
    step order. ctx: a pytree handed to take/put/apply (not differentiated: positions, masks).
    reads: int [steps]. kind_ids: static ints [steps]. Returns (x, [aux of kind k stacked over
    its steps, in step order])."""
    kind_ids = np.asarray(kind_ids, np.int32)
    kinds = len(stacks)
    occurrence = np.zeros_like(kind_ids)
    for k in range(kinds):
        occurrence[kind_ids == k] = np.arange(np.sum(kind_ids == k))
    counts = [int(np.sum(kind_ids == k)) for k in range(kinds)]
    policy = REMAT_POLICIES[check_remat(remat)]
    layer_fn = [_layer_fn(apply, k, policy) for k in range(kinds)]
    plan = _ResidualPlan(take, layer_fn)

    @jax.custom_vjp
    def loop(x, stacks, ctx, reads):  # not differentiated (evaluation): nothing to keep
        return _apply_only(plan, x, stacks, ctx, reads, kind_ids, occurrence, counts)

    def loop_fwd(x, stacks, ctx, reads):
        out, buffers = _forward(plan, x, stacks, ctx, reads, kind_ids, occurrence, counts)
        return out, (stacks, ctx, reads, buffers)

    def loop_bwd(res, cotangents):
        stacks, ctx, reads, buffers = res
        dx, daux = cotangents
        dstacks = jax.tree.map(jnp.zeros_like, tuple(stacks))
        layer_shapes = [jax.eval_shape(lambda st, r, k=k: take(k, st, r, ctx), stacks[k], reads[0]) for k in range(kinds)]

        def step(carry, inputs):
            dx, dstacks = carry
            kind, occ, read, s, puts = inputs

            def branch(k):
                def run(dx):
                    w = take(k, stacks[k], read, ctx)
                    rows = [jax.lax.dynamic_index_in_dim(b, occ, keepdims=False) for b in buffers[k]]
                    vjp_fn = plan.rebuild(k, rows, jax.ShapeDtypeStruct(dx.shape, dx.dtype), w, ctx, s)
                    d_aux = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, occ, keepdims=False), daux[k])
                    dx_in, dw = vjp_fn((dx, d_aux))
                    return dx_in, tuple(dw if j == k else _zeros(layer_shapes[j]) for j in range(kinds))
                return run

            dx, dws = jax.lax.switch(kind, [branch(k) for k in range(kinds)], dx)
            dstacks = tuple(put(k, dstacks[k], puts[k], ctx, dws[k]) for k in range(kinds))
            return (dx, dstacks), None

        # each kind's row the step adds to: the step's read at its own kind, past the end elsewhere
        put_at = jnp.where(kind_ids[:, None] == np.arange(kinds), reads[:, None], PAST_END)
        steps = (kind_ids, occurrence, reads, np.arange(len(kind_ids), dtype=np.int32), put_at)
        (dx, dstacks), _ = jax.lax.scan(step, (dx, dstacks), steps, reverse=True)
        return dx, dstacks, None, None

    loop.defvjp(loop_fwd, loop_bwd)
    return loop(x, tuple(stacks), ctx, reads)


def _layer_fn(apply: Apply, k: int, policy):
    def layer(x, w, ctx, step):
        return apply(k, x, w, ctx, step)
    if policy is None:
        return layer
    return jax.checkpoint(layer, policy=policy, prevent_cse=False, static_argnums=())


class _ResidualPlan:
    """Each kind's vjp residuals: their shapes (one traced vjp per kind), which of them depend on
    the layer's input (stored, one row per occurrence) and which on its weights, ctx and step
    alone (recomputed in the backward pass: the weights themselves, their sharding-constrained
    views, masks from ctx), and how to rebuild the vjp from a row.

    Telling them apart by the jaxpr's data flow, not by identity with the weight leaves: a view of
    a weight (a `sharding_constraint` inside the layer) is a new value, and stored it would be a
    copy of kind k's weights per occurrence and pipeline tick (a MoE layer's experts each time)."""

    def __init__(self, take, layer_fn):
        self.take, self.layer_fn = take, layer_fn
        self.treedefs, self.stored, self.shapes = {}, {}, {}

    def _residuals(self, k):
        def residuals(x, w, ctx, step):  # -> ((y, aux), the vjp's residual leaves)
            out, vjp_fn = jax.vjp(lambda x_, w_: self.layer_fn[k](x_, w_, ctx, step), x, w)
            leaves, self.treedefs[k] = jax.tree_util.tree_flatten(vjp_fn)
            return out, leaves
        return residuals

    def _trace(self, k, x, stack, ctx, reads):
        """Kind k's (y, aux) shapes, recording its residual layout from a trace typed like the
        loop's step (traced read and step index), so that the layout matches the loop's."""
        index = jax.ShapeDtypeStruct((), jnp.int32)

        def layout(x, stack, ctx, read, step):
            closed, (out, leaves) = jax.make_jaxpr(self._residuals(k), return_shape=True)(
                x, self.take(k, stack, read, ctx), ctx, step)
            on_x = _depends_on(closed.jaxpr, len(jax.tree.leaves(x)))[len(jax.tree.leaves(out)):]
            self.stored[k] = tuple(on_x)
            self.shapes[k] = [v for v, keep in zip(leaves, on_x) if keep]
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out[1])

        return jax.eval_shape(layout, x, stack, ctx, index, index)

    def vjp(self, k, x, w, ctx, step):
        """(y, aux), and the residual leaves that depend on x (the ones stored)."""
        out, leaves = self._residuals(k)(x, w, ctx, step)
        if len(leaves) != len(self.stored[k]):
            raise AssertionError(f"kind {k}: the step's vjp keeps {len(leaves)} residuals, "
                                 f"its traced layout {len(self.stored[k])}")
        return out, [v for v, keep in zip(leaves, self.stored[k]) if keep]

    def rebuild(self, k, rows, x_like, w, ctx, step):
        """Kind k's vjp from its stored row and the residuals recomputed from (w, ctx, step)."""
        if len(rows) != len(self.shapes[k]):
            raise AssertionError(f"kind {k}: {len(rows)} stored residuals, its vjp takes {len(self.shapes[k])}")
        args = (x_like, w, ctx, step)
        closed, (out, _) = jax.make_jaxpr(self._residuals(k), return_shape=True)(*args)
        recompute = [not keep for keep in self.stored[k]]
        jaxpr, used = pe.dce_jaxpr(closed.jaxpr, [False] * len(jax.tree.leaves(out)) + recompute)
        if any(used[:len(jax.tree.leaves(x_like))]):
            raise AssertionError(f"kind {k}: a residual recomputed in the backward pass depends on the layer input")
        kept_args = [a for a, u in zip(jax.tree.leaves(args), used) if u]
        again = iter(jax_core.jaxpr_as_fun(jax_core.ClosedJaxpr(jaxpr, closed.consts))(*kept_args))
        rows = iter(rows)
        leaves = [next(rows) if keep else next(again) for keep in self.stored[k]]
        return jax.tree_util.tree_unflatten(self.treedefs[k], leaves)


def _depends_on(jaxpr, first: int) -> list[bool]:
    """Whether each output of `jaxpr` depends on its first `first` inputs (conservatively: an
    equation with any such input makes all its outputs depend on them)."""
    dependent = set(jaxpr.invars[:first])
    is_var = lambda v: not isinstance(v, jax_core.Literal)
    for eqn in jaxpr.eqns:
        if any(is_var(v) and v in dependent for v in eqn.invars):
            dependent.update(eqn.outvars)
    return [is_var(v) and v in dependent for v in jaxpr.outvars]


def _zeros(shapes):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _zero_aux(aux_shapes, counts):
    return tuple(jax.tree.map(lambda s, n=n: jnp.zeros((n,) + s.shape, s.dtype), shapes)
                 for shapes, n in zip(aux_shapes, counts))


def _apply_only(plan: _ResidualPlan, x, stacks, ctx, reads, kind_ids, occurrence, counts):
    """The loop's value without its residuals: (x, [aux of kind k stacked over its steps])."""
    kinds = len(stacks)

    def step(carry, inputs):
        x, aux = carry
        kind, occ, read, s = inputs

        def branch(k):
            def run(x, aux):
                y, a = plan.layer_fn[k](x, plan.take(k, stacks[k], read, ctx), ctx, s)
                new_aux = list(aux)
                new_aux[k] = jax.tree.map(lambda t, v: jax.lax.dynamic_update_index_in_dim(t, v, occ, 0), aux[k], a)
                return y, tuple(new_aux)
            return run

        return jax.lax.switch(kind, [branch(k) for k in range(kinds)], x, aux), None

    index = jax.ShapeDtypeStruct((), jnp.int32)
    aux_shapes = [jax.eval_shape(lambda x, st, c, r, t, k=k: plan.layer_fn[k](x, plan.take(k, st, r, c), c, t)[1],
                                 x, stacks[k], ctx, index, index) for k in range(kinds)]
    steps = (kind_ids, occurrence, reads, np.arange(len(kind_ids), dtype=np.int32))
    (x, aux), _ = jax.lax.scan(step, (x, _zero_aux(aux_shapes, counts)), steps)
    return x, list(aux)


def _forward(plan: _ResidualPlan, x, stacks, ctx, reads, kind_ids, occurrence, counts):
    """The loop's forward: (x, aux per kind), and each kind's residual buffers ([count, ...]). The
    switch returns one step's residuals of every kind (zeros for the kinds not run); each kind's
    are written into its buffers after it, so the buffers are not operands of the conditional:
    XLA copies every buffer passing through a branch that does not write it, at every step. A kind
    not run writes past its buffers' end, a write the scatter drops: no read, no select (writing
    back the row it read would cost three ops per residual leaf and step)."""
    kinds = len(stacks)
    aux_shapes = [plan._trace(k, x, stacks[k], ctx, reads) for k in range(kinds)]
    buffers = [tuple(jnp.zeros((counts[k],) + s.shape, s.dtype) for s in plan.shapes[k]) for k in range(kinds)]
    aux_zero = _zero_aux(aux_shapes, counts)
    # the row of kind k's buffers each step writes: its occurrence, or past the end (dropped)
    rows_at = np.stack([np.where(kind_ids == k, occurrence, counts[k]) for k in range(kinds)], axis=1).astype(np.int32)

    def step(carry, inputs):
        x, aux, buffers = carry
        # The step's indices are constants: tied to the carry, so that autodiff of a loop around
        # this one (a pipeline's ticks) cannot hoist what derives from them and the weights alone
        # out of its body as per-slot stacks held for the whole step.
        x, inputs = jax.lax.optimization_barrier((x, inputs))
        kind, read, s, at = inputs

        def branch(k):
            def run(x):
                w = plan.take(k, stacks[k], read, ctx)
                (y, a), res = plan.vjp(k, x, w, ctx, s)
                if len(res) != len(buffers[k]):
                    raise AssertionError(f"kind {k}: the step's vjp keeps {len(res)} residuals, "
                                         f"its buffers hold {len(buffers[k])}")
                rows = tuple(tuple(res) if j == k else _zeros(tuple(plan.shapes[j])) for j in range(kinds))
                return y, tuple(a if j == k else _zeros(aux_shapes[j]) for j in range(kinds)), rows
            return run

        y, step_aux, rows = jax.lax.switch(kind, [branch(k) for k in range(kinds)], x)

        def write(stack, row, k):
            return stack.at[at[k]].set(row, mode="drop")

        buffers = tuple(tuple(write(b, r, k) for b, r in zip(buffers[k], rows[k])) for k in range(kinds))
        aux = tuple(jax.tree.map(lambda t, v, k=k: write(t, v, k), aux[k], step_aux[k]) for k in range(kinds))
        return (y, aux, buffers), None

    steps = (kind_ids, reads, np.arange(len(kind_ids), dtype=np.int32), rows_at)
    (x, aux, buffers), _ = jax.lax.scan(step, (x, tuple(aux_zero), tuple(buffers)), steps)
    return (x, list(aux)), buffers
