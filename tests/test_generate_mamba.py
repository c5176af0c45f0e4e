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

from jaxtrain.models.layers.mamba2 import Mamba2Mixer, SSMConfig

pytestmark = [pytest.mark.slow]

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
    """The recurrence s = exp(dt A) s + dt x (x) B in float64 numpy over each row's real prompt
    tokens only (inputs from the training projections and segment-aware conv): the prefill's state.
    The conv windows: the last conv_kernel - 1 raw inputs, zeros before the row's first token."""
    cache = run.caches[0]
    x, seg = run.x[:, :PROMPT], jnp.asarray(run.seg[:, :PROMPT])

    @jax.jit
    def inputs(x, seg):
        _, pre, dt = mixer._project(x)
        return pre[0], mixer._conv(*pre, seg), dt

    raw, (xs, b, c), dt = jax.tree.map(lambda v: np.asarray(v, np.float64), inputs(x, seg))
    a = -np.exp(np.asarray(mixer.A_log[...], np.float64))
    hpg = CFG.heads // CFG.groups
    for row, start in enumerate(VALID_FROM):
        s = np.zeros((CFG.heads, CFG.head_dim, CFG.state))
        for t in range(start, PROMPT):
            bt = np.repeat(b[row, t], hpg, axis=0)  # [heads, state]
            s = np.exp(dt[row, t] * a)[:, None, None] * s + (dt[row, t][:, None] * xs[row, t])[..., None] * bt[:, None]
        got = np.asarray(cache["state"][row])
        assert np.isfinite(got).all() and np.abs(s).max() > 0
        np.testing.assert_allclose(got, s, rtol=1e-5, atol=1e-6 * np.abs(s).max())
        want = np.zeros((CFG.conv_kernel - 1,) + raw.shape[2:])
        tail = raw[row, max(start, PROMPT - len(want)):]
        want[len(want) - len(tail):] = tail
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


def test_prefill_under_context_parallelism_is_refused_by_name(mixer):
    """The context-parallel scan does not return the final state: prefill says so, before compile."""
    from jaxtrain.meshes.mesh import MeshConfig, build_mesh
    from jaxtrain.meshes.rules import get_rule_set, use_rules

    mesh = build_mesh(MeshConfig(context=2), jax.devices()[:2])
    seg, pos = left_padded(VALID_FROM, 8)
    x = jnp.zeros((len(VALID_FROM), 8, EMBED), jnp.float32)
    with use_rules(mesh, get_rule_set("dp")), pytest.raises(ValueError, match="context parallelism"):
        jax.eval_shape(lambda x: mixer.prefill(x, pos, seg, mixer.init_cache(x.shape[0], 8, jnp.float32)), x)


# ---- whole models imported from transformers ---------------------------------------------------

PROMPT_LENGTHS = (5, 9, 2, 12)
NEW_TOKENS = 32  # as the issue asks of every family


@pytest.fixture(scope="module", params=["mamba2", "nemotron_h"])
def imported(request, tmp_path_factory):
    """A tiny random transformers model of the family, imported; one greedy generation with the
    logits of every step."""
    from hf_tiny_models import save_tiny_mamba2, save_tiny_nemotron_h
    from jaxtrain import hf
    from jaxtrain.generate import Engine

    save = {"mamba2": save_tiny_mamba2, "nemotron_h": save_tiny_nemotron_h}[request.param]
    directory = save(tmp_path_factory.mktemp(request.param), seed=5)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 96, n).tolist() for n in PROMPT_LENGTHS]
    model = hf.load(directory)
    steps = {}
    rows = Engine(model, bucket=16).generate(prompts, max_new_tokens=NEW_TOKENS,
                                             on_logits=lambda step, logits: steps.__setitem__(step, logits))
    return types.SimpleNamespace(family=request.param, dir=directory, model=model, prompts=prompts, rows=rows,
                                 logits=np.stack([steps[s] for s in range(NEW_TOKENS)], axis=1))


def test_greedy_equals_transformers_generate(imported):
    from test_generate import transformers_greedy

    assert imported.rows == transformers_greedy(imported.dir, imported.prompts, NEW_TOKENS)


def test_decode_logits_equal_the_full_forward(imported):
    """Step s's logits are the full training forward's at the prompt's last token + s."""
    from hf_tiny_models import forward

    # right-padded to one length, so one compile (causal: what follows a position changes nothing there)
    sequences = [p + r[:-1] for p, r in zip(imported.prompts, imported.rows)]
    tokens = np.zeros((len(sequences), max(map(len, sequences))), np.int32)
    for row, seq in enumerate(sequences):
        tokens[row, :len(seq)] = seq
    full = forward(imported.model, tokens)
    expected = np.stack([full[row, len(p) - 1:len(p) - 1 + NEW_TOKENS] for row, p in enumerate(imported.prompts)])
    assert np.isfinite(imported.logits).all() and np.isfinite(expected).all()
    np.testing.assert_allclose(imported.logits, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_cache_sizes_per_kind(imported):
    """A Mamba layer's cache is the same at any max_len; an attention layer's grows with it."""
    sizes = {m: jax.eval_shape(lambda m=m: imported.model.init_cache(2, m, jnp.float32))["blocks"]
             for m in (32, 4096)}
    mamba = (lambda c: c) if imported.family == "mamba2" else (lambda c: c["mamba"])
    assert mamba(sizes[32]) == mamba(sizes[4096])
    if imported.family == "nemotron_h":
        assert [sizes[m]["attention"]["k"].shape[2] for m in (32, 4096)] == [32, 4096]


# the hybrid alone: it covers the Mamba layers and the pattern's cache threading
@pytest.mark.parametrize("imported", ["nemotron_h"], indirect=True)
def test_hybrid_on_data2_tensor2_generates_the_one_device_tokens(imported):
    """Nemotron-H under data=2 x tensor=2: the same greedy tokens; the Mamba state split over
    `tensor` on its heads and over `data` on the batch, like the weights and activations."""
    assert imported.family == "nemotron_h"
    from jaxtrain import hf
    from jaxtrain.generate import Engine
    from jaxtrain.generate.engine import left_pad
    from jaxtrain.generate.sampling import Sampling
    from jaxtrain.meshes.mesh import MeshConfig, build_mesh
    from jaxtrain.meshes.rules import get_rule_set

    mesh = build_mesh(MeshConfig(data=2, tensor=2), jax.devices()[:4])
    engine = Engine(hf.load(imported.dir, mesh=mesh), mesh=mesh, rules=get_rule_set("dp"), bucket=16)
    assert engine.generate(imported.prompts, max_new_tokens=NEW_TOKENS) == imported.rows
    with engine._rules():
        padded = left_pad(imported.prompts, 16)
        _, _, cache = engine._prefill(engine.state, padded.tokens, padded.positions, padded.segment_ids,
                                      jax.random.key(0), max_len=32, sampling=Sampling())
    state = cache["blocks"]["mamba"]["state"]  # [layers, b, heads, head_dim, state]
    assert tuple(state.sharding.spec)[:3] == (None, "data", "tensor")
