"""How the train state is laid out in memory, and how it maps to the canonical on-disk tree.

One strategy per layout, same interface: `abstract` and `shardings` (TrainStates of the in-memory
layout), `disk_abstract` (the checkpoint tree: a dict of items), `init(seed) -> TrainState`, and
`from_disk` / `to_disk` between dicts of items ({"params"} alone, or all of them) in the two layouts:

- CanonicalState (here): in memory as on disk (no pipeline).
- StagedState (jaxtrain/pipeline/staged_state.py): layer stacks regrouped into pipeline stages.
"""
from __future__ import annotations

from jaxtrain.training.state import TrainState, count_params, init_state, state_shardings
from jaxtrain.meshes.rules import RuleSet


class CanonicalState:
    def __init__(self, model_cfg, tx, mesh, rules: RuleSet):
        self.model_cfg, self.tx = model_cfg, tx
        self.graphdef, self.abstract, self.shardings = state_shardings(model_cfg, tx, mesh, rules)
        self.disk_abstract = self.abstract.checkpoint_items()
        self.num_params = count_params(self.abstract.params)

    def init(self, seed: int) -> TrainState:
        return init_state(self.model_cfg, self.tx, self.shardings, seed)

    def from_disk(self, state: dict) -> dict:
        return state

    def to_disk(self, state: dict) -> dict:
        return state
