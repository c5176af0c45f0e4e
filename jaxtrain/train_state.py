"""The train state (`step`, `params`, `opt_state`) and its shardings, built from logical names.

Parameters are a plain nested dict (the model's `nnx.State` as a pure dict) with layers
stacked on a leading axis: that tree, not any mesh layout, is what checkpoints hold. In memory
the state is a typed `TrainState`; on disk it is the dict of its items ({"step", "params",
"opt_state"}: the keys every checkpoint, old or new, is written under).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain.meshes.rules import RuleSet, ShardingRuleError, Table, named_sharding, table_name
from jaxtrain.meshes.tree_paths import path_keys
from jaxtrain.models.layers.params import logical_axes, optimizer_role



@struct.dataclass
class TrainState:
    """What one optimizer step reads and writes: `step` (int32 scalar), `params` (the model's
    pure-dict state, in this run's in-memory layout) and `opt_state` (the optax state). A pytree:
    the same class holds arrays, ShapeDtypeStructs or shardings."""
    step: Any
    params: Any
    opt_state: Any

    def checkpoint_items(self) -> dict:
        """The state as the tree a checkpoint holds: {"step", "params", "opt_state"}."""
        return {"step": self.step, "params": self.params, "opt_state": self.opt_state}

    @classmethod
    def from_items(cls, items: dict) -> "TrainState":
        """The inverse of checkpoint_items (every item present)."""
        missing = {"step", "params", "opt_state"} - set(items)
        if missing:
            raise ValueError(f"a TrainState needs the items {sorted(missing)} as well")
        return cls(step=items["step"], params=items["params"], opt_state=items["opt_state"])


def abstract_model(model_cfg):
    """(graphdef, abstract nnx.State) without allocating anything."""
    model = nnx.eval_shape(lambda: model_cfg.build(nnx.Rngs(0)))
    return nnx.split(model)


def optimizer_roles(model_cfg) -> dict:
    """{parameter path: optimizer role} as each parameter declared it (models/layers/params.py)."""
    _, abstract_state = abstract_model(model_cfg)
    return {path: optimizer_role(var) for path, var in nnx.to_flat_state(abstract_state)}


def _names_tree(abstract_state: nnx.State) -> dict:
    return {path: logical_axes(var) for path, var in nnx.to_flat_state(abstract_state)}


def _shapes_tree(abstract_state: nnx.State) -> dict:
    return {path: tuple(var.shape) for path, var in nnx.to_flat_state(abstract_state)}


def param_shardings(abstract_state: nnx.State, mesh, table: Table) -> dict:
    return shardings_by_path(nnx.to_pure_dict(abstract_state), _names_tree(abstract_state), _shapes_tree(abstract_state),
                             mesh, table)


def map_with_path(fn, tree):
    """tree_map with each leaf's path as a tuple of plain keys (dict keys, attribute names, indices)."""
    return jax.tree_util.tree_map_with_path(lambda p, x: fn(path_keys(p), x), tree)


def optimizer_shardings(abstract_opt_state, abstract_state: nnx.State, mesh, table: Table):
    """Optimizer leaves that mirror a parameter (Adam moments) follow that parameter's logical
    names under the optimizer table; everything else (counts) is replicated."""
    return shardings_by_path(abstract_opt_state, _names_tree(abstract_state), _shapes_tree(abstract_state), mesh, table)


def map_param_leaves(fn, tree, shapes: dict, other=lambda leaf: leaf):
    """fn(param_path, leaf) for each leaf whose path ends with a parameter's path (a `shapes`
    key) and has that parameter's shape — parameters themselves, or their mirrors in an optax
    state (Adam moments); other(leaf) for the rest (counts)."""
    def for_leaf(path, leaf):
        for start in range(len(path)):
            suffix = path[start:]
            if suffix in shapes and shapes[suffix] == tuple(leaf.shape):
                return fn(suffix, leaf)
        return other(leaf)

    return map_with_path(for_leaf, tree)


def shardings_by_path(tree, names: dict, shapes: dict, mesh, table: Table):
    """Parameter leaves and their mirrors (map_param_leaves) are laid out by the parameter's
    logical names; every other leaf is replicated. A parameter the rules cannot lay out (an
    unknown logical name, a dimension its mesh axes do not divide) is one ShardingRuleError
    naming every such parameter's path, shape and logical names, and the rule table."""
    replicated = NamedSharding(mesh, PartitionSpec())
    failures = {}  # parameter path -> reason (mirrors of one parameter fail alike: named once)

    def shard(path, leaf):
        try:
            return named_sharding(mesh, names[path], leaf.shape, table)
        except ShardingRuleError as e:
            failures.setdefault(path, (tuple(leaf.shape), e.reason))
            return replicated

    out = map_param_leaves(shard, tree, shapes, other=lambda leaf: replicated)
    if failures:
        by_reason = {}  # one cause (e.g. heads=6 over tensor=4) usually fails several parameters
        for path, (shape, reason) in failures.items():
            by_reason.setdefault(reason, []).append((path, shape))
        causes = []
        for reason, params in by_reason.items():
            (path, shape), others = params[0], len(params) - 1
            more = f" (and {others} more parameter{'s' if others > 1 else ''})" if others else ""
            causes.append(f"{reason}: parameter {'/'.join(map(str, path))} of shape {shape} named "
                          f"{names[path]}{more}")
        where = f" under rule table {table_name(table)!r}" if table_name(table) else ""
        mesh_text = " x ".join(f"{a}={n}" for a, n in mesh.shape.items() if n > 1) or "one device"
        raise ShardingRuleError(f"parameters do not fit the mesh {mesh_text}{where}: " + "; ".join(causes))
    return out


def in_memory(shardings, memory_kind: str):
    """The same layouts in another memory ("device", "pinned_host")."""
    if memory_kind == "device":
        return shardings
    return jax.tree.map(lambda s: s.with_memory_kind(memory_kind), shardings)


def with_shardings(abstract, shardings):
    """ShapeDtypeStructs carrying their shardings (what Orbax restores into)."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def state_shardings(model_cfg, tx, mesh, rules: RuleSet):
    """(graphdef, abstract TrainState with shardings attached, TrainState shardings)."""
    graphdef, abstract_state = abstract_model(model_cfg)
    params_abstract = nnx.to_pure_dict(abstract_state)
    opt_abstract = jax.eval_shape(tx.init, params_abstract)
    shardings = TrainState(
        step=NamedSharding(mesh, PartitionSpec()),
        params=param_shardings(abstract_state, mesh, rules.params),
        opt_state=in_memory(optimizer_shardings(opt_abstract, abstract_state, mesh, rules.optimizer_table),
                            rules.optimizer_memory),
    )
    abstract = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params_abstract, opt_state=opt_abstract)
    return graphdef, with_shardings(abstract, shardings), shardings


def init_state(model_cfg, tx, shardings, seed: int, regroup=None) -> TrainState:
    """Parameters and optimizer state born sharded: the init runs under jit with out_shardings,
    so no device ever holds the whole model. Values do not depend on the layout. `regroup`
    turns the canonical parameters into the in-memory layout (pipeline stages) first."""

    def init(key):
        params = nnx.to_pure_dict(nnx.state(model_cfg.build(nnx.Rngs(params=key))))
        params = regroup(params) if regroup is not None else params
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

    return jax.jit(init, out_shardings=shardings)(jax.random.key(seed))


def count_params(params) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))
