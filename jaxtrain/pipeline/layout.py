"""Canonical <-> stage layout of parameter-shaped trees (parameters, Adam moments, MoE statistics).

Canonically each layer stack is stored `[layers, ...]` (what checkpoints hold). In the stage
layout each stack becomes `[stages, repeats, slots, ...]` (meshes/pipeline_split.py), the
stages dimension split over `pipeline`, padding slots zero. Everything outside the stacks
(embedding, final norm, head) keeps its canonical shape and is replicated over `pipeline`.

Both directions are gathers with static indices; run under `jit` with out_shardings they
produce each stage's layers directly on its devices. Any tree whose leaf paths end with a
parameter's path (optax states nest params-shaped trees) is regrouped leaf by leaf
(`jaxtrain.train_state.map_param_leaves`, which also lays out the shardings).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.train_state import map_param_leaves
from jaxtrain.meshes.pipeline_split import StagePlan
from jaxtrain.models.layers.params import logical_axes


class PipelineLayout:
    def __init__(self, plan: StagePlan, abstract_state: nnx.State):
        self.plan = plan
        flat = list(nnx.to_flat_state(abstract_state))
        self.canonical_names = {path: logical_axes(var) for path, var in flat}
        self.canonical_shapes = {path: tuple(var.shape) for path, var in flat}
        self.kind_of = {}  # parameter path -> its layer kind, for stacked layer parameters
        for path in self.canonical_names:
            for kind in plan.kinds:
                if path[:len(kind) + 1] == tuple(kind) + ("layers",):
                    self.kind_of[path] = kind
        self.stage_shapes = {p: self._stage_shape(p, s) for p, s in self.canonical_shapes.items()}
        self.stage_names = {p: (("stages", None) + n if p in self.kind_of else n)
                            for p, n in self.canonical_names.items()}

    def _stage_shape(self, path, shape):
        if path not in self.kind_of:
            return shape
        kind = self.kind_of[path]
        return (self.plan.stages, self.plan.repeats, self.plan.slots(kind)) + shape[1:]

    # -- regrouping ----------------------------------------------------------------------------
    def to_stages(self, tree):
        return self._map(tree, self.canonical_shapes, self._leaf_to_stages)

    def to_canonical(self, tree):
        return self._map(tree, self.stage_shapes, self._leaf_to_canonical)

    def _leaf_to_stages(self, kind, leaf):
        index = self.plan.index[kind]
        out = jnp.take(leaf, np.maximum(index, 0), axis=0)
        valid = (index >= 0).reshape(index.shape + (1,) * (leaf.ndim - 1))
        return jnp.where(valid, out, jnp.zeros_like(out))

    def _leaf_to_canonical(self, kind, leaf):
        flat = leaf.reshape((-1,) + leaf.shape[3:])
        return jnp.take(flat, self.plan.canonical_positions(kind), axis=0)

    def _map(self, tree, shapes, regroup):
        stacked = {path: shapes[path] for path in self.kind_of}
        return map_param_leaves(lambda path, leaf: regroup(self.kind_of[path], leaf), tree, stacked)

    def aux_to_canonical(self, aux: dict) -> dict:
        """Per-kind stage aux (`{kind path without "stacks": tree [stages, repeats, slots, ...]}`,
        nested) -> the same tree with leaves [layers of the kind, ...], as the model returns it."""
        def convert(kind, sub):
            return jax.tree.map(lambda a: self._leaf_to_canonical(kind, a), sub)
        return map_kinds(aux, self.plan.kinds, convert)


def map_kinds(tree: dict, kinds, fn) -> dict:
    """Applies fn(kind, subtree) to the subtree of `tree` at each kind's path (less the leading
    "stacks"), returning a new nested dict with the rest unchanged."""
    out = dict(tree)
    for kind in kinds:
        keys = kind[1:]
        node = out
        for key in keys[:-1]:
            node[key] = dict(node[key])
            node = node[key]
        node[keys[-1]] = fn(kind, node[keys[-1]])
    return out
