"""Token embedding and the language-model head (tied to the embedding or not)."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from models.layers.params import normal, param


class Embed(nnx.Module):
    def __init__(self, vocab: int, embed: int, *, rngs: nnx.Rngs, init_std: float = 0.02, dtype=None):
        self.dtype = dtype
        self.table = param(rngs, normal(init_std), (vocab, embed), ("vocab", "embed"))

    def __call__(self, tokens):
        return jnp.take(self.table[...], tokens, axis=0).astype(self.dtype)

    def attend(self, x):
        """Logits against the embedding table (tied head)."""
        return jnp.einsum("...d,vd->...v", x.astype(self.dtype), self.table[...].astype(self.dtype))


class LMHead(nnx.Module):
    def __init__(self, embed: int, vocab: int, *, rngs: nnx.Rngs, init_std: float = 0.02, dtype=None):
        self.dtype = dtype
        self.kernel = param(rngs, normal(init_std), (embed, vocab), ("embed", "vocab"))

    def __call__(self, x):
        return jnp.einsum("...d,dv->...v", x.astype(self.dtype), self.kernel[...].astype(self.dtype))
