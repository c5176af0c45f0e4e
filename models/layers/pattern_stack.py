"""Layers of several kinds in a fixed per-layer order: a hybrid model's block pattern.

All layers of one kind are one `LayerStack` (stacked on a leading `layers` axis, so the
parameter tree is `<kind>/layers/...` whatever the pattern). The pattern runs as one `lax.scan`
over its layers (models/layers/layer_scan.py, the loop every stack runs): each step slices its
layer of every kind out of the stacks (a dynamic index: one layer of each kind copied per step)
and `lax.switch`es on the step's kind, so XLA compiles one layer of each kind whatever the depth,
and the stack's remat policy bounds what the backward pass keeps. Under autodiff a switch keeps
the residuals of every branch (zeros for the kinds that did not run): with remat `full` that is
only the layer's input per layer; with `none` or `dots` each layer keeps what every kind would
save (never the weights the step sliced: layer_scan.step_policy).

Bookkeeping is explicit so pipeline stages can take contiguous pieces of the pattern:
`slots[j] = (kind, index of layer j within its kind)`.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from jaxtrain.meshes.rules import constrain_param
from jaxtrain.models.layers.decode_cache import LayerCache
from jaxtrain.models.layers.layer_scan import scan_layers
from jaxtrain.models.layers.params import LOGICAL_AXES
from jaxtrain.models.layers.stack import LayerStack

_RESERVED = frozenset({"pattern", "kinds", "slots", "remat"})


def pattern_slots(pattern: Sequence[str]) -> tuple[tuple[str, int], ...]:
    """(kind, index within that kind) for every layer of the pattern, in order."""
    seen: Counter = Counter()
    slots = []
    for kind in pattern:
        slots.append((kind, seen[kind]))
        seen[kind] += 1
    return tuple(slots)


def read_indices(slots: Sequence[tuple[str, int]], kinds: Sequence[str]) -> np.ndarray:
    """[layers, kinds]: which layer of each kind step j slices. Its own kind's layer; for the
    other kinds the latest one before it (any valid index would do: that slice is unused, and
    its gradient is zero)."""
    latest = {kind: 0 for kind in kinds}
    rows = []
    for kind, index in slots:
        latest[kind] = index
        rows.append([latest[k] for k in kinds])
    return np.asarray(rows, np.int32)


def layer_of(stack_state, index):
    """Layer `index` (traced) of a stacked layer state, each weight kept in its parameter
    sharding. Unconstrained, XLA gathers FSDP-sharded weights outside the switch instead of
    inside the branch that uses them: every layer's weights gathered before the loop, hundreds of
    GiB per device at Nemotron-3-Nano's size, and the MoE and Mamba weights at every layer."""
    def one(variable):
        names = variable.get_metadata().get(LOGICAL_AXES)
        w = jax.lax.dynamic_index_in_dim(variable.get_value(), index, keepdims=False)
        return variable.replace(value=constrain_param(w, names[1:]) if names is not None else w)

    return jax.tree.map(one, stack_state, is_leaf=lambda v: isinstance(v, nnx.Variable))


