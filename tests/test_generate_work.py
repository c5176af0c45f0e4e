"""A decode step's work grows with the filled cache, not max_len (issue 24): attention reads only
the cache blocks holding a row's entries (models/layers/decode_attention.py), and the stacks write
each layer's new entry into the stacked cache in place (models/layers/decode_cache.py) instead
of copying any layer's whole cache."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import jaxpr_shapes
from flax import nnx

from jaxtrain.models.layers.attention_impl import BlockwiseAttention
from jaxtrain.models.layers.decode_attention import grouped_query_decode, latent_decode
from jaxtrain.models.layers.decode_cache import LayerCache

pytestmark = [pytest.mark.slow]

B, MAX_LEN, KV_HEADS, GROUPS, D, DV, LATENT, ROPE = 3, 40, 2, 3, 8, 6, 10, 4
VALID_FROM = np.array([19, 13, 26], np.int32)  # the first block holds only pads: skipped


def float64_attention(scores, values, visible):
    """softmax over the visible entries (last axis of scores) times values, in float64."""
    scores = np.where(visible, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return probs @ values


def reference(kind, arrays, index):
    visible = (np.arange(MAX_LEN)[None] >= VALID_FROM[:, None]) & (np.arange(MAX_LEN)[None] <= index)
    a = {k: np.asarray(v, np.float64) for k, v in arrays.items()}
    if kind == "gqa":  # q [b, 1, kv*g, d]; k/v [b, L, kv, d|dv]
        q = a["q"].reshape(B, KV_HEADS, GROUPS, D)
        scores = np.einsum("bkgd,bskd->bkgs", q, a["k"]) * 0.5
        out = float64_attention(scores, a["v"].transpose(0, 2, 1, 3), visible[:, None, None])
        return out.reshape(B, 1, KV_HEADS * GROUPS, DV)
    scores = (np.einsum("bhc,bkc->bhk", a["q_latent"], a["latent"])
              + np.einsum("bhr,bkr->bhk", a["q_rope"], a["k_rope"])) * 0.5
    return float64_attention(scores, a["latent"], visible[:, None])


@pytest.fixture(scope="module")
def arrays():
    rng = np.random.default_rng(0)
    shapes = {"q": (B, 1, KV_HEADS * GROUPS, D), "k": (B, MAX_LEN, KV_HEADS, D), "v": (B, MAX_LEN, KV_HEADS, DV),
              "q_latent": (B, KV_HEADS * GROUPS, LATENT), "q_rope": (B, KV_HEADS * GROUPS, ROPE),
              "latent": (B, MAX_LEN, LATENT), "k_rope": (B, MAX_LEN, ROPE)}
    return {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}


@pytest.mark.parametrize("block", [8, 12], ids=["block-divides", "last-block-pulled-back"])
@pytest.mark.parametrize("kind", ["gqa", "latent"])
def test_reads_only_the_filled_blocks_and_equals_a_float64_softmax(arrays, kind, block):
    """The loop's trip count (an instrumented counter in its carry) is the number of blocks that
    hold entries [min(valid_from), index]; the result is the float64 softmax over each row's
    entries [valid_from, index]. One compile serves every index."""
    traces = []

    def attend(arrays, index):
        traces.append(1)
        if kind == "gqa":
            cache = LayerCache({"k": arrays["k"], "v": arrays["v"]})
            return grouped_query_decode(arrays["q"], cache, index=index, valid_from=jnp.asarray(VALID_FROM),
                                        scale=0.5, block=block)
        cache = LayerCache({"latent": arrays["latent"], "k_rope": arrays["k_rope"]})
        return latent_decode(arrays["q_latent"], arrays["q_rope"], cache, index=index,
                             valid_from=jnp.asarray(VALID_FROM), scale=0.5, block=block)

    attend = jax.jit(attend)
    for index in (26, 31, 35, MAX_LEN - 1):
        out, blocks = attend(arrays, jnp.int32(index))
        touched = {entry // block for entry in range(VALID_FROM.min(), index + 1)}
        assert int(blocks) == len(touched), (index, int(blocks), sorted(touched))
        out, expected = np.asarray(out), reference(kind, arrays, index)
        assert np.isfinite(out).all() and np.isfinite(expected).all()
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    assert len(traces) == 1
    _, blocks = attend(arrays, jnp.int32(26))
    assert int(blocks) < -(-MAX_LEN // block)  # early steps read fewer blocks than the cache has


def tiny_llama(block):
    from jaxtrain.models.llama import LlamaConfig
    return LlamaConfig(vocab_size=64, embed=32, layers=3, heads=4, kv_heads=2, mlp=48,
                       attention=BlockwiseAttention(decode_block=block))


def tiny_hybrid(block):
    from test_nemotron_h import TINY_NEMOTRON_H
    return dataclasses.replace(TINY_NEMOTRON_H, pattern=("mamba", "attention", "mlp", "attention", "mamba"),
                               attention=BlockwiseAttention(decode_block=block))


@pytest.mark.parametrize("family", ["llama", "nemotron_h"], ids=["layer-stack", "pattern-stack"])
def test_decode_step_holds_nothing_max_len_wide_but_the_caches(family):
    """The whole decode step as the engine jits it: the only arrays spanning max_len are the
    stacked caches themselves (updated in place); no layer's cache is sliced out whole, no
    scores span the cache; attention reads [b, block, ...] pieces."""
    from jaxtrain.generate import Engine
    from jaxtrain.generate.sampling import Sampling

    block, max_len, batch = 16, 88, 3  # 88: no other width of these tiny models
    cfg = (tiny_llama if family == "llama" else tiny_hybrid)(block)
    model = cfg.build(nnx.Rngs(0))
    engine = Engine(model)
    cache = jax.eval_shape(lambda: model.init_cache(batch, max_len, jnp.float32))
    jaxpr = jax.make_jaxpr(lambda state, cache: engine._decode_fn(
        state, cache, jnp.zeros(batch, jnp.int32), jnp.int32(40), jnp.zeros(batch, jnp.int32), jax.random.key(0),
        sampling=Sampling()))(engine.state, cache)
    shapes = set(jaxpr_shapes(jaxpr.jaxpr))
    stacked = {tuple(leaf.shape) for leaf in jax.tree.leaves(cache)}
    wide = {s for s in shapes if max_len in s} - stacked
    assert not wide, f"decode forms max_len-wide arrays besides the stacked caches: {sorted(wide)}"
    kv_heads, head_dim = next(leaf.shape[-2:] for leaf in jax.tree.leaves(cache) if leaf.ndim == 5)
    assert (batch, block, kv_heads, head_dim) in shapes  # the pieces attention reads


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    return [rng.integers(3, 60, n).tolist() for n in (5, 11, 3)]


@pytest.mark.parametrize("family", ["llama", "nemotron_h"], ids=["layer-stack", "pattern-stack"])
def test_many_block_decode_logits_equal_the_full_forward(family, prompts):
    """Blocks of 5 entries (not dividing the 48-entry cache, the first block skipped for every
    row): each step's logits equal the training forward's at that position (relative 1e-5)."""
    from hf_tiny_models import forward
    from jaxtrain.generate import Engine

    new = 20
    model = (tiny_llama if family == "llama" else tiny_hybrid)(5).build(nnx.Rngs(2))
    steps = {}
    rows = Engine(model, bucket=16).generate(prompts, max_new_tokens=new,
                                             on_logits=lambda step, logits: steps.__setitem__(step, logits))
    cached = np.stack([steps[s] for s in range(new)], axis=1)
    sequences = [p + r[:-1] for p, r in zip(prompts, rows)]
    tokens = np.zeros((len(sequences), max(map(len, sequences))), np.int32)
    for row, seq in enumerate(sequences):
        tokens[row, :len(seq)] = seq  # right-padded: causal, so the pads change nothing before them
    full = np.asarray(forward(model, tokens))
    expected = np.stack([full[row, len(p) - 1:len(p) - 1 + new] for row, p in enumerate(prompts)])
    assert np.isfinite(cached).all() and np.isfinite(expected).all()
    np.testing.assert_allclose(cached, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_a_bad_decode_block_is_named():
    from jaxtrain.models.layers.decode_attention import decode_block
    with pytest.raises(ValueError, match="decode_block must be a whole number >= 1, got 0"):
        decode_block(BlockwiseAttention(decode_block=0))
