"""Sampling (jaxtrain/generate/sampling.py) against a numpy reference of the filtered distribution:
the set of tokens that can be drawn, and empirical frequencies over many seeds."""
from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.generate.sampling import Sampling, filter_logits, sample

pytestmark = [pytest.mark.slow]

VOCAB = 8


def reference_probs(logits: np.ndarray, s: Sampling) -> np.ndarray:
    """float64 numpy: temperature, top-k (ties with the k-th kept), then the smallest most-likely
    set whose mass reaches top_p; the renormalized distribution over what is left."""
    z = logits.astype(np.float64) / s.temperature
    if s.top_k:
        z = np.where(z >= np.sort(z)[::-1][s.top_k - 1], z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if s.top_p < 1:
        order = np.argsort(-p, kind="stable")
        keep, mass = np.zeros(len(p), bool), 0.0
        for i in order:
            if mass >= s.top_p:
                break
            keep[i], mass = True, mass + p[i]
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


CASES = [Sampling(1.0), Sampling(0.7, top_k=3), Sampling(1.3, top_p=0.6), Sampling(1.0, top_k=5, top_p=0.8),
         Sampling(0.5, top_p=0.3)]


@pytest.mark.parametrize("s", CASES, ids=str)
def test_filtered_support_and_frequencies_match_numpy_reference(s):
    logits = np.random.default_rng(zlib.crc32(str(s).encode())).normal(size=(1, VOCAB)).astype(np.float32) * 1.5
    expected = reference_probs(logits[0], s)
    kept = np.isfinite(np.asarray(filter_logits(jnp.asarray(logits), s)))[0]
    np.testing.assert_array_equal(kept, expected > 0)
    draws = 20000
    keys = jax.random.split(jax.random.key(7), draws)
    tokens = np.asarray(jax.jit(jax.vmap(lambda k: sample(jnp.asarray(logits), k, s)[0]))(keys))
    freq = np.bincount(tokens, minlength=VOCAB) / draws
    assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(expected))
    np.testing.assert_allclose(freq, expected, atol=4 * np.sqrt(0.25 / draws))  # 4 sigma at worst


def test_greedy_is_argmax_and_seeds_repeat():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 50)), jnp.float32)
    np.testing.assert_array_equal(sample(logits, jax.random.key(0), Sampling()), np.argmax(logits, -1))
    s = Sampling(1.0, top_k=20)
    same = [np.asarray(sample(logits, jax.random.key(3), s)) for _ in range(2)]
    np.testing.assert_array_equal(*same)
    others = np.stack([np.asarray(sample(logits, jax.random.key(k), s)) for k in range(10)])
    assert len({tuple(r) for r in others}) > 1


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1)])
def test_bad_sampling_settings_are_named(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        Sampling(**bad)
