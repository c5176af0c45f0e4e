"""Mamba-2: the chunked SSD scan against a float64 recurrence (values, final state, gradients,
memory linear in length), the mixer's reset at packed-document boundaries, and the pure Mamba-2
LM against transformers' Mamba2ForCausalLM (logits, hf.save round trip).

tests/test_kernels_ssd_scan.py covers the Pallas kernels against the chunked reference; here the
reference itself is checked for the chunk sizes and shapes a model uses."""
from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from hf_tiny_models import random_tokens, relative_error, save_tiny_mamba2
from jaxtrain import hf
from jaxtrain.hf.safetensors_io import SafetensorsDir
from jaxtrain.hf.verify import transformers_logits
from jaxtrain.models.layers.mamba2 import Mamba2Mixer, SSMConfig
from jaxtrain.models.mamba2 import Mamba2Config
from jaxtrain.pallas_kernels.ssd_scan import ssd_scan, ssd_scan_naive

pytestmark = [pytest.mark.fast]


@pytest.fixture(autouse=True)
def _exact_f32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def scan_inputs(seed, *, b=2, l=37, h=4, p=3, g=2, n=5, segments=False):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, l, h, p))
    dt = np.log1p(np.exp(rng.standard_normal((b, l, h)) - 1.0))  # softplus: positive
    a = -np.exp(0.5 * rng.standard_normal(h))
    bm, cm = rng.standard_normal((b, l, g, n)), rng.standard_normal((b, l, g, n))
    d = rng.standard_normal(h)
    init = rng.standard_normal((b, h, p, n))
    seq = np.ones((b, l), np.int32)
    if segments:  # a restart mid-row in row 0, two in row 1
        seq[0, 11:] = 2
        seq[1, 5:] = 2
        seq[1, 30:] = 3
    return x, dt, a, bm, cm, d, init, seq


def float64_recurrence(x, dt, a, bm, cm, d, init, seq):
    """s_t = exp(dt_t a) s_{t-1} + dt_t x_t ⊗ B_t (s reset to 0 where seq changes), y_t = s_t C_t + D x_t."""
    b, l, h, _ = x.shape
    heads_per_group = h // bm.shape[2]
    bh, ch = (np.repeat(m, heads_per_group, axis=2) for m in (bm, cm))
    s = init.astype(np.float64).copy()
    y = np.zeros_like(x)
    for t in range(l):
        if t:
            s[seq[:, t] != seq[:, t - 1]] = 0.0
        decay = np.exp(dt[:, t] * a)[..., None, None]
        s = decay * s + (dt[:, t, :, None] * x[:, t])[..., None] * bh[:, t, :, None, :]
        y[:, t] = np.einsum("bhpn,bhn->bhp", s, ch[:, t]) + d[:, None] * x[:, t]
    return y, s


