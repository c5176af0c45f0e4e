"""A model's layers seen by the pipeline: one sequence of layer kinds, and one stage's program.

A *kind* is the path of a `LayerStack` in the parameter tree: `("stacks", "moe_blocks")` for a
plain stack, `("stacks", "blocks", "moe")` for one kind of a `PatternStack`. Every layer of the
model is (kind, index within its kind), in the order the model applies them.

A stage runs its slots (meshes/pipeline_split.py) as runs of one kind, each a masked scan over
that kind's stacked parameters, so the program is the same on every stage.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.layers.moe import MoEBlock
from models.layers.stack import REMAT_POLICIES, LayerStack


def layer_stacks(model) -> dict[tuple, LayerStack]:
    """Every LayerStack of a CausalLM by kind path, in order of first use."""
    out = {}
    for name in model.stack_order:
        stack = model.stacks[name]
        if isinstance(stack, LayerStack):
            out[("stacks", name)] = stack
        else:  # a PatternStack: one LayerStack per kind
            for kind in stack.kinds:
                out[("stacks", name, kind)] = stack.stack(kind)
    return out


def layer_sequence(model) -> list[tuple[tuple, int]]:
    """(kind path, index within the kind) of every layer, in the order the model applies them."""
    sequence = []
    for name in model.stack_order:
        stack = model.stacks[name]
        if isinstance(stack, LayerStack):
            sequence += [(("stacks", name), i) for i in range(stack.num_layers)]
        else:
            sequence += [(("stacks", name, kind), i) for kind, i in stack.slots]
    return sequence


def layer_cost(stack: LayerStack) -> float:
    """Parameters one token passes through in one layer of the stack — routed experts count
    top_k / num_experts of theirs: a proxy for the layer's compute, for balancing stages."""
    size = lambda module: sum(x.size for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(module))))
    total = float(size(stack.layers))
    for _, node in nnx.iter_graph(stack.layers):
        if isinstance(node, MoEBlock):
            total -= size(node.experts) * (1 - node.cfg.top_k / node.cfg.num_experts)
    return total / stack.num_layers


# How a stage rematerializes activations (PipelineConfig.remat), on top of the model's own
# per-layer policy (`remat` of its config):
#   none   only the model's policy
#   layer  every layer recomputed in the backward pass (the model's policy, or `full`)
#   stage  only each tick's stage input is kept; the whole stage is recomputed
STAGE_REMAT = ("none", "layer", "stage")


class StageProgram:
    """One stage's forward for one tick: its slots of every kind, in pattern order.

    With several passes (interleaved schedule) a layer's weights for the current pass are
    sliced inside the layer, under `jax.checkpoint` with at least the `dots` policy: the
    backward slices them again instead of keeping a copy of the stage's weights for every tick
    (the full stacks are loop-invariant, so autodiff keeps them once).
    """

    def __init__(self, model, runs, passes: int, remat: str = "none"):
        """`remat`: one of STAGE_REMAT (checked with the config by PipelineConfig.validate)."""
        stacks = layer_stacks(model)
        self.graphdefs = {k: nnx.graphdef(s.layers) for k, s in stacks.items()}
        self.layer_remat = {}
        for kind, stack in stacks.items():
            policy = ("full" if stack.remat == "none" else stack.remat) if remat == "layer" else stack.remat
            self.layer_remat[kind] = "dots" if passes > 1 and policy == "none" else policy
        self.runs, self.passes, self.remat = runs, passes, remat

    def __call__(self, params: dict, valid: dict, repeat, x, positions, segment_ids):
        """params[kind]: the stage's layer state, leaves [passes, slots, ...]; valid[kind]: bool
        [passes, slots]. Returns (x, aux per kind with leaves [slots, ...])."""
        fn = jax.checkpoint(self._apply, prevent_cse=False) if self.remat == "stage" else self._apply
        return fn(params, valid, repeat, x, positions, segment_ids)

    def _apply(self, params, valid, repeat, x, positions, segment_ids):
        if self.passes == 1:  # a static index: no copy of the weights at all
            params, repeat = jax.tree.map(lambda a: a[0], params), None
        pieces = {kind: [] for kind in params}
        for kind, start, length in self.runs:
            x, aux = _masked_scan(self.graphdefs[kind], params[kind], valid[kind], repeat, start, length, x,
                                  (positions, segment_ids), self.layer_remat[kind])
            pieces[kind].append(aux)
        return x, {k: jax.tree.map(lambda *a: jnp.concatenate(a), *p) for k, p in pieces.items()}


def _masked_scan(graphdef, params, valid, repeat, start: int, length: int, x, args, remat: str):
    """Slots start..start+length of one kind by `lax.scan`; `params` leaves [slots, ...], or
    [passes, slots, ...] with `repeat` the pass. A padding slot's output is discarded (x passes
    through) and its aux is zero, so neither result nor gradient depends on it."""
    slots = start + jnp.arange(length)
    if repeat is None:  # scanned as xs (measured: XLA's temp memory does not grow with the tick count)
        xs = (jax.tree.map(lambda a: jax.lax.slice_in_dim(a, start, start + length), params), slots)
        weights = lambda w, slot: w
    else:  # sliced inside the (rematerialized) layer
        xs = (None, slots)
        weights = lambda w, slot: jax.tree.map(lambda a: a[repeat, slot], params)

    def layer(carry, inputs):
        w, slot = inputs
        y, aux = nnx.merge(graphdef, weights(w, slot))(carry, *args)
        ok = valid[repeat if repeat is not None else 0, slot]
        return jnp.where(ok, y, carry), jax.tree.map(lambda a: jnp.where(ok, a, jnp.zeros_like(a)), aux)

    if remat != "none":
        layer = jax.checkpoint(layer, policy=REMAT_POLICIES[remat], prevent_cse=False)
    return jax.lax.scan(layer, x, xs)
