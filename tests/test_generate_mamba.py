"""Generation with the Mamba-2 recurrent state (models/layers/mamba2.py) and hybrid pattern caches
(models/layers/pattern_stack.py): prefill + decode equal the training forward, the prefilled state
equals a float64 recurrence, the cache does not grow with max_len, and tiny Mamba2 / Nemotron-H
models imported from transformers generate greedily what transformers' generate does."""
from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.layers.mamba2 import Mamba2Mixer, SSMConfig

CFG = SSMConfig(heads=4, head_dim=8, state=8, groups=2, conv_kernel=4, chunk_size=4, time_step_limit=(0.0, 0.3))
EMBED, PROMPT, NEW = 16, 7, 6
VALID_FROM = np.array([0, 3, 6])  # row 2 has one prompt token: fewer than conv_kernel - 1


@pytest.fixture(scope="module")
def mixer():
    m = Mamba2Mixer(EMBED, CFG, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)  # D, the norm scale and dt_bias away from their init constants
    m.D[...] = jnp.asarray(rng.normal(size=CFG.heads), jnp.float32)
    m.norm.scale[...] = jnp.asarray(1 + 0.3 * rng.normal(size=(CFG.heads, CFG.head_dim)), jnp.float32)
    m.dt_bias[...] = jnp.asarray(rng.normal(size=CFG.heads), jnp.float32)
    return m


def left_padded(valid_from, length):
    seg = (np.arange(length)[None] >= valid_from[:, None]).astype(np.int32)
    return seg, np.maximum(np.arange(length)[None] - valid_from[:, None], 0).astype(np.int32)


@pytest.fixture(scope="module")
def run(mixer):
    """Training forward over prompt + new tokens, and prefill of the prompt then one decode per token."""
    x = jnp.asarray(np.random.default_rng(1).normal(size=(len(VALID_FROM), PROMPT + NEW, EMBED)), jnp.float32)
    seg, pos = left_padded(VALID_FROM, PROMPT + NEW)
    graphdef, state = nnx.split(mixer)
    full = jax.jit(lambda s, x, seg: nnx.merge(graphdef, s)(x, seg))(state, x, seg)

    def prefill(s, x, pos, seg):
        m = nnx.merge(graphdef, s)
        return m.prefill(x, pos, seg, m.init_cache(x.shape[0], 64, jnp.float32))

    decode = jax.jit(lambda s, x, pos, cache, index: nnx.merge(graphdef, s).decode(
        x, pos, cache, index, jnp.asarray(VALID_FROM)))
    out, cache = jax.jit(prefill)(state, x[:, :PROMPT], pos[:, :PROMPT], seg[:, :PROMPT])
    caches, steps = [cache], [out]
    for t in range(PROMPT, PROMPT + NEW):
        out, cache = decode(state, x[:, t:t + 1], pos[:, t:t + 1], cache, jnp.int32(t))
        caches.append(cache)
        steps.append(out)
    return types.SimpleNamespace(x=x, seg=seg, full=np.asarray(full), out=np.concatenate(steps, axis=1),
                                 caches=caches, decode=decode, state=state)


def test_prefill_then_decode_equals_training_forward(run):
    real = run.seg.astype(bool)  # pad positions' outputs are nobody's concern
    assert np.isfinite(run.out).all() and np.isfinite(run.full).all()
    scale = np.abs(run.full[real]).max()
    np.testing.assert_allclose(run.out[real], run.full[real], rtol=1e-5, atol=1e-5 * scale)
    # every decoded position on its own (the decode steps are the claim)
    np.testing.assert_allclose(run.out[:, PROMPT:], run.full[:, PROMPT:], rtol=1e-5, atol=1e-5 * scale)


