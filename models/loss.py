"""Cross-entropy over the vocabulary without materializing float32 logits for the whole batch.

The sequence is cut into chunks; each chunk's logits are computed, reduced to per-token
loss in float32 and dropped, and recomputed in the backward pass (`jax.checkpoint`). With
the vocabulary split over `tensor` (the rule tables do that) the log-sum-exp is a sharded
reduction, so no device ever holds full-vocabulary logits either.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxtrain.meshes.context_layout import context_size


def token_losses(logits, targets):
    """Per-token negative log-likelihood and log-partition, in float32."""
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return log_z - target_logit, log_z


def chunked_cross_entropy(logits_fn: Callable, hidden, targets, loss_mask, *, chunk: int,
                          z_loss: float = 0.0):
    """Sums over the tokens where loss_mask is set: (nll, z_loss term, correct top-1 count)."""
    b, length = targets.shape
    # Under context parallelism each rank loops over chunks of its own part of the sequence
    # ([b, ranks, chunks, chunk] with `ranks` split over context): a loop over chunks of the
    # whole row would walk across ranks and make XLA gather hidden states and logit gradients.
    ranks = context_size() if length % context_size() == 0 else 1
    chunk = min(chunk, length // ranks)
    if (length // ranks) % chunk:
        raise ValueError(f"sequence length {length} / {ranks} context ranks is not a multiple of the loss chunk "
                         f"{chunk}")
    n = length // ranks // chunk

    @jax.checkpoint
    def one_chunk(h, t, m):
        logits = logits_fn(h)
        nll, log_z = token_losses(logits, t)
        correct = (jnp.argmax(logits, axis=-1) == t).astype(jnp.float32)
        return jnp.stack([(nll * m).sum(), (z_loss * jnp.square(log_z) * m).sum(), (correct * m).sum()])

    if n == 1:
        sums = one_chunk(hidden, targets, loss_mask)
    else:
        # [b, ranks * n * chunk, ...] -> [n, b, ranks * chunk, ...]: step i takes chunk i of every rank.
        def split(a):
            a = a.reshape((b, ranks, n, chunk) + a.shape[2:])
            return jnp.moveaxis(a, 2, 0).reshape((n, b, ranks * chunk) + a.shape[4:])
        sums = jax.lax.map(lambda xs: one_chunk(*xs), (split(hidden), split(targets), split(loss_mask))).sum(0)
    return sums[0], sums[1], sums[2]
