"""The one loop over layers that every stack runs: a plain stack, a hybrid pattern, a pipeline stage.

`scan_layers` applies a sequence of layers as one `lax.scan`, one layer per step, so XLA compiles
one layer of each kind whatever the depth and the order of kinds:

- one kind in one stacked state: the scan slices each step's weights as its input;
- otherwise each step slices its weights itself (`weights_at`): one layer of every kind (its own,
  and an unused one of each other kind, as a `lax.switch` hands every branch the same operands),
  then switches on its kind. Every branch returns every kind's aux (zeros for the kinds it is
  not); each kind's rows are picked out afterwards, in step order.

The remat policy wraps the whole step once, weight slicing included, and never saves the weights
a step sliced (`step_policy`): the backward pass slices them again instead of keeping a copy per
step. A step may be masked (`keep` False: a pipeline stage's padding slot): its output is
discarded, the carry passes through and its aux is zero, so neither the result nor the gradient
depends on it.

Under autodiff a switch keeps the residuals of every branch at every step (zeros for the kinds
that did not run): with remat `full` that is only the step's input; with `none` or `dots` each
step keeps what every kind would save (models/layers/kind_residuals.py has the switch with its
own VJP that a pipeline stage runs there).
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.pallas_kernels.low_precision_dot import inner_dot


def _rounded_dots_as_dots(policy):
    """`policy`, deciding for a rounded bf16 matmul (pallas_kernels/low_precision_dot.py, a custom
    VJP call on CPU) as for the dot inside it."""
    def decide(prim, *avals, **params):
        dot = inner_dot(prim, params)
        return policy(prim, *avals, **params) if dot is None else policy(dot[0], *dot[1], **dot[2])
    return decide


REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": _rounded_dots_as_dots(jax.checkpoint_policies.dots_saveable),
    "dots_no_batch": _rounded_dots_as_dots(jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
    # as dots_no_batch, but the saved matmul outputs wait for the backward pass in host memory
    # (activation offload: device memory of recomputation, without its FLOPs)
    "offload_dots": _rounded_dots_as_dots(jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")),
}

Layer = Callable  # (x, one layer's weights) -> (x, aux)
WEIGHTS = "layer_weights"  # checkpoint name of the weights a step slices


def check_remat(remat: str) -> str:
    if remat not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy {remat!r}; choose one of {sorted(REMAT_POLICIES)}")
    return remat


# What a step does to slice its weights out of the stacks (and tag them): values these produce
# are views, recomputed in the backward pass instead of saved.
_VIEWS = frozenset({"dynamic_slice", "slice", "gather", "squeeze", "reshape", "broadcast_in_dim", "sharding_constraint",
                    "name", "optimization_barrier"})


def _save_all_but_views(prim, *avals, **params) -> bool:
    return prim.name not in _VIEWS


def step_policy(remat: str, sliced: bool):
    """The checkpoint policy of one step (None: no checkpoint). Weights sliced in the step are
    never saved for the backward pass: under `none` everything but views is (no arithmetic is
    recomputed), and the other policies save only matmul outputs anyway. Saved, the slices would
    be one layer of every kind per step (and, inside a pipeline's tick loop, per tick): `none`
    without a policy kept a copy of every kind's weights per step (a switch's operands are all
    live), `save_anything_except_these_names` keeps the slice that the named value came from."""
    if remat == "none":
        return _save_all_but_views if sliced else None
    return REMAT_POLICIES[check_remat(remat)]


def scan_layers(layers: Sequence[Layer], x, steps, weights_at: Callable | None = None, *, kind_ids=None,
                keep=None, remat: str = "none"):
    """Applies one layer per step, in step order.

    layers[k]: applies one layer of kind k. steps: the scan's per-step input (leading axis: steps).
    weights_at(step) -> one layer's weights for every kind (a tuple, one entry per kind), sliced
    in the step; None: `steps` are the one kind's stacked weights, sliced by the scan.
    kind_ids: int [steps], each step's kind (static; may be None with one kind).
    keep: bool [steps] or None; a step with keep False is a no-op (x passes, aux zero).
    Returns (x, [aux of kind k: leaves stacked over kind k's steps, in step order]).
    """
    if len(layers) > 1 and (kind_ids is None or weights_at is None):
        raise ValueError(f"{len(layers)} kinds of layer need each step's kind (kind_ids) and weights_at")
    policy = step_policy(remat, sliced=weights_at is not None)
    if weights_at is None:
        weights = lambda step_input: (step_input,)
    else:
        weights = lambda step_input: jax.tree.map(lambda w: checkpoint_name(w, WEIGHTS), weights_at(step_input))
    apply = _one_kind(layers[0], weights) if len(layers) == 1 else _switch(layers, x, steps, weights)

    def step(carry, inputs):
        step_input, kind, ok = inputs
        y, aux = apply(carry, step_input, kind)
        if ok is None:
            return y, aux
        return jnp.where(ok, y, carry), jax.tree.map(lambda a: jnp.where(ok, a, jnp.zeros_like(a)), aux)

    if policy is not None:
        step = jax.checkpoint(step, policy=policy, prevent_cse=False)
    kind_ids = None if kind_ids is None or len(layers) == 1 else np.asarray(kind_ids, np.int32)
    x, per_step = jax.lax.scan(step, x, (steps, kind_ids, keep))
    if kind_ids is None:
        return x, [per_step]
    rows = [np.flatnonzero(kind_ids == k) for k in range(len(layers))]
    return x, [jax.tree.map(lambda a, r=r: a[r], per_step[k]) for k, r in enumerate(rows)]


def _one_kind(layer: Layer, weights: Callable):
    return lambda carry, step_input, kind: layer(carry, weights(step_input)[0])


def _switch(layers: Sequence[Layer], x, steps, weights: Callable):
    one_step = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), steps)
    aux_shapes = [jax.eval_shape(lambda c, s, k=k: layers[k](c, weights(s)[k])[1], x, one_step)
                  for k in range(len(layers))]

    def branch(k):
        def apply(carry, weights):
            y, aux = layers[k](carry, weights[k])
            zeros = [jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shape) for shape in aux_shapes]
            return y, tuple(aux if j == k else zeros[j] for j in range(len(layers)))
        return apply

    branches = [branch(k) for k in range(len(layers))]
    def apply(carry, step_input, kind):
        # The slice indices are constants: tied to the carry, so that a loop around this one (a
        # pipeline's ticks, microbatches) cannot hoist every kind's slices and what is derived
        # from them out of its body and keep them per step for the backward pass.
        carry, step_input = jax.lax.optimization_barrier((carry, step_input))
        return jax.lax.switch(kind, branches, carry, weights(step_input))
    return apply