def with_random_params(make, seed=0, scale=0.3):
    """(graphdef, state) of the module `make()` builds, every parameter drawn by numpy (faster
    here than compiling the module's own initializers)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    rng = np.random.default_rng(seed)
    return graphdef, jax.tree.map(lambda a: scale * rng.standard_normal(a.shape).astype(a.dtype), abstract)


def close(actual, expected, rtol, what=""):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    err = np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-12)
    assert err <= rtol, f"{what} relative error {err:.3g} > {rtol}"


@pytest.mark.parametrize("chunk,groups,segments", [(4, 1, False), (8, 2, True), (16, 4, True), (64, 2, False)])
def test_chunked_scan_equals_float64_recurrence(chunk, groups, segments):
    # 37 tokens: no chunk size here divides it; 64 is longer than the sequence.
    x, dt, a, bm, cm, d, init, seq = scan_inputs(chunk, g=groups, segments=segments)
    f32 = lambda v: jnp.asarray(v, jnp.float32)
    scan = jax.jit(functools.partial(ssd_scan, chunk_size=chunk, impl="xla"))
    y, final = scan(f32(x), f32(dt), f32(a), f32(bm), f32(cm), D=f32(d), initial_states=f32(init),
                    seq_idx=jnp.asarray(seq) if segments else None)
    want_y, want_final = float64_recurrence(x, dt, a, bm, cm, d, init, seq)
    close(y, want_y, 1e-5)
    close(final, want_final, 1e-5)


def test_chunked_scan_gradients_equal_those_of_the_naive_scan():
    x, dt, a, bm, cm, d, init, seq = (jnp.asarray(v, jnp.float32) if v.dtype != np.int32 else jnp.asarray(v)
                                      for v in scan_inputs(7, segments=True))

    def loss(scan, args):
        y, final = scan(*args[:5], D=args[5], initial_states=args[6], seq_idx=seq)
        return jnp.sum(jnp.sin(y)) + jnp.sum(jnp.cos(final))

    args = (x, dt, a, bm, cm, d, init)
    grad = lambda scan: jax.jit(jax.grad(functools.partial(loss, scan)))(args)
    chunked, naive = grad(functools.partial(ssd_scan, chunk_size=8, impl="xla")), grad(ssd_scan_naive)
    for name, got, want in zip(("x", "dt", "A", "B", "C", "D", "initial_states"), chunked, naive):
        close(got, want, 1e-4, name)


def test_chunked_scan_memory_grows_linearly_with_length():
    h, p, g, n, chunk = 4, 16, 1, 16, 64

    def temp_bytes(length):
        s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
        args = (s(1, length, h, p), s(1, length, h), s(h), s(1, length, g, n), s(1, length, g, n))
        loss = lambda *a: jnp.sum(ssd_scan(*a, chunk_size=chunk, impl="xla")[0] ** 2)
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 3, 4))).lower(*args).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    sizes = {length: temp_bytes(length) for length in (1024, 4096, 16384)}
    for short, long in ((1024, 4096), (4096, 16384)):
        assert sizes[long] <= 4.5 * sizes[short], sizes  # quadratic would be 16x
    assert sizes[16384] >= 8 * sizes[1024], sizes  # and it does grow: linear, not constant


def test_mixer_does_not_leak_across_packed_documents():
    """Row 0 packs documents of 10 and 14 tokens; rows 1 and 2 hold each document alone, followed
    by unrelated tokens in the same segment (a causal mixer never sees them)."""
    cfg = SSMConfig(heads=4, head_dim=8, state=8, groups=2, chunk_size=8)
    graphdef, state = with_random_params(lambda: Mamba2Mixer(16, cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    doc1, doc2, junk = (rng.standard_normal((k, 16)).astype(np.float32) for k in (10, 14, 14))
    x = np.stack([np.concatenate([doc1, doc2]), np.concatenate([doc1, junk]), np.concatenate([doc2, junk[:10]])])
    segments = np.ones((3, 24), np.int32)
    segments[0, 10:] = 2
    y = np.asarray(jax.jit(lambda s, x, seg: nnx.merge(graphdef, s)(x, seg))(state, x, segments))
    close(y[0, :10], y[1, :10], 1e-6)
    close(y[0, 10:], y[2, :14], 1e-6)
    assert np.abs(y[0, 10:] - y[1, 10:]).max() > 1e-3  # without the reset the second document would differ


def _param_shardings(cfg, tensor: int):
    from jaxtrain.training.state import abstract_model, param_shardings
    from jaxtrain.meshes.mesh import MeshConfig, build_mesh
    from jaxtrain.meshes.rules import get_rule_set

    _, abstract = abstract_model(cfg)
    mesh = build_mesh(MeshConfig(data=16 // tensor, tensor=tensor))
    return param_shardings(abstract, mesh, get_rule_set("dp").params)


def test_config_errors_name_the_field():
    # Heads and groups over tensor: the rule tables' check names the parameter.
    with pytest.raises(ValueError, match=r"ssm_heads=6 is not divisible by tensor=4: parameter "
                                         r"stacks/blocks/layers/mixer/A_log of shape \(2, 6\)"):
        _param_shardings(Mamba2Config(ssm=SSMConfig(heads=6, groups=1)), 4)
    with pytest.raises(ValueError, match=r"ssm_groups=2 is not divisible by tensor=4: parameter "
                                         r"stacks/blocks/layers/mixer/conv_b/bias"):
        _param_shardings(Mamba2Config(ssm=SSMConfig(heads=8, groups=2)), 4)
    with pytest.raises(ValueError, match="time_step_limit"):
        Mamba2Config(ssm=SSMConfig(time_step_limit=(0.5, 0.1))).validate({})
    with pytest.raises(ValueError, match="ssm.heads=6 is not a multiple of ssm.groups=4"):
        Mamba2Config(ssm=SSMConfig(heads=6, groups=4)).validate({})
    # One group: B/C replicated, heads split.
    mixer = _param_shardings(Mamba2Config(ssm=SSMConfig(heads=8, groups=1)), 4)["stacks"]["blocks"]["layers"]["mixer"]
    assert mixer["in_b"]["kernel"].spec == P(None, None, None, None)
    assert mixer["in_x"]["kernel"].spec == P(None, None, "tensor", None)


# ----------------------------------------------------------------------------- HF parity

@pytest.fixture(scope="module")
def mamba2_hf(tmp_path_factory):
    # Ragged chunks (6 into 16), 2 groups, dt clamped on both sides, projection biases.
    directory = save_tiny_mamba2(tmp_path_factory.mktemp("mamba2"), seed=1, time_step_limit=(0.3, 0.9),
                                 use_bias=True)
    tokens = random_tokens(96, batch=2, length=16)
    return types.SimpleNamespace(dir=directory, tokens=tokens, reference=transformers_logits(directory, tokens))


def forward(model, tokens):
    graphdef, state = nnx.split(model)
    return np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens))


def test_mamba2_logits_match_transformers_and_survive_hf_save(mamba2_hf, tmp_path):
    model = hf.load(mamba2_hf.dir)
    assert model.config.ssm == SSMConfig(heads=8, head_dim=8, state=8, groups=2, chunk_size=6,
                                         time_step_limit=(0.3, 0.9), proj_bias=True)
    assert relative_error(forward(model, mamba2_hf.tokens), mamba2_hf.reference) < 1e-4
    hf.save(model, tmp_path)
    assert relative_error(transformers_logits(str(tmp_path), mamba2_hf.tokens), mamba2_hf.reference) < 1e-6
    before, after = SafetensorsDir(mamba2_hf.dir), SafetensorsDir(tmp_path)
    assert sorted(before.tensors) == sorted(after.tensors)
    assert all(before.read(n).tobytes() == after.read(n).tobytes() for n in before.tensors)
