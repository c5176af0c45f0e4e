"""Layout-independent fingerprints of array trees, to verify a checkpoint after restore.

A leaf's fingerprint is a pair of sums, modulo 2**32, over its elements of a 32-bit integer
hash of (the element's bits, its index in the global array). Integer sums modulo 2**32 are
exact and associative, so the value is the same whatever the mesh, the sharding or the number
of processes that computed it: a checkpoint saved from one layout is verified after it is
restored onto another, without reading its files twice. The hash is a bijection of the bits
for a fixed index, so any change to one element (a flipped bit, a zeroed block) changes the
sums; two hashes with different keys make an accidental match a 2**-64 event.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.meshes.tree_paths import path_text

_KEYS = (0x9E3779B9, 0x7F4A7C15)


def _mix(x, key, xp):
    """A 32-bit avalanche hash (xorshift-multiply rounds), elementwise on uint32 arrays."""
    u32 = xp.uint32
    x = x ^ u32(key)
    x = (x ^ (x >> u32(16))) * u32(0x85EBCA6B)
    x = (x ^ (x >> u32(13))) * u32(0xC2B2AE35)
    return x ^ (x >> u32(16))


def _bits(x, xp):
    """Each element's bit pattern as uint32 (8/16-bit types widened, 64-bit folded)."""
    dtype = np.dtype(x.dtype)
    if dtype == np.bool_:
        return x.astype(xp.uint32)
    unsigned = {1: xp.uint8, 2: xp.uint16, 4: xp.uint32, 8: xp.uint64}[dtype.itemsize]
    raw = jax.lax.bitcast_convert_type(x, unsigned) if xp is jnp else x.view(unsigned)
    if dtype.itemsize == 8:
        return (raw ^ (raw >> xp.uint64(32))).astype(xp.uint32)
    return raw.astype(xp.uint32)


def _leaf_sums(x, index, xp):
    """The two sums for elements `x` whose flat global indices are `index` (uint32 arrays)."""
    bits = _bits(x, xp)
    hashes = [_mix(bits ^ _mix(index, key ^ 0xA5A5A5A5, xp), key, xp) for key in _KEYS]
    if xp is not jnp:
        return [h.sum(dtype=xp.uint32) for h in hashes]
    # One reduction of both hashes, which XLA fuses with the hashing: nothing of the leaf's size is
    # materialized. Summed one by one, XLA:CPU rewrites each long sum as a windowed one over its
    # materialized input (a uint32 array of the leaf's size per key) and schedules every leaf's
    # at once: twice the whole state's bytes in temp memory at each save and restore.
    zero = jnp.uint32(0)
    return list(jax.lax.reduce(tuple(hashes), (zero, zero), lambda a, b: (a[0] + b[0], a[1] + b[1]),
                               tuple(range(x.ndim))))


def _global_index(shape):
    """Flat global indices built in the leaf's own shape (no reshape, which would regather a
    sharded array)."""
    index = jnp.zeros(shape, jnp.uint32)
    for dim, stride in enumerate(_strides(shape)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, dim) * jnp.uint32(stride % 2**32)
    return index


def _device_leaf(x):
    if x.size == 0:
        return jnp.zeros((2,), jnp.uint32)
    return jnp.stack(_leaf_sums(x, _global_index(x.shape), jnp))


def offset_sums(x, rows_before):
    """The two sums of `x` as row `rows_before` of a stack [rows, *x.shape] (traced or not):
    its elements' global indices start at rows_before * x.size. Summed over every row (modulo
    2**32) they equal the stack's fingerprint sums."""
    index = _global_index(x.shape) + jnp.asarray(rows_before, jnp.uint32) * jnp.uint32(x.size % 2**32)
    return jnp.stack(_leaf_sums(x, index, jnp))


def format_sums(sums) -> str:
    """Two sums as a fingerprint string (the manifest's form)."""
    return _format(sums)


def _strides(shape) -> list[int]:
    return [int(np.prod(shape[d + 1:], dtype=np.int64)) for d in range(len(shape))]


@functools.lru_cache(maxsize=None)
def _jitted(count: int):
    """One jitted function per leaf count (jit itself caches per shapes and shardings)."""
    return jax.jit(lambda leaves: [_device_leaf(x) for x in leaves])


def tree_fingerprints(tree, known: dict | None = None) -> dict[str, str]:
    """{"path/to/leaf": "xxxxxxxx-xxxxxxxx"} for every array leaf of `tree`, computed on device
    in the arrays' own shardings. Leaves kept in host memory (offloaded optimizer state) visit
    the device one at a time, so hashing them never holds more than one on the device. `known`:
    fingerprints already computed (by whoever built those leaves), taken as they are."""
    known = known or {}
    paths_leaves = [(p, x) for p, x in jax.tree_util.tree_leaves_with_path(tree) if leaf_path(p) not in known]
    on_host = [_memory_kind(leaf) not in (None, "device") for _, leaf in paths_leaves]
    device_leaves = [leaf for (_, leaf), host in zip(paths_leaves, on_host) if not host]
    sums = iter(jax.device_get(_jitted(len(device_leaves))(device_leaves)))
    out = {}
    for (path, leaf), host in zip(paths_leaves, on_host):
        if host:
            leaf = jax.device_put(leaf, leaf.sharding.with_memory_kind("device"))
            out[leaf_path(path)] = _format(jax.device_get(_jitted(1)([leaf])[0]))
        else:
            out[leaf_path(path)] = _format(next(sums))
    return {**out, **{p: fp for p, fp in known.items()}}


def _memory_kind(leaf):
    return getattr(getattr(leaf, "sharding", None), "memory_kind", None)


class BlockFingerprint:
    """The fingerprint of an array of `shape` fed as (region, numpy block) pairs that tile it, in
    any order (how jaxtrain.cli.convert streams a leaf while writing it); `value()` equals
    `tree_fingerprints` of the whole array."""

    def __init__(self, shape):
        self.strides = _strides(tuple(shape))
        self.total = [0, 0]

    def add(self, region, block) -> None:
        block = np.asarray(block)
        index = np.zeros(block.shape, np.uint64)
        for dim, (piece, stride) in enumerate(zip(region, self.strides)):
            along = np.arange(piece.start or 0, (piece.start or 0) + block.shape[dim], dtype=np.uint64)
            index = index + along.reshape([-1 if d == dim else 1 for d in range(block.ndim)]) * np.uint64(stride)
        with np.errstate(over="ignore"):
            sums = _leaf_sums(block, (index % 2**32).astype(np.uint32), np)
        self.total = [(t + int(s)) % 2**32 for t, s in zip(self.total, sums)]

    def value(self) -> str:
        return _format(self.total)


def block_fingerprint(blocks, shape) -> str:
    """BlockFingerprint of all (region, block) pairs of `blocks` at once."""
    fingerprint = BlockFingerprint(shape)
    for region, block in blocks:
        fingerprint.add(region, block)
    return fingerprint.value()


def _format(sums) -> str:
    return "-".join(f"{int(s):08x}" for s in sums)


def leaf_path(path) -> str:
    """A leaf's key path as text: the manifest's name for each fingerprint."""
    return path_text(path)
