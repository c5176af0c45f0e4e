"""A LoRA run's start (models/lora.py, configs/lora.gin): the base model's parameters from a
checkpoint and fresh adapters, in the run's layout. Later steps restore through the checkpoint's
recorded base (jaxtrain/checkpoints/adapter_base.py)."""
from __future__ import annotations

import jax
from flax import nnx

from jaxtrain.checkpoints.adapter_base import BaseRecord, merge_trees, split_tree
from jaxtrain.checkpoints.fingerprint import leaf_path
from jaxtrain.training.trained_params import SomeParams


def trained_part(setup) -> SomeParams | None:
    """The trained part of a run whose base is frozen (its adapters), or None: all is trained."""
    part = getattr(setup.gradients, "trained", None)
    return part if isinstance(part, SomeParams) else None


def paths_of(tree) -> set[str]:
    return {leaf_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)}


def fresh_adapters(setup, part: SomeParams, seed: int) -> dict:
    """The adapters as a fresh run initializes them from `seed`, born sharded; the base's
    initialization is dead code the compiler drops (only the adapters are returned)."""
    model_cfg = setup.state.model_cfg

    def init(key):
        return part.select(nnx.to_pure_dict(nnx.state(model_cfg.build(nnx.Rngs(params=key)))))

    return jax.jit(init, out_shardings=part.select(setup.state.shardings.params))(jax.random.key(seed))


def with_fresh_adapters(setup, part: SomeParams, base_params: dict, seed: int) -> dict:
    """Whole parameters from a base's (no adapters) and fresh adapters."""
    return merge_trees(base_params, fresh_adapters(setup, part, seed))


def state_on_base(setup, base: BaseRecord, part: SomeParams, seed: int):
    """The run's step-0 state: `base`'s parameters (verified against its manifest), fresh
    adapters and optimizer state."""
    from jaxtrain.checkpoints.checkpointer import Checkpointer

    disk = setup.state.disk_abstract["params"]
    _, base_abstract = split_tree(disk, paths_of(part.select(disk)))
    checkpointer = Checkpointer(base.directory, keep=None, async_save=False)
    try:
        base_params = checkpointer.restore(base.step, {"params": base_abstract})["params"]
    finally:
        checkpointer.close()
    return setup.ready_to_step({"params": with_fresh_adapters(setup, part, base_params, seed)}, 0)
