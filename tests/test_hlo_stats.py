"""Collective statistics of compiled HLO: executed counts multiply loop bodies by their trips and
count a conditional's branches by how often each runs (a range where the data decides)."""
import sys

import pytest
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, PartitionSpec

from jaxtrain.observe.hlo_stats import collective_stats, compiled_hlo_text, executed_collective_stats

pytestmark = [pytest.mark.fast]


def test_nested_loops_multiply_collective_counts_and_bytes():
    mesh = Mesh(np.asarray(jax.devices()[:4]), ("c",), axis_types=(AxisType.Auto,))
    ring = [(i, (i + 1) % 4) for i in range(4)]

    def per_device(x):
        def outer(c, _):
            inner = lambda c2, _: (jax.lax.ppermute(c2, "c", ring) * 2.0, None)
            return jax.lax.scan(inner, c, None, length=3)[0], None
        return jax.lax.scan(outer, x, None, length=5)[0]

    fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=PartitionSpec("c"), out_specs=PartitionSpec("c")))
    hlo = fn.lower(jnp.ones((8, 16), jnp.float32)).compile().as_text()
    once, executed = collective_stats(hlo)["collective-permute"], executed_collective_stats(hlo)["collective-permute"]
    block = 2 * 16 * 4  # one device's [2, 16] float32 shard
    assert once == {"count": 1, "bytes": block}
    assert executed == {"count": 15, "bytes": 15 * block, "min_count": 15, "min_bytes": 15 * block}  # 5 x 3 trips


def test_tuple_collectives_with_index_comments_count_all_their_bytes():
    """XLA writes long tuple shapes with /*index=N*/ comments; a combined all-reduce of 6 arrays
    counts every array's bytes."""
    shapes = ", ".join(["f32[4,8]"] * 5 + ["/*index=5*/f32[4,8]"])
    line = f"  %all-reduce.1 = ({shapes}) all-reduce(%a, %b, %c, %d, %e, %f), replica_groups={{}}, to_apply=%add"
    hlo = "ENTRY %main (p: f32[4,8]) -> f32[4,8] {\n" + line + "\n}\n"
    expected = {"count": 1, "bytes": 6 * 4 * 8 * 4}
    assert collective_stats(hlo)["all-reduce"] == expected
    assert executed_collective_stats(hlo)["all-reduce"] == {**expected, "min_count": 1, "min_bytes": 6 * 4 * 8 * 4}


KINDS = np.array([0, 1, 0, 0, 2, 0, 1], np.int32)  # per layer: 0 all-reduces, 1 all-gathers, 2 neither
ROWS, WIDTH = 2, 16  # one device's [2, 16] float32 block


def _switched_scan():
    """A scan that switches on a constant kind per step (as a layer scan over kinds does), under
    remat, per device of a 4-device shard_map."""
    mesh = Mesh(np.asarray(jax.devices()[:4]), ("c",), axis_types=(AxisType.Auto,))
    branches = [lambda c: jax.lax.psum(c, "c") * 0.5,
                lambda c: jax.lax.all_gather(c, "c", tiled=True)[:ROWS] * 2.0,
                lambda c: c * 3.0]

    def per_device(x):
        step = jax.checkpoint(lambda c, kind: (jax.lax.switch(kind, branches, c), None))
        return jax.lax.scan(step, x, KINDS)[0]

    return jax.shard_map(per_device, mesh=mesh, in_specs=PartitionSpec("c"), out_specs=PartitionSpec("c"),
                         check_vma=False)


def _exactly(count, nbytes):
    return {"count": count, "bytes": nbytes, "min_count": count, "min_bytes": nbytes}


def test_a_switch_on_a_constant_kind_counts_each_branch_as_often_as_it_runs():
    """Forward: the loop slices the constant kinds (sunk into its body): a psum per kind-0 step,
    a gather per kind-1 step."""
    hlo = jax.jit(_switched_scan()).lower(jnp.ones((4 * ROWS, WIDTH))).compile().as_text()
    stats, block = executed_collective_stats(hlo), ROWS * WIDTH * 4
    reduces, gathers = int((KINDS == 0).sum()), int((KINDS == 1).sum())
    assert stats["all-reduce"] == _exactly(reduces, reduces * block), stats
    assert stats["all-gather"] == _exactly(gathers, gathers * 4 * block), stats
    assert collective_stats(hlo)["all-gather"]["count"] == 1  # each instruction once


