"""grouped_matmul: Pallas (interpreted on CPU) vs ragged_dot vs a float64 loop,
gradients, argument errors, and Triton lowering for H100/H200 without a GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_checks import TOL, assert_close, exact_f32_matmuls  # noqa: F401
from jaxtrain.pallas_kernels import gpu_lowering
from jaxtrain.pallas_kernels.grouped_matmul import grouped_matmul, tile_schedule

pytestmark = [pytest.mark.fast, pytest.mark.gpu, pytest.mark.usefixtures("exact_f32_matmuls")]

M, K, N, G = 48, 40, 24, 4  # none a multiple of its block: exercises masks
GROUP_SIZES = {
    "mixed_with_empty": [13, 0, 30, 5],
    "one_group_all_rows": [0, 0, 48, 0],
    "first_group_all_rows": [48, 0, 0, 0],
    "rows_left_over": [5, 7, 0, 9],
    "all_empty": [0, 0, 0, 0],
}


def numpy_grouped_matmul(lhs, rhs, group_sizes):
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    row = 0
    for g, size in enumerate(np.asarray(group_sizes)):
        for r in range(row, min(row + size, lhs.shape[0])):
            out[r] = lhs[r] @ rhs[g]
        row += size
    return out


def make_inputs(seed, dtype, m=M, k=K, n=N, g=G):
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), dtype)
    return lhs, rhs


# Shared jitted entry points: group sizes are traced, so one compile per dtype.
@functools.partial(jax.jit, static_argnames=("impl", "blocks"))
def gmm(lhs, rhs, group_sizes, impl, blocks=None):
    kw = dict(zip(("block_m", "block_n", "block_k"), blocks)) if blocks else {}
    return grouped_matmul(lhs, rhs, group_sizes, impl=impl, **kw)


def _loss(lhs, rhs, group_sizes, impl):
    return jnp.sum(jnp.sin(grouped_matmul(lhs, rhs, group_sizes, impl=impl)))


gmm_grad = jax.jit(jax.grad(_loss, argnums=(0, 1)), static_argnames="impl")
schedule = jax.jit(tile_schedule, static_argnums=(1, 2))


@pytest.mark.parametrize("case", GROUP_SIZES)
def test_tile_schedule_covers_each_row_once(case):
    sizes = jnp.array(GROUP_SIZES[case], jnp.int32)
    group, tile, lo, hi = map(np.asarray, schedule(sizes, M, 16))
    owner = np.full(M, -1)
    for g, t, a, b in zip(group, tile, lo, hi):
        for r in range(max(a, t * 16), min(b, t * 16 + 16)):
            assert owner[r] == -1, "row stored twice"
            owner[r] = g
    sizes_with_tail = GROUP_SIZES[case] + [M - sum(GROUP_SIZES[case])]
    expected = np.repeat(np.arange(G + 1), sizes_with_tail)
    np.testing.assert_array_equal(owner, expected)


@pytest.mark.parametrize("case", GROUP_SIZES)
def test_reference_matches_float64_loop(case):
    lhs, rhs = make_inputs(1, jnp.float32)
    sizes = jnp.array(GROUP_SIZES[case], jnp.int32)
    want = numpy_grouped_matmul(lhs, rhs, sizes)
    assert_close(gmm(lhs, rhs, sizes, "xla"), want, 1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", GROUP_SIZES)
def test_pallas_matches_float64_loop(case, dtype):
    lhs, rhs = make_inputs(list(GROUP_SIZES).index(case), dtype)
    sizes = jnp.array(GROUP_SIZES[case], jnp.int32)
    got = gmm(lhs, rhs, sizes, "pallas")
    assert got.dtype == dtype
    assert_close(got, numpy_grouped_matmul(lhs, rhs, sizes), TOL[dtype])
    assert_close(got, gmm(lhs, rhs, sizes, "xla"), TOL[dtype])


def test_pallas_multi_tile_aligned():
    # Small explicit blocks: several m/n tiles, a k loop, groups straddling tiles,
    # and the unmasked (aligned) load path.
    lhs, rhs = make_inputs(7, jnp.float32, m=64, k=32, n=32, g=3)
    sizes = jnp.array([21, 0, 35], jnp.int32)
    got = gmm(lhs, rhs, sizes, "pallas", blocks=(16, 16, 16))
    assert_close(got, numpy_grouped_matmul(lhs, rhs, sizes), 1e-4)


@pytest.mark.parametrize("case", ["mixed_with_empty", "one_group_all_rows", "rows_left_over"])
def test_gradients_match_reference(case):
    lhs, rhs = make_inputs(3, jnp.float32)
    sizes = jnp.array(GROUP_SIZES[case], jnp.int32)
    got = gmm_grad(lhs, rhs, sizes, impl="pallas")
    want = gmm_grad(lhs, rhs, sizes, impl="xla")
    for g, w in zip(got, want):
        assert_close(g, w, 1e-4)


def test_gradients_bf16():
    lhs, rhs = make_inputs(4, jnp.bfloat16)
    sizes = jnp.array(GROUP_SIZES["mixed_with_empty"], jnp.int32)
    got = gmm_grad(lhs, rhs, sizes, impl="pallas")
    want = gmm_grad(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes, impl="xla")
    for g, w in zip(got, want):
        assert g.dtype == jnp.bfloat16
        assert_close(g, w, 2e-2)


def test_bad_arguments_raise_clear_errors():
    lhs, rhs = make_inputs(0, jnp.float32)
    sizes = jnp.array([M, 0, 0, 0], jnp.int32)
    with pytest.raises(ValueError, match="impl"):
        grouped_matmul(lhs, rhs, sizes, impl="cuda")
    with pytest.raises(ValueError, match="rhs"):
        grouped_matmul(lhs, rhs[:, :-1], sizes)
    with pytest.raises(ValueError, match="lhs"):
        grouped_matmul(lhs[None], rhs, sizes)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul(lhs, rhs, sizes[:-1])
    with pytest.raises(ValueError, match="block_m"):
        grouped_matmul(lhs, rhs, sizes, impl="pallas", block_m=48)
    with pytest.raises(ValueError, match="block_k"):
        grouped_matmul(lhs, rhs, sizes, impl="pallas", block_k=8)


@pytest.mark.parametrize("kind", sorted(gpu_lowering.GPU_DEVICE_KINDS))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_to_triton_for_gpu(kind, dtype):
    device_kind = gpu_lowering.GPU_DEVICE_KINDS[kind]
    s = jax.ShapeDtypeStruct
    for m, k, n in [(200, 72, 40), (256, 128, 256)]:  # masked and aligned paths
        args = (s((m, k), dtype), s((5, k, n), dtype), s((5,), jnp.int32))
        fwd = gpu_lowering.lower_for_gpu(
            lambda l, r, g: grouped_matmul(l, r, g, impl="auto"), *args, device_kind=device_kind
        )
        assert gpu_lowering.count_triton_kernels(fwd) == 1
        bwd = gpu_lowering.lower_for_gpu(
            jax.grad(lambda l, r, g: grouped_matmul(l, r, g).astype(jnp.float32).sum(), argnums=(0, 1)),
            *args,
            device_kind=device_kind,
        )
        assert gpu_lowering.count_triton_kernels(bwd) == 3  # fwd, dlhs, drhs
