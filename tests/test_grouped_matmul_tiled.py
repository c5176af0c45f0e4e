"""The CPU grouped matmul (a loop over row tiles) equals a float64 per-group loop, values and
gradients, for ragged, empty and overflowing groups; and its cost does not grow with groups."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul_tiled import grouped_matmul_tiled


def reference(lhs, rhs, sizes):
    """float64: rows in order, group g's rows times rhs[g]; rows past the groups give zeros."""
    out, start = np.zeros((lhs.shape[0], rhs.shape[2])), 0
    for g, size in enumerate(sizes):
        stop = min(start + size, lhs.shape[0])
        out[start:stop] = lhs[start:stop].astype(np.float64) @ rhs[g].astype(np.float64)
        start = stop
    return out


CASES = {
    "ragged": [5, 0, 17, 3, 30, 9],  # 64 rows: an empty group, tiles straddling groups
    "tail": [3, 10, 0, 20, 0, 7],  # 40 of 64 rows in groups: the rest must be zeros
    "one_group": [0, 0, 64, 0, 0, 0],
    "overflow": [40, 30, 10, 0, 0, 0],  # sizes sum past m: clipped like ragged_dot
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("block_m", [8, 16])
def test_values_and_gradients_equal_the_float64_loop(case, block_m):
    rng = np.random.default_rng(len(case) + block_m)
    m, k, n = 64, 12, 10
    sizes = np.asarray(CASES[case], np.int32)
    lhs, rhs = rng.normal(size=(m, k)).astype(np.float32), rng.normal(size=(6, k, n)).astype(np.float32)
    cot = rng.normal(size=(m, n))
    out = grouped_matmul_tiled(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes), block_m)
    np.testing.assert_allclose(np.asarray(out), reference(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)

    loss = lambda a, b: jnp.sum(grouped_matmul_tiled(a, b, jnp.asarray(sizes), block_m) * cot)
    dlhs, drhs = jax.grad(loss, argnums=(0, 1))(jnp.asarray(lhs), jnp.asarray(rhs))
    # d/dlhs of sum(out * cot) = cot @ rhs[g]^T per group row; d/drhs[g] = lhs_g^T @ cot_g.
    want_dlhs, want_drhs, start = np.zeros((m, k)), np.zeros((6, k, n)), 0
    for g, size in enumerate(sizes):
        stop = min(start + size, m)
        want_dlhs[start:stop] = cot[start:stop] @ rhs[g].astype(np.float64).T
        want_drhs[g] = lhs[start:stop].astype(np.float64).T @ cot[start:stop]
        start = stop
    np.testing.assert_allclose(np.asarray(dlhs), want_dlhs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(drhs), want_drhs, rtol=1e-5, atol=1e-4)


def test_matches_ragged_dot_on_random_sizes():
    rng = np.random.default_rng(3)
    lhs, rhs = rng.normal(size=(96, 8)).astype(np.float32), rng.normal(size=(5, 8, 4)).astype(np.float32)
    sizes = jnp.asarray(rng.multinomial(90, np.ones(5) / 5), jnp.int32)
    np.testing.assert_allclose(np.asarray(grouped_matmul_tiled(lhs, rhs, sizes)),
                               np.asarray(jax.lax.ragged_dot(lhs, rhs, sizes)), rtol=1e-5, atol=1e-5)


def test_flops_do_not_grow_with_the_number_of_groups():
    """XLA's own cost analysis of forward + backward: 64 groups cost ~1x, not 64x, of 4 groups."""
    m, k, n = 4096, 64, 64

    def flops(groups):
        sizes = jnp.full((groups,), m // groups, jnp.int32)
        f = jax.jit(jax.grad(lambda a, b: grouped_matmul_tiled(a, b, sizes, 64).sum(), argnums=(0, 1)))
        cost = f.lower(jnp.zeros((m, k)), jnp.zeros((groups, k, n))).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    few, many = flops(4), flops(64)
    assert many < 1.5 * few, (few, many)


def test_the_cpu_dispatch_takes_the_tiles_past_its_threshold(monkeypatch):
    """grouped_matmul(impl="xla") on CPU: past TILED_MIN_DENSE_WORK it runs the tile loop (a
    `scan` in its jaxpr, no ragged_dot), below it ragged_dot; both equal the float64 loop."""
    import importlib
    gm = importlib.import_module("pallas_kernels.grouped_matmul")  # the module (the package exports the function)

    rng = np.random.default_rng(7)
    sizes = np.asarray(CASES["ragged"], np.int32)
    # fresh shapes per case: grouped_matmul is jitted, so a cached trace would hide the switch
    for rows, threshold, tiled in ((64, 0, True), (72, 10**18, False)):
        lhs = rng.normal(size=(rows, 12)).astype(np.float32)
        rhs = rng.normal(size=(6, 12, 10)).astype(np.float32)
        call = lambda: gm.grouped_matmul(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes), impl="xla")
        monkeypatch.setattr(gm, "TILED_MIN_DENSE_WORK", threshold)
        text = str(jax.make_jaxpr(call)())
        assert ("scan" in text and "ragged_dot" not in text) == tiled, (threshold, text[:300])
        np.testing.assert_allclose(np.asarray(call()), reference(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)
