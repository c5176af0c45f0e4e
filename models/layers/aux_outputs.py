"""Typed side outputs of layers: what a block returns next to its activations (the MoE routing
statistics), and the three things generic code does with them.

A block returns `(x, aux)` where aux is a dict of its sub-modules' outputs keyed by attribute
name; a sub-module with something to report returns an `AuxOutput` (a pytree dataclass: stacks
scan it, the pipeline regroups it, gradient accumulation sums it like any tree). Generic code
(the train step, the pipeline) then only ever asks, by type, never by leaf name:

  total_aux_loss(aux)          the sum of every output's `loss()` (added to the training loss)
  aux_metrics(aux, m)          each output type's `metrics(...)` over its outputs, for the log
  apply_after_update(mod, aux) each output handed to the module that produced it, after the
                               optimizer step (`module.after_update(output)`: the MoE router's
                               correction-bias update)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


class AuxOutput:
    """Base of typed side outputs. Subclasses are `flax.struct.dataclass`es of arrays, summed
    over the tokens of the batch (so they add up over microbatches)."""
    after_update_applies = False  # True: the producing module has an after_update for it

    def loss(self):
        """This output's term in the training loss (a mean over its microbatch's tokens)."""
        return jnp.zeros((), jnp.float32)

    @classmethod
    def metrics(cls, outputs: dict, microbatches: int) -> dict:
        """Log metrics from all outputs of this type: `outputs` maps the name of the stack that
        produced each one to it (leaves stacked per layer)."""
        return {}


def is_aux_output(x) -> bool:
    return isinstance(x, AuxOutput)


def aux_outputs(tree) -> list:
    return [x for x in jax.tree.leaves(tree, is_leaf=is_aux_output) if is_aux_output(x)]


def total_aux_loss(aux):
    """Sum of every output's loss term (each layer of a stack counted)."""
    total = jnp.zeros((), jnp.float32)
    for out in aux_outputs(aux):
        total = total + jnp.sum(out.loss())
    return total


def aux_metrics(aux_by_stack: dict, microbatches: int = 1) -> dict:
    """{stack name: aux tree} -> metrics of every output type found, each type asked once."""
    by_type: dict[type, dict] = {}
    for stack, tree in aux_by_stack.items():
        for i, out in enumerate(aux_outputs(tree)):
            by_type.setdefault(type(out), {})[stack if i == 0 else f"{stack}.{i}"] = out
    metrics = {}
    for cls, outputs in by_type.items():
        metrics.update(cls.metrics(outputs, microbatches))
    return metrics


def apply_after_update(module, aux) -> None:
    """Walks `aux` alongside the module tree (aux keys are attribute names, stacks' leaves have
    a leading layers axis like their parameters) and calls `after_update(output)` on each module
    whose output is typed."""
    if is_aux_output(aux):
        if hasattr(module, "after_update"):
            module.after_update(aux)
        return
    if isinstance(aux, dict):
        for key, sub in aux.items():
            child = getattr(module, key, None)
            if child is not None:
                apply_after_update(child, sub)


def has_after_update(aux) -> bool:
    return any(type(out).after_update_applies for out in aux_outputs(aux))
