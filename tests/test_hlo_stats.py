"""Collective statistics of compiled HLO: executed counts multiply loop bodies by their trips."""
import pytest
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, PartitionSpec

from jaxtrain.observe.hlo_stats import collective_stats, executed_collective_stats

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
    assert executed == {"count": 15, "bytes": 15 * block}  # 5 outer x 3 inner trips


def test_tuple_collectives_with_index_comments_count_all_their_bytes():
    """XLA writes long tuple shapes with /*index=N*/ comments; a combined all-reduce of 6 arrays
    counts every array's bytes."""
    shapes = ", ".join(["f32[4,8]"] * 5 + ["/*index=5*/f32[4,8]"])
    line = f"  %all-reduce.1 = ({shapes}) all-reduce(%a, %b, %c, %d, %e, %f), replica_groups={{}}, to_apply=%add"
    hlo = "ENTRY %main (p: f32[4,8]) -> f32[4,8] {\n" + line + "\n}\n"
    expected = {"count": 1, "bytes": 6 * 4 * 8 * 4}
    assert collective_stats(hlo)["all-reduce"] == expected
    assert executed_collective_stats(hlo)["all-reduce"] == expected
