"""The CPU grouped matmul (a loop over row tiles) equals a float64 per-group loop, values and
gradients, for ragged, empty and overflowing groups; and its work, counted in the traced loops,
is one tile per schedule item (cdiv(m, block_m) + groups), not rows x groups."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtrain.pallas_kernels.grouped_matmul_tiled as tiled
from jaxtrain.pallas_kernels.grouped_matmul_tiled import grouped_matmul_tiled

pytestmark = [pytest.mark.fast]


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


def matmul_work(jaxpr, repeats: int = 1) -> int:
    """Multiply-adds x 2 of every dot_general in a jaxpr, each counted once per trip of the scans
    around it (XLA's cost analysis counts a loop body once). A while loop has no static trip
    count: count its body with `tile_loop_bodies` and its trips as it runs."""
    work = 0
    for eqn in jaxpr.eqns:
        assert eqn.primitive.name != "while", "a while loop: its work cannot be counted"
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            contracted = int(np.prod([eqn.invars[0].aval.shape[d] for d in contract]))
            work += 2 * repeats * int(np.prod(eqn.outvars[0].aval.shape)) * contracted
        trips = repeats * eqn.params["length"] if eqn.primitive.name == "scan" else repeats
        for sub in _subjaxprs(eqn):
            work += matmul_work(sub, trips)
    return work


def _subjaxprs(eqn):
    return [getattr(v, "jaxpr", v) for value in eqn.params.values()
            for v in (value if isinstance(value, (tuple, list)) else (value,))
            if hasattr(v, "eqns") or hasattr(getattr(v, "jaxpr", None), "eqns")]


def _has_dot(jaxpr) -> bool:
    """A dot_general in this jaxpr or any jaxpr inside it."""
    return any(e.primitive.name == "dot_general" or any(_has_dot(s) for s in _subjaxprs(e)) for e in jaxpr.eqns)


def tile_loop_bodies(jaxpr) -> list:
    """The bodies of the while loops (at any depth) that multiply matrices: the tile loops, whose
    trip count is traced (the schedule's items holding rows)."""
    bodies = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "while" and _has_dot(eqn.params["body_jaxpr"].jaxpr):
            bodies.append(eqn.params["body_jaxpr"].jaxpr)
        for sub in _subjaxprs(eqn):
            bodies += tile_loop_bodies(sub)
    return bodies


@pytest.mark.parametrize("m, groups", [(4096, 4), (4096, 64), (1000, 7), (64, 64)])
def test_work_is_one_tile_per_schedule_item_not_rows_times_groups(m, groups):
    """Forward + backward (three tile loops: out, dlhs, drhs): each loop's body multiplies one
    [block_m, k] x [k, n] tile (counted in the traced program) and runs at most cdiv(m, block_m)
    + groups trips (counted as it runs), so 64 groups cost at most one extra tile each, not 64x
    the rows' work (the dense ragged_dot on CPU)."""
    k, n, block_m = 16, 8, 64
    sizes = jnp.full((groups,), m // groups, jnp.int32)
    f = jax.grad(lambda a, b: grouped_matmul_tiled(a, b, sizes, block_m).sum(), argnums=(0, 1))
    jaxpr = jax.make_jaxpr(f)(jax.ShapeDtypeStruct((m, k), jnp.float32),
                              jax.ShapeDtypeStruct((groups, k, n), jnp.float32))
    one_tile = 2 * block_m * k * n
    assert [matmul_work(body) for body in tile_loop_bodies(jaxpr.jaxpr)] == [one_tile] * 3
    lhs, rhs, cot = jnp.ones((m, k)), jnp.ones((groups, k, n)), jnp.ones((m, n))
    trips = [int(tiled._forward_counted(lhs, rhs, sizes, block_m)[1]),
             int(tiled._forward_counted(cot, rhs, sizes, block_m, transpose_rhs=True)[1]),
             int(tiled._rhs_grad_counted(lhs, cot, sizes, groups, block_m, jnp.float32)[1])]
    assert max(trips) <= -(-m // block_m) + groups, trips
    rows_work = 3 * 2 * m * k * n  # the ideal: every row through one matrix, three times
    assert sum(trips) * one_tile <= rows_work + 3 * (groups + 1) * one_tile, trips


@pytest.mark.parametrize("sizes", [[100, 0, 180, 76], [512, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
def test_a_padded_buffer_costs_its_filled_rows_not_its_size(sizes):
    """A dropless dispatch's receive buffer holds the worst case (every slot sent to one device):
    here 2048 rows of which sum(sizes) are filled. Each of the three tile loops (out, dlhs, drhs)
    runs a tile product only for items holding a group's rows: counted as the loops run (a
    count in the loop's carry), it equals the items of the filled rows' schedule,
    cdiv-per-group, never the 2048 / 64 + 4 = 36 the buffer's static schedule lists. Values and
    gradients equal a float64 loop over the filled rows (the padding's output and gradient are 0)."""
    m, k, n, block_m = 2048, 16, 8, 64
    sizes = np.asarray(sizes, np.int32)
    rng = np.random.default_rng(int(sizes.sum()) + 5)
    lhs, rhs = rng.normal(size=(m, k)).astype(np.float32), rng.normal(size=(4, k, n)).astype(np.float32)
    cot = rng.normal(size=(m, n)).astype(np.float32)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    touched = lambda lo, hi: 0 if hi <= lo else (hi - 1) // block_m - lo // block_m + 1
    expected = sum(touched(bounds[g], bounds[g + 1]) for g in range(4))  # items holding a group's rows

    out, run_out = tiled._forward_counted(lhs, rhs, jnp.asarray(sizes), block_m)
    _, run_dlhs = tiled._forward_counted(cot, rhs, jnp.asarray(sizes), block_m, transpose_rhs=True)
    drhs, run_drhs = tiled._rhs_grad_counted(lhs, cot, jnp.asarray(sizes), 4, block_m, jnp.float32)
    assert (int(run_out), int(run_dlhs), int(run_drhs)) == (expected,) * 3, (run_out, run_dlhs, run_drhs, expected)
    assert expected <= -(-int(sizes.sum()) // block_m) + 4 < 36
    assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(drhs)).all()
    np.testing.assert_allclose(np.asarray(out), reference(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)
    want_drhs = np.stack([lhs[bounds[g]:bounds[g + 1]].astype(np.float64).T @ cot[bounds[g]:bounds[g + 1]]
                          for g in range(4)])
    np.testing.assert_allclose(np.asarray(drhs), want_drhs, rtol=1e-4, atol=1e-4)


def test_the_cpu_dispatch_takes_the_tiles_past_its_threshold(monkeypatch):
    """grouped_matmul(impl="xla") on CPU: past TILED_MIN_DENSE_WORK it runs the tile loop (a
    `while` in its jaxpr, no ragged_dot), below it ragged_dot; both equal the float64 loop."""
    import importlib
    gm = importlib.import_module("jaxtrain.pallas_kernels.grouped_matmul")  # the module (the package exports the function)

    rng = np.random.default_rng(7)
    sizes = np.asarray(CASES["ragged"], np.int32)
    # fresh shapes per case: grouped_matmul is jitted, so a cached trace would hide the switch
    for rows, threshold, tiled in ((64, 0, True), (72, 10**18, False)):
        lhs = rng.normal(size=(rows, 12)).astype(np.float32)
        rhs = rng.normal(size=(6, 12, 10)).astype(np.float32)
        call = lambda: gm.grouped_matmul(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes), impl="xla")
        monkeypatch.setattr(gm, "TILED_MIN_DENSE_WORK", threshold)
        text = str(jax.make_jaxpr(call)())
        assert ("while" in text and "ragged_dot" not in text) == tiled, (threshold, text[:300])
        np.testing.assert_allclose(np.asarray(call()), reference(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)