def test_a_long_kind_array_is_read_from_the_text_with_its_constants(monkeypatch):
    """A stage of 35 slots: `as_text()` elides the kinds constant ({...}), so its switch counts
    as a range; compiled_hlo_text writes it out, and each branch counts as often as it runs."""
    monkeypatch.setattr(sys.modules[__name__], "KINDS", np.tile(KINDS, 5))
    compiled = jax.jit(_switched_scan()).lower(jnp.ones((4 * ROWS, WIDTH))).compile()
    block, reduces = ROWS * WIDTH * 4, int((KINDS == 0).sum())
    assert executed_collective_stats(compiled.as_text())["all-reduce"]["min_count"] == 0  # why it exists
    stats = executed_collective_stats(compiled_hlo_text(compiled))
    assert stats["all-reduce"] == _exactly(reduces, reduces * block), stats


def test_the_backward_loop_counts_branches_by_the_stacked_kinds():
    """Gradient of the (linear) scan: only the backward loop runs, switching on the copy of the
    kinds the scan stacked, in reverse: the psum's transpose is a psum, the gather's a
    reduce-scatter, once per step of their kind."""
    f = _switched_scan()
    hlo = jax.jit(jax.grad(lambda x: f(x).sum())).lower(jnp.ones((4 * ROWS, WIDTH))).compile().as_text()
    stats, block = executed_collective_stats(hlo), ROWS * WIDTH * 4
    reduces, gathers = int((KINDS == 0).sum()), int((KINDS == 1).sum())
    assert stats["all-reduce"] == _exactly(reduces, reduces * block), stats
    assert stats["reduce-scatter"] == _exactly(gathers, gathers * block), stats
    assert stats["all-gather"] == _exactly(0, 0), stats


def test_a_nonlinear_switch_counts_the_kinds_the_forward_stacked():
    """Without remat the forward loop stacks each step's (clamped) kind for the backward loop,
    which switches on that copy: sin after each collective makes both passes run, so a kind-0
    step all-reduces twice (the psum and its transpose), a kind-1 step gathers once and
    reduce-scatters once."""
    mesh = Mesh(np.asarray(jax.devices()[:4]), ("c",), axis_types=(AxisType.Auto,))
    branches = [lambda c: jnp.sin(jax.lax.psum(c, "c")),
                lambda c: jnp.sin(jax.lax.all_gather(c, "c", tiled=True)[:ROWS]),
                lambda c: jnp.sin(c)]

    def per_device(x):
        return jax.lax.scan(lambda c, kind: (jax.lax.switch(kind, branches, c), None), x, KINDS)[0]

    f = jax.shard_map(per_device, mesh=mesh, in_specs=PartitionSpec("c"), out_specs=PartitionSpec("c"),
                      check_vma=False)
    hlo = jax.jit(jax.grad(lambda x: f(x).sum())).lower(jnp.ones((4 * ROWS, WIDTH))).compile().as_text()
    stats, block = executed_collective_stats(hlo), ROWS * WIDTH * 4
    reduces, gathers = int((KINDS == 0).sum()), int((KINDS == 1).sum())
    assert stats["all-reduce"] == _exactly(2 * reduces, 2 * reduces * block), stats
    assert stats["all-gather"] == _exactly(gathers, gathers * 4 * block), stats
    assert stats["reduce-scatter"] == _exactly(gathers, gathers * block), stats


def test_a_branch_the_data_chooses_is_counted_as_a_range():
    mesh = Mesh(np.asarray(jax.devices()[:4]), ("c",), axis_types=(AxisType.Auto,))

    def per_device(x):
        def step(c, _):
            return jax.lax.cond(c.sum() > 0, lambda c: jax.lax.psum(c, "c"), lambda c: c * 0.5, c), None
        return jax.lax.scan(step, x, None, length=5)[0]

    f = jax.shard_map(per_device, mesh=mesh, in_specs=PartitionSpec("c"), out_specs=PartitionSpec("c"),
                      check_vma=False)
    stats = executed_collective_stats(jax.jit(f).lower(jnp.ones((4 * ROWS, WIDTH))).compile().as_text())
    block = ROWS * WIDTH * 4
    assert stats["all-reduce"] == {"count": 5, "bytes": 5 * block, "min_count": 0, "min_bytes": 0}, stats
