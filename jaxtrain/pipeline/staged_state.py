"""The train state of a pipelined run: layer stacks regrouped into pipeline stages
(jaxtrain/pipeline/layout.py), each stage's layers and optimizer state only on its pipeline
group. Same interface as training/state_layouts.CanonicalState.

Checkpoints stay canonical: `to_disk` builds the canonical tree for a save one layer at a time
in host memory (streamed_save.py), `from_disk` regroups after a restore, jitted into the stage
shardings. On disk (and briefly after a restore) stacks are laid out canonically with their
`layers` dimension split over `pipeline` where it divides.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain.checkpoints.checkpointer import STATE_ITEMS
from jaxtrain.pipeline.layout import PipelineLayout
from jaxtrain.pipeline.streamed_save import StreamedCanonical
from jaxtrain.train_state import (TrainState, abstract_model, count_params, in_memory, init_state,
                                  optimizer_shardings, param_shardings, shardings_by_path, with_shardings)
from jaxtrain.meshes.pipeline_split import StagePlan
from jaxtrain.meshes.rules import RuleSet, RuleTable, table_name


class StagedState:
    def __init__(self, model_cfg, tx, mesh, rules: RuleSet, plan: StagePlan):
        self.model_cfg, self.tx = model_cfg, tx
        self.graphdef, canonical = abstract_model(model_cfg)
        self.layout = PipelineLayout(plan, canonical)
        replicated = NamedSharding(mesh, PartitionSpec())
        step = jax.ShapeDtypeStruct((), jnp.int32)

        params = jax.eval_shape(self.layout.to_stages, nnx.to_pure_dict(canonical))
        opt_state = jax.eval_shape(tx.init, params)
        names, shapes = self.layout.stage_names, self.layout.stage_shapes
        self.shardings = TrainState(step=replicated,
                                    params=shardings_by_path(params, names, shapes, mesh, rules.params),
                                    opt_state=in_memory(shardings_by_path(opt_state, names, shapes, mesh,
                                                                          rules.optimizer_table), rules.optimizer_memory))
        self.abstract = with_shardings(TrainState(step=step, params=params, opt_state=opt_state), self.shardings)

        on_pipeline = lambda table: RuleTable({**table, "layers": ("pipeline",)},
                                              f"{table_name(table) or 'rules'}, canonical stacks' layers over pipeline")
        disk_params = nnx.to_pure_dict(canonical)
        disk_opt = jax.eval_shape(tx.init, disk_params)
        self.disk_shardings = {"step": replicated,
                               "params": param_shardings(canonical, mesh, on_pipeline(rules.params)),
                               "opt_state": optimizer_shardings(disk_opt, canonical, mesh,
                                                                on_pipeline(rules.optimizer_table))}
        self.disk_abstract = with_shardings({"step": step, "params": disk_params, "opt_state": disk_opt},
                                            self.disk_shardings)
        self.num_params = count_params(disk_params)
        self._regroupers = {}
        self._streamed = StreamedCanonical(self.layout, self.disk_shardings, mesh)

    def init(self, seed: int) -> TrainState:
        return init_state(self.model_cfg, self.tx, self.shardings, seed, regroup=self.layout.to_stages)

    def from_disk(self, state: dict) -> dict:
        """Restored canonical items (params, maybe opt_state) -> stage layout; other keys as they are."""
        return self._regroup(state, "to_stages")

    def to_disk(self, state: dict) -> dict:
        """The canonical items for a save, built one layer at a time into host memory (never a
        second copy of the state on the device: jaxtrain/pipeline/streamed_save.py)."""
        items = {k: state[k] for k in STATE_ITEMS if k in state}
        return self._streamed(items)

    def _regroup(self, state, direction: str):
        items = tuple(k for k in STATE_ITEMS if k in state)
        if (direction, items) not in self._regroupers:  # one jitted regroup per shape of state, not per save
            fn, shardings = ((self.layout.to_stages, self.shardings.checkpoint_items()) if direction == "to_stages"
                             else (self.layout.to_canonical, self.disk_shardings))
            self._regroupers[direction, items] = jax.jit(fn, out_shardings={k: shardings[k] for k in items})
        return {**state, **self._regroupers[direction, items]({k: state[k] for k in items})}
