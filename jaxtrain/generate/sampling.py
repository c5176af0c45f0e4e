"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus), seeded.

The filters follow the usual order (temperature, then top-k, then top-p); a filtered-out token
gets -inf, so it is never drawn. Keys come from one seed folded with the step number, and jax's
partitionable threefry draws the same bits on any sharding: same seed, same tokens, any layout.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy (top_k / top_p unused). top_k 0: no top-k filter; top_p 1: no
    nucleus filter."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be a whole number >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits, sampling: Sampling):
    """logits [b, vocab] -> float32 logits scaled by 1/temperature, -inf outside top-k / top-p."""
    logits = logits.astype(jnp.float32) / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][..., -1:]
        logits = jnp.where(logits >= kth, logits, -jnp.inf)  # ties with the k-th stay in
    if sampling.top_p < 1:
        # keep the smallest set of most likely tokens whose mass reaches top_p: a token stays if
        # the mass of the tokens strictly more likely than it is below top_p
        order = jnp.argsort(-logits, axis=-1)
        sorted_probs = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), order, axis=-1)
        mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = mass_before < sampling.top_p
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
        logits = jnp.where(keep, logits, -jnp.inf)
    return logits


def sample(logits, key, sampling: Sampling):
    """Next tokens [b] int32 from logits [b, vocab]."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filter_logits(logits, sampling), axis=-1).astype(jnp.int32)
