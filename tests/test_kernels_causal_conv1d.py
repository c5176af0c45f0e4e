"""causal_conv1d: XLA reference vs a float64 loop, Pallas (interpreted on CPU)
vs the reference incl. gradients, argument errors, Triton lowering H100/H200."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_checks import TOL, assert_close
from jaxtrain.pallas_kernels import gpu_lowering
from jaxtrain.pallas_kernels.causal_conv1d import causal_conv1d

pytestmark = [pytest.mark.fast, pytest.mark.gpu]

B, L, D = 2, 37, 20  # L, D not multiples of the blocks used below


def make_inputs(seed, k, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((B, L, D)), dtype)
    w = jnp.asarray(rng.standard_normal((D, k)) / np.sqrt(k), dtype)
    bias = jnp.asarray(rng.standard_normal(D), dtype)
    # Segments of lengths 1, 2 and longer; the second sequence reuses an id
    # after a 2-token segment (still a new segment).
    starts = np.zeros(L, np.int32)
    starts[[3, 4, 6, 20]] = 1
    reuse = np.zeros(L, np.int32)
    reuse[10:12] = 1
    seq = np.stack([np.cumsum(starts), reuse]) + 7
    return x, w, bias, jnp.asarray(seq)


def numpy_conv(x, w, bias, activation, seq_idx):
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    bias = np.asarray(bias, np.float64)
    b, l, d = x.shape
    k = w.shape[1]
    y = np.zeros_like(x)
    for bi in range(b):
        for t in range(l):
            z = bias.copy()
            for i in range(k):
                s = t - (k - 1) + i
                if s >= 0 and (seq_idx is None or np.all(seq_idx[bi, s : t + 1] == seq_idx[bi, t])):
                    z += w[:, i] * x[bi, s]
            y[bi, t] = z / (1 + np.exp(-z)) if activation == "silu" else z
    return y


@functools.partial(jax.jit, static_argnames=("activation", "impl"))
def conv(x, w, bias, seq_idx, activation, impl):
    return causal_conv1d(x, w, bias, activation=activation, seq_idx=seq_idx, impl=impl, block_l=16, block_d=16)


def _loss(x, w, bias, seq_idx, activation, impl):
    y = causal_conv1d(x, w, bias, activation=activation, seq_idx=seq_idx, impl=impl, block_l=16, block_d=16)
    return jnp.sum(jnp.sin(y.astype(jnp.float32)))


grad = jax.jit(jax.grad(_loss, argnums=(0, 1, 2)), static_argnames=("activation", "impl"))


@pytest.mark.parametrize(
    "k,activation,use_seq", [(4, "silu", True), (4, None, False), (3, "silu", False), (2, None, True)]
)
def test_reference_matches_float64_loop(k, activation, use_seq):
    x, w, bias, seq = make_inputs(k, k)
    seq = seq if use_seq else None
    got = conv(x, w, bias, seq, activation, "xla")
    assert_close(got, numpy_conv(x, w, bias, activation, None if seq is None else np.asarray(seq)), 1e-5)


@pytest.mark.parametrize(
    "k,activation,use_seq,dtype",
    [
        (4, "silu", True, jnp.float32),
        (4, "silu", True, jnp.bfloat16),
        (3, None, False, jnp.float32),
    ],
)
def test_pallas_matches_reference(k, activation, use_seq, dtype):
    x, w, bias, seq = make_inputs(10 + k, k, dtype)
    seq = seq if use_seq else None
    got = conv(x, w, bias, seq, activation, "pallas")
    assert got.dtype == dtype
    f32 = lambda a: a.astype(jnp.float32)
    want = conv(f32(x), f32(w), f32(bias), seq, activation, "xla")
    assert_close(got, want, TOL[dtype])


@pytest.mark.parametrize("k,activation,use_seq", [(4, "silu", True), (3, None, False)])
def test_gradients_match_reference(k, activation, use_seq):
    x, w, bias, seq = make_inputs(20 + k, k)
    seq = seq if use_seq else None
    got = grad(x, w, bias, seq, activation, "pallas")
    want = grad(x, w, bias, seq, activation, "xla")
    for g, wnt in zip(got, want):
        assert_close(g, wnt, 1e-4)


def test_bad_arguments_raise_clear_errors():
    x, w, bias, seq = make_inputs(0, 4)
    with pytest.raises(ValueError, match="impl"):
        causal_conv1d(x, w, bias, impl="gpu")
    with pytest.raises(ValueError, match="w must"):
        causal_conv1d(x, w[1:], bias)
    with pytest.raises(ValueError, match="bias"):
        causal_conv1d(x, w, bias[1:])
    with pytest.raises(ValueError, match="seq_idx"):
        causal_conv1d(x, w, bias, seq_idx=seq[:, 1:])
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, w, bias, activation="relu")
    with pytest.raises(ValueError, match="block_d"):
        causal_conv1d(x, w, bias, impl="pallas", block_d=24)


@pytest.mark.parametrize("kind", sorted(gpu_lowering.GPU_DEVICE_KINDS))
def test_lowers_to_triton_for_gpu(kind):
    s = jax.ShapeDtypeStruct
    # Mamba conv over x|B|C channels, ragged length and width.
    args = (s((1, 300, 200), jnp.bfloat16), s((200, 4), jnp.bfloat16), s((200,), jnp.bfloat16), s((1, 300), jnp.int32))
    device_kind = gpu_lowering.GPU_DEVICE_KINDS[kind]
    fwd = gpu_lowering.lower_for_gpu(
        lambda x, w, b, q: causal_conv1d(x, w, b, seq_idx=q), *args, device_kind=device_kind
    )
    assert gpu_lowering.count_triton_kernels(fwd) == 1
    bwd = gpu_lowering.lower_for_gpu(
        jax.grad(functools.partial(_loss, activation="silu", impl="auto"), argnums=(0, 1, 2)),
        *args,
        device_kind=device_kind,
    )
    assert gpu_lowering.count_triton_kernels(bwd) == 2
