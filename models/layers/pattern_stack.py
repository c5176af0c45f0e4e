"""Layers of several kinds in a fixed per-layer order: a hybrid model's block pattern.

All layers of one kind are one `LayerStack` (stacked on a leading `layers` axis, so the
parameter tree is `<kind>/layers/...` whatever the pattern), and the pattern is applied layer by
layer, each layer sliced statically out of its kind's stack. That loop is unrolled: compile
time grows with depth (the scan of a homogeneous stack does not). Acceptable at tens of layers;
scanning runs of a repeating period is the next step if it is not.

Bookkeeping is explicit so pipeline stages can later take contiguous pieces of the pattern:
`slots[j] = (kind, index of layer j within its kind)`.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from models.layers.stack import REMAT_POLICIES, LayerStack

_RESERVED = frozenset({"pattern", "kinds", "slots"})


def pattern_slots(pattern: Sequence[str]) -> tuple[tuple[str, int], ...]:
    """(kind, index within that kind) for every layer of the pattern, in order."""
    seen: Counter = Counter()
    slots = []
    for kind in pattern:
        slots.append((kind, seen[kind]))
        seen[kind] += 1
    return tuple(slots)


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
        counts = Counter(pattern)
        for kind in self.kinds:
            setattr(self, kind, LayerStack(makers[kind], counts[kind], rngs=rngs, remat=remat))

    def stack(self, kind: str) -> LayerStack:
        return getattr(self, kind)

    def __call__(self, x, positions, segment_ids):
        per_kind: dict[str, list] = {kind: [] for kind in self.kinds}
        for kind, index in self.slots:
            x, aux = _apply_layer(self.stack(kind), index, x, positions, segment_ids)
            per_kind[kind].append(aux)
        return x, {kind: jax.tree.map(lambda *a: jnp.stack(a), *auxes) for kind, auxes in per_kind.items()}

    def update_router_biases(self, aux) -> None:
        for kind in self.kinds:
            self.stack(kind).update_router_biases(aux.get(kind, {}))


def _apply_layer(stack: LayerStack, index: int, x, *args):
    """Layer `index` of a stacked LayerStack, with the stack's remat policy."""
    graphdef, state = nnx.split(stack.layers)

    def one_layer(carry, layer_state):
        return nnx.merge(graphdef, layer_state)(carry, *args)

    if stack.remat != "none":
        one_layer = jax.checkpoint(one_layer, policy=REMAT_POLICIES[stack.remat])
    return one_layer(x, jax.tree.map(lambda a: a[index], state))
