"""Logical-axis rule tables: which mesh axes each logical dimension name is split over.

Models name every parameter and activation dimension logically (`embed`, `heads`, `mlp`,
`batch`, `length`, ...). A RuleSet maps those names to mesh axes, separately for
parameters, activations and optimizer state, so data parallel, FSDP/ZeRO, tensor parallel
and sequence parallel are different tables over the same model code.

Resolution of one tensor walks its dimensions in order; each takes the mesh axes its rule
names, skipping axes an earlier dimension of the same tensor already took and axes of size 1.
A dimension that the product of its axes does not divide keeps the longest prefix that does
(e.g. an odd vocabulary stays replicated); model configs validate the dimensions where
silent replication would be wrong (heads over tensor) before anything is built.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Mapping, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

Table = Mapping[str, tuple[str, ...]]
DATA_PARALLEL_AXES = ("data", "expert")  # expert acts as data parallel for dense parts


@dataclasses.dataclass(frozen=True)
class RuleSet:
    name: str
    params: Table
    activations: Table
    optimizer: Table | None = None  # None: optimizer state follows params
    # Where the optimizer state lives between steps: "device", or "pinned_host" (overlay
    # `+opt_host`): the step brings it to the device for the update and writes it back.
    optimizer_memory: str = "device"

    @property
    def optimizer_table(self) -> Table:
        return self.optimizer if self.optimizer is not None else self.params


def spec_for(names: Sequence[str | None], shape: Sequence[int], table: Table, mesh) -> PartitionSpec:
    if len(names) != len(shape):
        raise ValueError(f"logical axes {tuple(names)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    entries = []
    for name, dim in zip(names, shape):
        axes = [a for a in table.get(name, ()) if a not in used and mesh.shape[a] > 1] if name else []
        while axes and dim % math.prod(mesh.shape[a] for a in axes):
            axes.pop()
        used.update(axes)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*entries)


# ---- the tables ---------------------------------------------------------------------------

_ACTIVATIONS: Table = {
    "stages": ("pipeline",),  # pipeline stages (meshes/pipeline.py)
    "batch": DATA_PARALLEL_AXES,
    "length": ("context",),
    "residual_length": ("context",),  # the residual stream between blocks
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "ssm_heads": ("tensor",),  # Mamba-2 heads split like attention heads,
    "ssm_groups": ("tensor",),  # and their B/C groups with them
}
_TENSOR_PARALLEL_PARAMS: Table = {
    "stages": ("pipeline",),  # each stage's layers live on its pipeline group only
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "ssm_heads": ("tensor",),
    "ssm_groups": ("tensor",),
    "experts": ("expert",),  # expert parallel over the expert axis
}
# FSDP / ZeRO-3: the embed dimension of every weight is also split over the data-parallel axes.
# Expert weights' embed dimension takes `tensor` as well: the axes an expert is not split over
# (EP, ETP) are its expert-data-parallel axes, so it is kept 1/(EP x EDP) per device and
# gathered for compute like any FSDP weight.
_FSDP_PARAMS: Table = {**_TENSOR_PARALLEL_PARAMS, "embed": DATA_PARALLEL_AXES + ("context",),
                       "expert_embed": DATA_PARALLEL_AXES + ("context", "tensor")}
# Sequence parallel: between blocks the residual stream is split over tensor as well, turning
# the tensor-parallel all-reduces into reduce-scatter + all-gather pairs.
_SEQUENCE_PARALLEL_ACTIVATIONS: Table = {**_ACTIVATIONS, "residual_length": ("context", "tensor")}

RULE_SETS: dict[str, RuleSet] = {
    r.name: r for r in (
        RuleSet("dp", _TENSOR_PARALLEL_PARAMS, _ACTIVATIONS),
        RuleSet("zero1", _TENSOR_PARALLEL_PARAMS, _ACTIVATIONS, optimizer=_FSDP_PARAMS),
        RuleSet("fsdp", _FSDP_PARAMS, _ACTIVATIONS),
        RuleSet("dp_sp", _TENSOR_PARALLEL_PARAMS, _SEQUENCE_PARALLEL_ACTIVATIONS),
        RuleSet("fsdp_sp", _FSDP_PARAMS, _SEQUENCE_PARALLEL_ACTIVATIONS),
    )
}


# Overlays change one component's layout on top of a base table (`"fsdp+experts_folded"`): each
# maps the base's parameter table (and optimizer table) to the changed one.
def _fold_experts(table: Table) -> Table:
    # Experts folded over every axis the tokens are split over (e.g. EP 4 = data x context while
    # attention runs tensor x context x data); the remaining axes act as expert data parallel.
    return {**table, "experts": ("data", "context", "expert")}


def _expert_tensor_parallel(table: Table) -> Table:
    # Each expert's hidden dimension split over tensor; FSDP then no longer splits the expert's
    # embed dimension over tensor (the hidden dimension holds it).
    return {**table, "expert_mlp": ("tensor",),
            "expert_embed": tuple(a for a in table.get("expert_embed", ()) if a != "tensor")}


OVERLAYS = {"experts_folded": _fold_experts, "expert_tp": _expert_tensor_parallel}
# Overlays of the whole rule set rather than of a table.
SET_OVERLAYS = {"opt_host": lambda rules: dataclasses.replace(rules, optimizer_memory="pinned_host")}


def get_rule_set(name: str) -> RuleSet:
    base, *overlays = name.split("+")
    if base not in RULE_SETS:
        raise ValueError(f"unknown rule table {base!r}; choose one of {sorted(RULE_SETS)}")
    rules = RULE_SETS[base]
    for overlay in overlays:
        if overlay in SET_OVERLAYS:
            rules = SET_OVERLAYS[overlay](rules)
            continue
        if overlay not in OVERLAYS:
            raise ValueError(f"unknown rule overlay {overlay!r} in {name!r}; choose from "
                             f"{sorted(OVERLAYS) + sorted(SET_OVERLAYS)}")
        change = OVERLAYS[overlay]
        optimizer = None if rules.optimizer is None else change(rules.optimizer)
        rules = dataclasses.replace(rules, params=change(rules.params), optimizer=optimizer)
    return dataclasses.replace(rules, name=name)


# ---- the active (mesh, rules) while a model is traced -------------------------------------

_ACTIVE: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("jaxtrain_rules", default=None)


@contextlib.contextmanager
def use_rules(mesh, rules: RuleSet):
    """Activation constraints inside this block resolve against `mesh` and `rules`.

    Jitted functions must be traced inside it; build one jitted function per (mesh, rules).
    """
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_mesh():
    active = _ACTIVE.get()
    return active[0] if active else None


def active_rules() -> RuleSet | None:
    active = _ACTIVE.get()
    return active[1] if active else None


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Sharding constraint on an activation by logical names; a no-op outside `use_rules`."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    spec = spec_for(names, x.shape, rules.activations, mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def constrain_param(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Sharding constraint on a weight by logical names (the parameter table), e.g. on one layer
    sliced out of a stack at run time; a no-op outside `use_rules`."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec_for(names, x.shape, rules.params, mesh)))


def named_sharding(mesh, names: Sequence[str | None], shape: Sequence[int], table: Table) -> NamedSharding:
    return NamedSharding(mesh, spec_for(names, shape, table, mesh))
