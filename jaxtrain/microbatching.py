"""A global batch cut into microbatches, and the one loss formula over them.

Both ways of running microbatches use these: one after another with gradient accumulation
(jaxtrain/training/step.py) and through pipeline stages (jaxtrain/pipeline/gradients.py). They
live below both packages so that the pipeline does not import the training step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.meshes.rules import constrain
from jaxtrain.models.layers.aux_outputs import total_aux_loss

ROW = ("batch", "length")


def training_loss(sums, aux, total_tokens, microbatches: int):
    """The one loss formula: token-summed cross-entropy (+ z-loss) over the whole batch's
    tokens, plus the layers' aux losses (each a mean over its microbatch's tokens, so averaged
    over microbatches)."""
    nll, z, _ = sums
    return (nll + z) / total_tokens + total_aux_loss(aux) / microbatches


def split_microbatches(batch, microbatches: int):
    """[B, L] -> [m, B/m, L], microbatch i taking rows i, i+m, ... so that every data shard
    contributes to every microbatch and no rows move between devices."""
    def split(x):
        b = x.shape[0]
        x = x.reshape((b // microbatches, microbatches) + x.shape[1:])
        return constrain(jnp.swapaxes(x, 0, 1), (None,) + ROW)
    return jax.tree.map(split, batch)
