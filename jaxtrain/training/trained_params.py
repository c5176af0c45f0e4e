"""Which parameters a run trains: all of them, or the part not declared "untrained".

A parameter declared "untrained" (models/layers/params.py; the base weights under adapters,
models/lora.py) stays in the train state's `params`, so checkpoints, evaluation and the forward
pass see the whole model, but the step differentiates with respect to the trained part
only (no gradient buffer exists for the rest) and the optimizer's state covers the trained part
only (no Adam moments). One strategy per case, same interface, chosen once from the roles:

  AllParams   every parameter trained: each method is the identity (the plain step)
  SomeParams  the parameters at the given paths trained: `select` prunes a params-shaped tree
              (params, their shardings, abstract values) to them, `merge` puts them back

`only_trained(tx, part)` wraps an optax transformation so its state is made for, and its update
applied to, the trained part of whatever params it is given: the train state's init, its
shardings and a restore's fresh optimizer state all call `tx.init(params)` unchanged.
"""
from __future__ import annotations

import dataclasses

import optax


@dataclasses.dataclass(frozen=True)
class AllParams:
    def select(self, tree):
        return tree

    def split(self, params):
        """(trained, the rest): what the step differentiates with respect to, and what it holds fixed."""
        return params, None

    def merge(self, rest, trained):
        return trained


_MISSING = object()


@dataclasses.dataclass(frozen=True)
class SomeParams:
    paths: frozenset  # parameter paths (tuples of keys) that are trained

    def select(self, tree):
        if tree is None:
            return None
        picked = self._select(tree, ())
        return {} if picked is _MISSING else picked

    def _select(self, tree, prefix):
        if not isinstance(tree, dict):
            return tree if prefix in self.paths else _MISSING
        out = {}
        for key, sub in tree.items():
            picked = self._select(sub, prefix + (key,))
            if picked is not _MISSING:
                out[key] = picked
        return out if out else _MISSING

    def split(self, params):
        return self.select(params), params

    def merge(self, rest, trained):
        """`rest` (a whole params tree) with the trained leaves taken from `trained`."""
        if not isinstance(trained, dict):
            return trained
        return {key: self.merge(sub, trained[key]) if key in trained else sub for key, sub in rest.items()}


def trained_params(roles: dict) -> AllParams | SomeParams:
    """The strategy for `roles` ({parameter path: optimizer role}, models/layers/params.py)."""
    if "untrained" not in roles.values():
        return AllParams()
    paths = frozenset(p for p, role in roles.items() if role != "untrained")
    if not paths:
        raise ValueError("every parameter is declared untrained: nothing to train")
    return SomeParams(paths)


def only_trained(tx: optax.GradientTransformation, part) -> optax.GradientTransformationExtraArgs:
    """`tx` over the trained part of the params it is given (whole, or already the part: selecting
    twice is selecting once); its updates are for the trained part."""
    if isinstance(part, AllParams):
        return tx
    tx = optax.with_extra_args_support(tx)

    def init(params):
        return tx.init(part.select(params))

    def update(updates, state, params=None, **extra_args):
        return tx.update(updates, state, part.select(params), **extra_args)

    return optax.GradientTransformationExtraArgs(init, update)