class PatternStack(nnx.Module):
    """`makers[kind](rngs)` builds one layer of that kind; every layer's call is
    `layer(x, positions, segment_ids) -> (x, aux)`. The aux of this stack maps each kind to its
    layers' aux, stacked in pattern order (the order of the kind's own stack)."""

    def __init__(self, pattern: Sequence[str], makers: Mapping[str, Callable[[nnx.Rngs], nnx.Module]], *,
                 rngs: nnx.Rngs, remat: str = "none"):
        pattern = tuple(pattern)
        if not pattern:
            raise ValueError("a layer pattern needs at least one layer")
        unknown = sorted(set(pattern) - set(makers))
        if unknown:
            raise ValueError(f"layer pattern names unknown kind(s) {unknown}; known: {sorted(makers)}")
        bad = [k for k in makers if not k.isidentifier() or k in _RESERVED or hasattr(type(self), k)]
        if bad:
            raise ValueError(f"layer kinds {bad} cannot be attribute names")
        self.pattern = pattern
        self.kinds = tuple(dict.fromkeys(pattern))  # in order of first appearance
        self.slots = pattern_slots(pattern)
        self.remat = remat
        counts = Counter(pattern)
        for kind in self.kinds:
            setattr(self, kind, LayerStack(makers[kind], counts[kind], rngs=rngs, remat=remat))

    def stack(self, kind: str) -> LayerStack:
        return getattr(self, kind)

    def __call__(self, x, positions, segment_ids):
        split = [nnx.split(self.stack(kind).layers) for kind in self.kinds]
        graphdefs, stacks = [g for g, _ in split], tuple(s for _, s in split)
        layers = [lambda carry, weights, g=g: nnx.merge(g, weights)(carry, positions, segment_ids)
                  for g in graphdefs]
        # each step slices its layer of every kind (the other kinds' slices go unused)
        weights_at = lambda read: tuple(layer_of(s, read[k]) for k, s in enumerate(stacks))
        kind_ids = [self.kinds.index(kind) for kind, _ in self.slots]
        x, per_kind = scan_layers(layers, x, read_indices(self.slots, self.kinds), weights_at,
                                  kind_ids=kind_ids, remat=self.remat)
        return x, dict(zip(self.kinds, per_kind))  # each kind's aux: its own layers' rows, in pattern order

    # Generation (models/layers/decode_cache.py): {kind: that kind's caches, stacked on its own
    # layers axis}. Prefill threads them through the pattern's scan: each step slices one layer of
    # every kind's cache, the switch runs the step's kind on its slice, and every slice is written
    # back (one layer of every kind's cache copied per layer, once per prompt). Decode, every token,
    # instead unrolls the pattern (static, and one token's layer is small to compile): layer j reads
    # and writes its own kind's stacked cache in place at its static index, so no other cache is
    # touched (benchmarks/hybrid_decode.py times both ways of one decode step).
    def init_cache(self, batch: int, max_len: int, dtype):
        return {kind: self.stack(kind).init_cache(batch, max_len, dtype) for kind in self.kinds}

    def prefill(self, x, positions, segment_ids, cache):
        return self._with_cache(x, cache, lambda layer, h, c: layer.prefill(h, positions, segment_ids, c))

    def decode(self, x, positions, cache, index, valid_from):
        graphdefs = {kind: nnx.graphdef(self.stack(kind).layers) for kind in self.kinds}
        stacks = {kind: nnx.state(self.stack(kind).layers) for kind in self.kinds}
        cache = dict(cache)
        for kind, i in self.slots:
            layer = nnx.merge(graphdefs[kind], layer_of(stacks[kind], i))
            x, view = layer.decode(x, positions, LayerCache(cache[kind], i), index, valid_from)
            cache[kind] = view.entries
        return x, cache

    def _with_cache(self, x, cache, call):
        """call(layer, x, layer_cache) -> (x, layer_cache) over the pattern; -> (x, cache)."""
        split = [nnx.split(self.stack(kind).layers) for kind in self.kinds]
        graphdefs, stacks = [g for g, _ in split], tuple(s for _, s in split)
        caches = tuple(cache[kind] for kind in self.kinds)

        def branch(k):
            def apply(h, weights, layer_caches):
                h, mine = call(nnx.merge(graphdefs[k], weights[k]), h, layer_caches[k])
                return h, tuple(mine if j == k else c for j, c in enumerate(layer_caches))
            return apply

        branches = [branch(k) for k in range(len(stacks))]

        def step(carry, inputs):
            h, caches = carry
            kind, read = inputs
            weights = tuple(layer_of(s, read[k]) for k, s in enumerate(stacks))
            slices = tuple(jax.tree.map(lambda c, k=k: jax.lax.dynamic_index_in_dim(c, read[k], keepdims=False),
                                        caches[k]) for k in range(len(stacks)))
            h, slices = jax.lax.switch(kind, branches, h, weights, slices)
            caches = tuple(jax.tree.map(lambda c, u, k=k: jax.lax.dynamic_update_index_in_dim(c, u, read[k], 0),
                                        caches[k], slices[k]) for k in range(len(stacks)))
            return (h, caches), None

        kind_ids = np.asarray([self.kinds.index(kind) for kind, _ in self.slots], np.int32)
        (x, caches), _ = jax.lax.scan(step, (x, caches), (kind_ids, read_indices(self.slots, self.kinds)))
        return x, dict(zip(self.kinds, caches))

    def after_update(self, aux) -> None:
        for kind in self.kinds:
            self.stack(kind).after_update(aux.get(kind, {}))
