"""Checkpoint fingerprints (jaxtrain/checkpoints/fingerprint.py) are computed on the device at
every save and restore: the program hashes each leaf without holding anything of a leaf's size,
and its sums equal numpy's (BlockFingerprint, the path jaxtrain.convert records) for leaves split
over a mesh, replicated and whole."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain.checkpoints import fingerprint
from jaxtrain.checkpoints.fingerprint import BlockFingerprint, tree_fingerprints

pytestmark = [pytest.mark.fast]

MESH = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def numpy_fingerprint(x) -> str:
    reference = BlockFingerprint(x.shape)
    reference.add(tuple(slice(0, n) for n in x.shape), np.asarray(x))
    return reference.value()


def test_the_program_holds_nothing_of_a_leafs_size():
    """A save hashes the whole state in one program: it must not need the state's size again."""
    leaf = jax.ShapeDtypeStruct((64, 1024, 16), jnp.float32, sharding=NamedSharding(MESH, PartitionSpec("data")))
    leaves = [leaf] * 8
    compiled = fingerprint._jitted(len(leaves)).lower(leaves).compile()
    shard_bytes = 64 // 4 * 1024 * 16 * 4  # one leaf's rows on one device: 1 MiB
    assert compiled.memory_analysis().temp_size_in_bytes < shard_bytes / 16


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int32, np.uint8, np.bool_])
def test_fingerprints_of_split_replicated_and_whole_leaves_are_numpys(dtype):
    rng = np.random.default_rng(0)
    values = [rng.normal(size=(8, 6, 10)) * 100, rng.normal(size=(6, 4)) * 100, rng.normal(size=(5,)) * 100]
    host = [np.asarray(v).astype(dtype) for v in values]
    specs = [PartitionSpec("data", "tensor"), PartitionSpec(None, "tensor"), PartitionSpec()]
    tree = {f"leaf{i}": jax.device_put(x, NamedSharding(MESH, spec)) for i, (x, spec) in enumerate(zip(host, specs))}
    tree["empty"] = jnp.zeros((0, 3), dtype)
    got = tree_fingerprints(tree)
    want = {f"leaf{i}": numpy_fingerprint(x) for i, x in enumerate(host)}
    want["empty"] = numpy_fingerprint(np.zeros((0, 3), dtype))
    assert got == want
    assert len(set(want.values()) - {want["empty"]}) == 3  # distinct leaves, distinct fingerprints