def test_prefilled_state_and_windows_equal_a_float64_recurrence(mixer, run):
    """Each row's real tokens alone through the projections and conv, then the recurrence
    s = exp(dt A) s + dt x (x) B in float64 numpy: the prefill's state (pads restart nothing into it)."""
    cache = run.caches[0]
    a = -np.exp(np.asarray(mixer.A_log[...], np.float64))
    hpg = CFG.heads // CFG.groups
    for row, start in enumerate(VALID_FROM):
        x = run.x[row:row + 1, start:PROMPT]
        ones = jnp.ones(x.shape[:2], jnp.int32)
        _, pre, dt = mixer._project(x)
        xs, b, c = (np.asarray(v[0], np.float64) for v in mixer._conv(*pre, ones))
        dt = np.asarray(dt[0], np.float64)
        s = np.zeros((CFG.heads, CFG.head_dim, CFG.state))
        for t in range(x.shape[1]):
            bt = np.repeat(b[t], hpg, axis=0)  # [heads, state]
            s = np.exp(dt[t] * a)[:, None, None] * s + (dt[t][:, None] * xs[t])[:, :, None] * bt[:, None, :]
        got = np.asarray(cache["state"][row])
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, s, rtol=1e-5, atol=1e-6 * np.abs(s).max())
        # the conv window: the last conv_kernel - 1 raw inputs, zeros before the row's first token
        raw = np.asarray(pre[0][0])
        want = np.zeros((CFG.conv_kernel - 1,) + raw.shape[1:])
        tail = raw[-(CFG.conv_kernel - 1):]
        want[want.shape[0] - len(tail):] = tail
        np.testing.assert_allclose(np.asarray(cache["conv_x"][row]), want, rtol=1e-6, atol=1e-7)


def test_cache_is_constant_size_whatever_max_len(mixer, run):
    shapes = lambda max_len: jax.eval_shape(lambda: mixer.init_cache(3, max_len, jnp.bfloat16))
    short, long = shapes(16), shapes(1 << 20)
    assert short == long
    k, h, p, g, n = CFG.conv_kernel - 1, CFG.heads, CFG.head_dim, CFG.groups, CFG.state
    assert {key: v.shape for key, v in short.items()} == {
        "state": (3, h, p, n), "conv_x": (3, k, h, p), "conv_b": (3, k, g, n), "conv_c": (3, k, g, n)}
    # the decode step hands back a cache of exactly the shapes it was given, at every step
    for before, after in zip(run.caches[:-1], run.caches[1:]):
        assert jax.tree.map(lambda a: (a.shape, a.dtype), before) == jax.tree.map(lambda a: (a.shape, a.dtype), after)


# ---- whole models imported from transformers ---------------------------------------------------

PROMPT_LENGTHS = (5, 9, 2)
NEW_TOKENS = 16


def _imported(family, directory):
    from hf_tiny_models import save_tiny_mamba2, save_tiny_nemotron_h
    from jaxtrain import hf
    from jaxtrain.generate import Engine

    save = {"mamba2": save_tiny_mamba2, "nemotron_h": save_tiny_nemotron_h}[family]
    directory = save(directory, seed=5)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 96, n).tolist() for n in PROMPT_LENGTHS]
    model = hf.load(directory)
    return types.SimpleNamespace(dir=directory, model=model, prompts=prompts, engine=Engine(model, bucket=16))


@pytest.mark.parametrize("family", ["mamba2", "nemotron_h"])
def test_greedy_equals_transformers_generate(family, tmp_path):
    from test_generate import transformers_greedy

    case = _imported(family, tmp_path)
    ours = case.engine.generate(case.prompts, max_new_tokens=NEW_TOKENS)
    theirs = transformers_greedy(case.dir, case.prompts, NEW_TOKENS)
    assert ours == theirs
    # the caches: a Mamba layer's is the same at any max_len, an attention layer's grows with it
    sizes = {m: jax.eval_shape(lambda m=m: case.model.init_cache(2, m, jnp.float32))["blocks"] for m in (32, 512)}
    mamba = (lambda c: c) if family == "mamba2" else (lambda c: c["mamba"])
    assert mamba(sizes[32]) == mamba(sizes[512])
    if family == "nemotron_h":
        assert [sizes[m]["attention"]["k"].shape[2] for m in (32, 512)] == [32, 512]
