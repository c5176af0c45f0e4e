"""What the step loop (jaxtrain/training/train_loop.py) works with, handed over explicitly by the
Trainer: the compiled setup, the run's settings by concern, the data, and the few callbacks that
need the Trainer's state (eval, restore, samples)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jaxtrain.training.config import TrainConfig
from jaxtrain.training.run_configs import CheckpointConfig, ObserveConfig, ResilienceConfig
from jaxtrain.training.train_setup import TrainSetup


@dataclasses.dataclass(frozen=True)
class LoopParts:
    setup: TrainSetup  # steps, mesh, rules, the state layout, batches from process rows
    train: TrainConfig
    checkpoint: CheckpointConfig
    resilience: ResilienceConfig
    observe: ObserveConfig
    workdir: str
    train_iter: Any  # this process's data iterator (checkpointed with the state)
    data_shards: int  # processes reading distinct rows (per-source token counts sum each once)
    blend: tuple  # DataConfig.blend: (weight, path, ...), () without one
    evaluate: Callable | None  # params -> eval metrics; None: no evaluation (DataConfig.eval_files empty)
    restore_or_init: Callable  # checkpointer -> (TrainState, resume info)
    leaf_paths: list  # parameter leaf paths, in tree order (names a non-finite gradient)
    flops_per_token: float
    peak_flops: float | None
    make_sampler: Callable  # () -> params -> samples (built at the first sample)
    evaluate_tasks: Callable | None = None  # params -> {"task/metric": score} (ObserveConfig.eval_tasks)
    # what ObserveConfig.trackers are told of the run: its config parts as plain values, its gin text
    tracked_config: dict = dataclasses.field(default_factory=dict)
    config_text: str | None = None
