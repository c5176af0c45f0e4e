"""The train state (`step`, `params`, `opt_state`) and its shardings, built from logical names.

Parameters are a plain nested dict (the model's `nnx.State` as a pure dict) with layers
stacked on a leading axis: that tree, not any mesh layout, is what checkpoints hold.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from meshes.rules import RuleSet, Table, named_sharding
from models.layers.params import logical_axes

TrainState = dict  # {"step": int32[], "params": {...}, "opt_state": optax state}


def abstract_model(model_cfg):
    """(graphdef, abstract nnx.State) without allocating anything."""
    model = nnx.eval_shape(lambda: model_cfg.build(nnx.Rngs(0)))
    return nnx.split(model)


def _names_tree(abstract_state: nnx.State) -> dict:
    return {path: logical_axes(var) for path, var in nnx.to_flat_state(abstract_state)}


def param_shardings(abstract_state: nnx.State, mesh, table: Table) -> dict:
    pure = abstract_state.to_pure_dict()
    names = _names_tree(abstract_state)
    return _map_with_path(lambda path, x: named_sharding(mesh, names[path], x.shape, table), pure)


def _map_with_path(fn, tree):
    return jax.tree_util.tree_map_with_path(lambda p, x: fn(_path_key(p), x), tree)


def _path_key(path) -> tuple:
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(getattr(k, attr))
                break
    return tuple(out)


def optimizer_shardings(abstract_opt_state, abstract_state: nnx.State, mesh, table: Table):
    """Optimizer leaves that mirror a parameter (Adam moments) follow that parameter's logical
    names under the optimizer table; everything else (counts) is replicated."""
    names = _names_tree(abstract_state)
    shapes = {path: var.shape for path, var in nnx.to_flat_state(abstract_state)}
    replicated = NamedSharding(mesh, PartitionSpec())

    def for_leaf(path, leaf):
        for start in range(len(path)):
            suffix = path[start:]
            if suffix in names and shapes[suffix] == leaf.shape:
                return named_sharding(mesh, names[suffix], leaf.shape, table)
        return replicated

    return _map_with_path(for_leaf, abstract_opt_state)


def state_shardings(model_cfg, tx, mesh, rules: RuleSet):
    """(graphdef, abstract TrainState with shardings attached, TrainState shardings)."""
    graphdef, abstract_state = abstract_model(model_cfg)
    params_abstract = abstract_state.to_pure_dict()
    opt_abstract = jax.eval_shape(tx.init, params_abstract)
    shardings = {
        "step": NamedSharding(mesh, PartitionSpec()),
        "params": param_shardings(abstract_state, mesh, rules.params),
        "opt_state": optimizer_shardings(opt_abstract, abstract_state, mesh, rules.optimizer_table),
    }
    abstract = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params_abstract, "opt_state": opt_abstract}
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    return graphdef, abstract, shardings


def init_state(model_cfg, tx, shardings, seed: int) -> TrainState:
    """Parameters and optimizer state born sharded: the init runs under jit with out_shardings,
    so no device ever holds the whole model. Values do not depend on the layout."""

    def init(key):
        params = nnx.state(model_cfg.build(nnx.Rngs(params=key))).to_pure_dict()
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}

    return jax.jit(init, out_shardings=shardings)(jax.random.key(seed))


def count_params(params) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))
