"""How a sequence is laid out over the `context` mesh axis, and the active context settings.

The sequence of length L is cut into `context x chunks_per_rank` equal chunks; rank r holds
the chunks `layout.chunk_ids(C)[r]`, concatenated in that order along its local length. The
whole row in *device order* is the ranks' local pieces one after another, and
`device_order(layout, L, C)[p]` is the original place of the token at device position p.

  Contiguous     rank r holds chunk r. Causal attention then leaves rank 0 almost idle and
                 rank C-1 doing C times its work.
  LoadBalanced   rank r holds chunks r and 2C-1-r (the "zigzag" order), so every rank does the
                 same causal work.

The train and eval steps permute each batch into device order (`to_device_order`): inputs,
targets, positions, segment ids and loss mask move together, so per-token losses are the same
numbers in another order and the loss (a sum over tokens) is unchanged. Layers that look along
the sequence (attention, the Mamba scan and conv) read the layout to know where their tokens
came from. Outside a step (a model called directly) the layout is Contiguous: nothing moves.
"""
from __future__ import annotations

import contextlib
import contextvars

import jax.numpy as jnp

# The settings are jax-free values (a ParallelPlan holds them); re-exported here, where they apply.
from jaxtrain.meshes.context_settings import (AllGatherKV, ContextParallel, Contiguous, LatentKV, LoadBalanced,  # noqa: F401
                                     RingKV, device_order)

_DIRECT_CALLS = ContextParallel(layout=Contiguous())
_ACTIVE: contextvars.ContextVar[ContextParallel] = contextvars.ContextVar("jaxtrain_context", default=_DIRECT_CALLS)


@contextlib.contextmanager
def use_context_parallel(settings: ContextParallel | None):
    """Layers traced inside this block use `settings` (None: Contiguous, ring)."""
    token = _ACTIVE.set(settings or _DIRECT_CALLS)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_context_parallel() -> ContextParallel:
    return _ACTIVE.get()


def context_size() -> int:
    """Size of the `context` axis of the active mesh (1 outside `use_rules`)."""
    from jaxtrain.meshes.rules import active_mesh
    mesh = active_mesh()
    return 1 if mesh is None else mesh.shape["context"]


def to_device_order(batch: dict, axis: int = 1) -> dict:
    """Every array of `batch` permuted along `axis` (the sequence) into the active layout's
    device order; unchanged without context parallelism or with the Contiguous layout."""
    context, layout = context_size(), active_context_parallel().layout
    if context == 1 or isinstance(layout, Contiguous):
        return batch
    some = next(iter(batch.values()))
    order = jnp.asarray(device_order(layout, some.shape[axis], context))
    return {k: jnp.take(v, order, axis=axis) for k, v in batch.items()}


def local_token_index(length_local: int, context: int, rank):
    """[length_local] int32: original places of the tokens a context rank holds (rank may be a
    traced `axis_index`)."""
    layout = active_context_parallel().layout
    order = jnp.asarray(device_order(layout, length_local * context, context))
    return jnp.asarray(order).reshape(context, length_local)[rank]
