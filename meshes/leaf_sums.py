"""One number per leaf of a tree of sharded arrays (a sum over the leaf), with ONE collective.

`jnp.sum` over a sharded leaf becomes its own all-reduce over the axes that leaf is split on,
and XLA combines all-reduces only when they run over the same device groups: leaves split
differently (embed over data x context, heads over tensor, experts over expert) each pay a
collective. A train step's gradient norm, non-finite check and parameter norm so cost one small
all-reduce per leaf group: ~30 per step on tiny DeepSeek's `data=2,tensor=2,context=2,expert=2`
layout, each a rendezvous of every device.

Here each device reduces its own shard of every leaf, the partial sums are stacked into one
vector, and one psum over the mesh adds them. A leaf replicated over an axis contributes from
that axis's rank 0 only, so each element counts once and the sums are those of the whole leaves.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain.meshes.rules import active_mesh


def leaf_sums(local_sum: Callable, tree, specs=None) -> jax.Array:
    """[leaves] float32: `local_sum(x)` (a float32 scalar that adds up over pieces of x, e.g. a
    sum of squares) of every leaf of `tree`, whole-leaf values.

    `specs`: a tree like `tree` of PartitionSpecs or NamedShardings, the leaves' layouts. With
    them and an active mesh (meshes.rules.use_rules) one psum reduces every leaf; without, each
    leaf is reduced on its own (XLA's partitioner makes a collective per sharded leaf). They must
    be the layouts the leaves have at this point of the program: the shard_map's in_specs make
    XLA reshard (and hold) any leaf laid out otherwise (ZeRO-1 gradients are in the optimizer
    moments' layout: jaxtrain/training/step.gradient_layouts)."""
    leaves = jax.tree.leaves(tree)
    mesh = active_mesh()
    if specs is None or mesh is None or not leaves:
        return jnp.stack([jnp.asarray(local_sum(x), jnp.float32) for x in leaves]) if leaves else jnp.zeros((0,))
    layouts = [s.spec if isinstance(s, NamedSharding) else s
               for s in jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, (NamedSharding, PartitionSpec)))]
    if len(layouts) != len(leaves):
        raise ValueError(f"leaf_sums: {len(layouts)} layouts for {len(leaves)} leaves")
    axes = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)
    if not axes:
        return jnp.stack([jnp.asarray(local_sum(x), jnp.float32) for x in leaves])

    def local(*shards):
        sums = []
        for x, spec in zip(shards, layouts):
            value = jnp.asarray(local_sum(x), jnp.float32)
            split = set(_spec_axes(spec))
            for a in axes:  # a copy on every rank of an axis the leaf is not split on counts once
                if a not in split:
                    value = jnp.where(jax.lax.axis_index(a) == 0, value, 0.0)
            sums.append(value)
        return jax.lax.psum(jnp.stack(sums), axes)

    # check_vma=False: the psum adds every device's (masked) value, whatever its varying axes.
    return jax.shard_map(local, mesh=mesh, in_specs=tuple(layouts), out_specs=PartitionSpec(),
                         check_vma=False)(*leaves)


def _spec_axes(spec: PartitionSpec) -> tuple[str, ...]:
    out = []
    for entry in spec:
        if entry is None:
            continue
        out += [entry] if isinstance(entry, str) else list(entry)
    return tuple(out)


def squares(x) -> jax.Array:
    """Sum of squares in float32 (norms)."""
    return jnp.sum(jnp.square(x.astype(jnp.float32)))

