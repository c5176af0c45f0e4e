"""TrainConfig fields that moved to LossConfig, CheckpointConfig, ResilienceConfig and ObserveConfig
(jaxtrain/training/run_configs.py). A saved config.gin or an older config binding one of them
(`TrainConfig.checkpoint_every = 5`, `TrainConfig.loss_chunk = 16`) still loads: the value goes to
its new home and one warning line names the new bindings."""
from __future__ import annotations

import dataclasses
import sys

from jaxtrain.training.run_configs import RUN_CONFIGS

NEW_FIELDS = {"max_replicated"}  # never was a TrainConfig field
MOVED = {f.name: (part, cls) for part, cls in RUN_CONFIGS.items() for f in dataclasses.fields(cls)
         if f.name not in NEW_FIELDS}


def split_moved(bindings: dict) -> tuple[dict, tuple]:
    """(TrainConfig's own bindings, ((name, value), ...) of moved ones)."""
    own = {k: v for k, v in bindings.items() if k not in MOVED}
    return own, tuple((k, v) for k, v in bindings.items() if k in MOVED)


def moved_line(moved: tuple) -> str:
    return "warning: " + "; ".join(f"TrainConfig.{name} is now {MOVED[name][1].__name__}.{name}" for name, _ in moved)


def apply_moved(exp, moved: tuple, *, warn: bool = True):
    """The Experiment with old-style TrainConfig bindings applied to the parts that now hold them."""
    if not moved:
        return exp
    if warn:
        print(moved_line(moved), file=sys.stderr, flush=True)
    by_part = {}
    for name, value in moved:
        by_part.setdefault(MOVED[name][0], {})[name] = value
    return dataclasses.replace(exp, **{part: dataclasses.replace(getattr(exp, part), **values)
                                       for part, values in by_part.items()})
