"""ssd_scan: chunked XLA reference vs token scan vs a float64 loop, the Pallas
kernels (interpreted on CPU) vs the reference incl. gradients, argument errors,
and Triton lowering for H100/H200 without a GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_checks import TOL, assert_close, exact_f32_matmuls  # noqa: F401
from jaxtrain.pallas_kernels import gpu_lowering
from jaxtrain.pallas_kernels.ssd_scan import ssd_scan, ssd_scan_naive

pytestmark = [pytest.mark.fast, pytest.mark.gpu, pytest.mark.usefixtures("exact_f32_matmuls")]

# (b, l, h, p, g, n, chunk): l not a multiple of the chunk, groups 1 and > 1,
# p/n not powers of 2 (masked Triton tiles).
SHAPES = {
    "grouped_ragged_len": (2, 37, 4, 8, 2, 16, 16),
    "one_group_odd_dims": (1, 32, 2, 6, 1, 12, 16),
}


def make_inputs(shape_name, seed, dtype=jnp.float32):
    b, l, h, p, g, n, chunk = SHAPES[shape_name]
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((b, l, h, p)), dtype)
    dt = jnp.asarray(np.log1p(np.exp(rng.standard_normal((b, l, h)) - 1.0)), jnp.float32)
    a = jnp.asarray(-np.exp(0.5 * rng.standard_normal(h)), jnp.float32)
    bm = jnp.asarray(rng.standard_normal((b, l, g, n)), dtype)
    cm = jnp.asarray(rng.standard_normal((b, l, g, n)), dtype)
    d = jnp.asarray(rng.standard_normal(h), jnp.float32)
    init = jnp.asarray(rng.standard_normal((b, h, p, n)), jnp.float32)
    # Segments: a restart inside a chunk, one exactly at a chunk boundary, a
    # one-token segment; the second sequence reuses an id after another segment
    # (still a restart).
    starts = np.zeros(l, np.int32)
    for t in (5, chunk, chunk + 1, l - 3):
        starts[t] = 1
    reuse = np.zeros(l, np.int32)
    reuse[3:9] = 1
    seq = np.stack([np.cumsum(starts), reuse][:b])
    return (x, dt, a, bm, cm), dict(D=d, initial_states=init, seq_idx=jnp.asarray(seq + 3)), chunk


def numpy_ssd(x, dt, a, bm, cm, D, initial_states, seq_idx):
    x, dt, a, bm, cm, D, s = (np.asarray(v, np.float64) for v in (x, dt, a, bm, cm, D, initial_states))
    seq_idx = np.asarray(seq_idx)
    b, l, h, _ = x.shape
    hpg = h // bm.shape[2]
    y = np.zeros_like(x)
    for bi in range(b):
        for t in range(l):
            if t > 0 and seq_idx[bi, t] != seq_idx[bi, t - 1]:
                s[bi] = 0.0
            for hi in range(h):
                gi = hi // hpg
                s[bi, hi] = np.exp(dt[bi, t, hi] * a[hi]) * s[bi, hi] + dt[bi, t, hi] * np.outer(
                    x[bi, t, hi], bm[bi, t, gi]
                )
                y[bi, t, hi] = s[bi, hi] @ cm[bi, t, gi] + D[hi] * x[bi, t, hi]
    return y, s


OPTIONS = {  # which optional inputs a case passes
    "plain": (),
    "all": ("D", "initial_states", "seq_idx"),
    "init_no_seq": ("D", "initial_states"),
}


def pick(opts, name):
    return {k: v for k, v in opts.items() if k in OPTIONS[name]}


@functools.partial(jax.jit, static_argnames=("chunk", "impl", "naive"))
def run(args, opts, chunk, impl, naive=False):
    if naive:
        return ssd_scan_naive(*args, **opts)
    return ssd_scan(*args, chunk_size=chunk, impl=impl, **opts)


def _loss(args, opts, seq_idx, chunk, impl):
    y, final = ssd_scan(*args, chunk_size=chunk, impl=impl, seq_idx=seq_idx, **opts)
    return jnp.sum(jnp.sin(y.astype(jnp.float32))) + jnp.sum(jnp.cos(final))


grad = jax.jit(jax.grad(_loss, argnums=(0, 1)), static_argnames=("chunk", "impl"))


def test_naive_matches_float64_loop():
    args, opts, _ = make_inputs("grouped_ragged_len", 0)
    y, final = run(args, opts, 0, "xla", naive=True)
    want_y, want_final = numpy_ssd(*args, **opts)
    assert_close(y, want_y, 1e-5)
    assert_close(final, want_final, 1e-5)


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_reference_matches_naive(shape, options):
    args, opts, chunk = make_inputs(shape, 1)
    opts = pick(opts, options)
    y, final = run(args, opts, chunk, "xla")
    want_y, want_final = run(args, opts, 0, "xla", naive=True)
    assert_close(y, want_y, 1e-5)
    assert_close(final, want_final, 1e-5)


@pytest.mark.parametrize(
    "shape,options,dtype",
    [
        ("grouped_ragged_len", "all", jnp.float32),
        ("grouped_ragged_len", "all", jnp.bfloat16),
        ("one_group_odd_dims", "plain", jnp.float32),
        ("one_group_odd_dims", "init_no_seq", jnp.bfloat16),
    ],
)
def test_pallas_matches_reference(shape, options, dtype):
    args, opts, chunk = make_inputs(shape, 2, dtype)
    opts = pick(opts, options)
    y, final = run(args, opts, chunk, "pallas")
    assert y.dtype == dtype and final.dtype == jnp.float32
    # The f32 reference on the same (rounded) inputs is the target.
    args32 = tuple(v.astype(jnp.float32) for v in args)
    want_y, want_final = run(args32, opts, chunk, "xla")
    assert_close(y, want_y, TOL[dtype])
    assert_close(final, want_final, TOL[dtype])


@pytest.mark.parametrize("shape,options", [("grouped_ragged_len", "all"), ("one_group_odd_dims", "plain")])
def test_gradients_match_reference(shape, options):
    args, opts, chunk = make_inputs(shape, 3)
    opts = pick(opts, options)
    seq_idx = opts.pop("seq_idx", None)
    got = grad(args, opts, seq_idx, chunk, "pallas")
    want = grad(args, opts, seq_idx, chunk, "xla")
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(g, w, 1e-4)


def test_bad_arguments_raise_clear_errors():
    (x, dt, a, bm, cm), opts, _ = make_inputs("one_group_odd_dims", 0)
    with pytest.raises(ValueError, match="impl"):
        ssd_scan(x, dt, a, bm, cm, chunk_size=16, impl="triton")
    with pytest.raises(ValueError, match="dt"):
        ssd_scan(x, dt[:, 1:], a, bm, cm, chunk_size=16)
    with pytest.raises(ValueError, match="C must"):
        ssd_scan(x, dt, a, bm, cm[..., 1:], chunk_size=16)
    with pytest.raises(ValueError, match="seq_idx"):
        ssd_scan(x, dt, a, bm, cm, chunk_size=16, seq_idx=jnp.zeros((1, 3)))
    with pytest.raises(ValueError, match="chunk_size"):
        ssd_scan(x, dt, a, bm, cm, chunk_size=12, impl="pallas")


@pytest.mark.parametrize("kind", sorted(gpu_lowering.GPU_DEVICE_KINDS))
def test_lowers_to_triton_for_gpu(kind):
    # Nemotron-H-like head geometry (p=64, n=128, chunk 128), ragged length.
    s = jax.ShapeDtypeStruct
    b, l, h, p, g, n = 1, 300, 8, 64, 2, 128
    bf16, f32 = jnp.bfloat16, jnp.float32
    args = (s((b, l, h, p), bf16), s((b, l, h), f32), s((h,), f32), s((b, l, g, n), bf16), s((b, l, g, n), bf16))
    opts = dict(D=s((h,), f32), initial_states=s((b, h, p, n), f32))
    seq_idx = s((b, l), jnp.int32)
    device_kind = gpu_lowering.GPU_DEVICE_KINDS[kind]
    fwd = gpu_lowering.lower_for_gpu(
        lambda a, o, q: ssd_scan(*a, chunk_size=128, seq_idx=q, **o), args, opts, seq_idx, device_kind=device_kind
    )
    assert gpu_lowering.count_triton_kernels(fwd) == 3
    bwd = gpu_lowering.lower_for_gpu(
        jax.grad(functools.partial(_loss, chunk=128, impl="auto"), argnums=(0, 1)),
        args,
        opts,
        seq_idx,
        device_kind=device_kind,
    )
    assert gpu_lowering.count_triton_kernels(bwd) == 6  # 3 forward + 3 backward
