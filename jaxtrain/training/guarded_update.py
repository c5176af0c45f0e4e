"""The optimizer step under the non-finite guard, without holding the new state next to the old.

The guard keeps the old state when a step is not finite. Computed as "new state, then select
old or new", XLA must hold the new parameters and both new moments next to the old ones until
the check is known: ~3 moments of temp (Llama-3-8B `data=4,tensor=4,rules=zero1`: 3.93).
Instead (benchmarks/update_memory.py measures both):

1. the check runs first, as reductions only: the loss, the gradient norm, and whether the
   would-be parameters are all finite (`isfinite().all()` per leaf, which XLA fuses with the
   AdamW arithmetic that produces them and keeps nothing);
2. the update then runs under `lax.cond` on that check: its branch writes each new leaf over
   the donated old one, and the other branch hands the old state back untouched (bit for bit).

The AdamW arithmetic runs twice; it is elementwise, cheap next to the step, and saves the
moments' worth of memory that sets the peak of small-activation layouts.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.meshes.leaf_sums import leaf_sums, squares


def guarded_step(apply, params, opt_state, grads, finite_before, *, sum_leaves=leaf_sums):
    """(new params, new optimizer state, param norm, finite): `apply(params, opt_state, grads)
    -> (new params, new opt_state)` taken only where `finite_before` (loss, gradient norm) and
    the would-be parameters are finite, else the old state. `param_norm` is the kept
    parameters' norm, +inf when the would-be parameters were not finite. `sum_leaves(local_sum,
    tree) -> [leaves]`: how the norm's per-leaf sums are reduced (meshes/leaf_sums.py: one collective)."""
    would_be = apply(params, opt_state, grads)[0]
    # Per leaf in XLA's layout, not through sum_leaves: a shard_map's edge would stop XLA fusing
    # the check into the AdamW arithmetic and materialize the would-be parameters (under zero1
    # the update's temp would grow to several moments' worth; tests/test_update_memory.py).
    params_finite = jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(would_be)]).all()
    finite = finite_before & params_finite
    new_params, new_opt_state = jax.lax.cond(finite, apply, lambda p, o, g: (p, o), params, opt_state, grads)
    param_norm = jnp.where(params_finite, jnp.sqrt(sum_leaves(squares, new_params).sum()), jnp.inf)
    return new_params, new_opt_state, param_norm, finite
