"""A pipelined state's canonical checkpoint tree, built one layer at a time into host memory.

Regrouping the whole stage layout into canonical `[layers, ...]` stacks on the device held a
second copy of the train state next to the first — more than a copy where a stack's layer
count does not divide `pipeline` and the canonical stack is replicated over it (several times
the state per device for Nemotron-3-Nano at pipeline=2). Here each canonical layer of each stacked
leaf (a parameter or a moment) is taken from its stage by a small jitted program, copied to host
memory and dropped from the device before the next. The
host pieces are stacked per device into `pinned_host` arrays laid out like the canonical disk
shardings, which Orbax writes as usual: the files are the canonical ones, whatever the layout.

Leaves outside the stacks (embedding, head, norms, counts) already have their canonical shape
and are handed over as they are. The same program hashes each layer with its canonical
indices, so the checkpoint's fingerprints (jaxtrain/checkpoints/fingerprint.py) never bring a
host array back to the device: the sums add up exactly, modulo 2**32.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxtrain.checkpoints.fingerprint import format_sums, leaf_path, offset_sums
from jaxtrain.train_state import map_param_leaves


class _Stacked:
    """A stacked leaf's mark: the parameter path it mirrors (a pytree leaf, not a tuple node)."""

    def __init__(self, path):
        self.path = path


class CanonicalItems(dict):
    """The canonical items for a save, with the fingerprints already computed for some leaves
    ({leaf path: fingerprint}), which Checkpointer.save uses instead of hashing them again."""

    fingerprints: dict


class StreamedCanonical:
    def __init__(self, layout, disk_shardings: dict, mesh):
        self.layout, self.disk_shardings, self.mesh = layout, disk_shardings, mesh
        self._programs = {}

    def __call__(self, items: dict) -> CanonicalItems:
        paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(items)
        out = [leaf for _, leaf in paths_leaves]
        fingerprints = {}
        for kind, members, leaves, shardings in self.groups(items):
            for i, (array, sums) in zip(members, self._stream_kind(kind, leaves, shardings)):
                out[i] = array
                fingerprints[leaf_path(paths_leaves[i][0])] = format_sums(sums)
        result = CanonicalItems(jax.tree_util.tree_unflatten(treedef, out))
        result.fingerprints = fingerprints
        return result

    def groups(self, items: dict):
        """[(kind, indices into the flattened items, those stage-layout leaves, their canonical
        disk shardings)] for each layer kind with stacked leaves in `items`."""
        leaves = jax.tree.leaves(items)
        marks = jax.tree.leaves(map_param_leaves(lambda path, leaf: _Stacked(path), items,
                                                 {p: self.layout.stage_shapes[p] for p in self.layout.kind_of},
                                                 other=lambda leaf: None),
                                is_leaf=lambda x: isinstance(x, _Stacked) or x is None)
        disk = jax.tree.leaves({k: self.disk_shardings[k] for k in items})
        assert len(marks) == len(leaves) == len(disk), (len(marks), len(leaves), len(disk))
        out = []
        for kind in self.layout.plan.kinds:
            members = [i for i, m in enumerate(marks) if isinstance(m, _Stacked) and self.layout.kind_of[m.path] == kind]
            if members:
                out.append((kind, members, [leaves[i] for i in members], [disk[i] for i in members]))
        return out

    def layer_program(self, kind, leaves, shardings):
        """The jitted program taking one canonical layer of `kind` from every given stage-layout
        leaf (saves call it with one leaf): (leaves, stage, repeat, slot, layer) -> (rows,
        fingerprint sums)."""
        return self._program(kind, tuple(leaves), tuple(_row_sharding(s) for s in shardings))

    # -- one kind's stacks, layer by layer ----------------------------------------------------
    def _stream_kind(self, kind, leaves, shardings):
        """[(canonical host array, fingerprint sums)] for each stage-layout leaf of `kind`."""
        positions = self.layout.plan.canonical_positions(kind)
        layers = len(positions)
        programs = [self.layer_program(kind, [leaf], [sharding]) for leaf, sharding in zip(leaves, shardings)]
        pieces = [{} for _ in leaves]  # per leaf: {device: [host row shards, in layer order]}
        totals = [np.zeros(2, np.uint64) for _ in leaves]
        stage_dims = tuple(leaves[0].shape[:3])  # [stages, repeats, slots]
        for layer, position in enumerate(positions):
            where = [np.int32(i) for i in np.unravel_index(position, stage_dims)]
            for program, leaf, leaf_pieces, total in zip(programs, leaves, pieces, totals):
                # one leaf's layer at a time: on the device never more than that (and its gather)
                (row,), (sums,) = program([leaf], *where, np.int32(layer))
                for shard in row.addressable_shards:
                    leaf_pieces.setdefault(shard.device, []).append(np.asarray(shard.data))
                total += np.asarray(jax.device_get(sums)).astype(np.uint64)
                del row
        built = []
        for leaf, sharding, leaf_pieces, total in zip(leaves, shardings, pieces, totals):
            shape = (layers,) + tuple(leaf.shape[3:])
            host = sharding.with_memory_kind("pinned_host")
            arrays = []
            for device, index in host.addressable_devices_indices_map(shape).items():
                block = np.stack(leaf_pieces[device][index[0]])
                arrays.append(jax.device_put(block, SingleDeviceSharding(device, memory_kind="pinned_host")))
            built.append((jax.make_array_from_single_device_arrays(shape, host, arrays), total % 2**32))
        return built

    def _program(self, kind, leaves, row_shardings):
        key = (kind, tuple((x.shape, x.dtype, x.sharding) for x in leaves), row_shardings)
        if key not in self._programs:
            replicated = NamedSharding(self.mesh, PartitionSpec())

            # each stage's candidate row stays on its stage (else XLA gathers the stack first)
            per_stage_shardings = [NamedSharding(self.mesh, PartitionSpec(*(_spec(x, x.ndim)[:1] + _spec(x, x.ndim)[3:])))
                                   for x in leaves]

            def rows_of(leaves, stage, repeat, slot, layer):
                rows, sums = [], []
                for x, per_stage_sharding in zip(leaves, per_stage_shardings):
                    # within every stage first (local), then the one stage's row: the gather
                    # across `pipeline` moves one layer per stage, never the stack
                    per_stage = jax.lax.dynamic_index_in_dim(
                        jax.lax.dynamic_index_in_dim(x, repeat, axis=1, keepdims=False), slot, axis=1, keepdims=False)
                    per_stage = jax.lax.with_sharding_constraint(per_stage, per_stage_sharding)
                    row = jax.lax.dynamic_index_in_dim(per_stage, stage, axis=0, keepdims=False)
                    rows.append(row)
                    sums.append(offset_sums(row, layer))
                return rows, sums

            self._programs[key] = jax.jit(rows_of, out_shardings=(list(row_shardings), [replicated] * len(leaves)))
        return self._programs[key]


def _row_sharding(sharding: NamedSharding) -> NamedSharding:
    """One layer of a canonical stack laid out as the stack is, less its `layers` dimension."""
    return NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]), memory_kind="device")


def _spec(x, ndim: int) -> tuple:
    """`x`'s partition spec, one entry per dimension."""
    spec = tuple(x.sharding.spec)
    return spec + (None,) * (ndim - len(spec))
