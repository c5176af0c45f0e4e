"""A stack of identical layers stored with a leading `layers` axis and applied by `lax.scan`.

Scanning compiles one layer instead of N (compile time stays flat in depth), and the stacked
layout is the canonical on-disk layout that pipeline stages regroup in memory.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.models.layers.aux_outputs import apply_after_update
from jaxtrain.models.layers.decode_cache import LayerCache
# REMAT_POLICIES is imported from here by the other stacks, planner and tests
from jaxtrain.models.layers.layer_scan import REMAT_POLICIES, check_remat, scan_layers  # noqa: F401
from jaxtrain.models.layers.params import LOGICAL_AXES


def _prepend_layers_axis(variable: nnx.Variable) -> nnx.Variable:
    names = variable.get_metadata().get(LOGICAL_AXES)
    return variable.replace(**{LOGICAL_AXES: ("layers",) + tuple(names)}) if names is not None else variable


class LayerStack(nnx.Module):
    """`make_layer(rngs)` builds one layer; its call is `layer(x, *args) -> (x, aux)`."""

    def __init__(self, make_layer: Callable[[nnx.Rngs], nnx.Module], num_layers: int, *,
                 rngs: nnx.Rngs, remat: str = "none"):
        if num_layers < 1:
            raise ValueError(f"a layer stack needs at least one layer, got {num_layers}")
        self.num_layers, self.remat = num_layers, check_remat(remat)
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: make_layer(nnx.Rngs(0))))
        keys = jax.random.split(rngs.params(), num_layers)
        state = jax.vmap(lambda key: nnx.state(make_layer(nnx.Rngs(params=key))))(keys)
        state = jax.tree.map(_prepend_layers_axis, state, is_leaf=lambda v: isinstance(v, nnx.Variable))
        self.layers = nnx.merge(graphdef, state)

    def __call__(self, x, *args):
        graphdef, state = nnx.split(self.layers)
        layer = lambda carry, weights: nnx.merge(graphdef, weights)(carry, *args)
        # the scan slices each layer's weights as its input
        x, (aux,) = scan_layers([layer], x, state, remat=self.remat)
        return x, aux  # aux: each leaf stacked per layer

    # Generation (models/layers/decode_cache.py): prefill slices each layer's cache out of the stacked
    # one as a scan input and stacks its update back as a scan output, like the weights (once per
    # prompt); decode updates the stacked cache in place (below).
    def init_cache(self, batch: int, max_len: int, dtype):
        one = self.layers.init_cache(batch, max_len, dtype)  # reads only static shapes, no weights
        return jax.tree.map(lambda c: jnp.broadcast_to(c, (self.num_layers,) + c.shape), one)

    def prefill(self, x, positions, segment_ids, cache):
        graphdef, state = nnx.split(self.layers)

        def one_layer(carry, xs):
            layer_state, layer_cache = xs
            return nnx.merge(graphdef, layer_state).prefill(carry, positions, segment_ids, layer_cache)

        return jax.lax.scan(one_layer, x, (state, cache))

    def decode(self, x, positions, cache, index, valid_from):
        """The stacked cache rides in the scan's carry and each layer writes its one new entry into
        it in place (a LayerCache view): as scan inputs/outputs, every layer's whole cache would be
        copied each step (models/layers/decode_cache.py)."""
        graphdef, state = nnx.split(self.layers)

        def one_layer(carry, xs):
            h, entries = carry
            layer_state, layer = xs
            h, view = nnx.merge(graphdef, layer_state).decode(h, positions, LayerCache(entries, layer), index,
                                                             valid_from)
            return (h, view.entries), None

        (x, cache), _ = jax.lax.scan(one_layer, (x, cache), (state, jnp.arange(self.num_layers)))
        return x, cache

    def after_update(self, aux) -> None:
        """Post-step updates of the layers' typed outputs (models/layers/aux_outputs.py)."""
        apply_after_update(self.layers, aux)
