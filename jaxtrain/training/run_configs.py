"""The run's settings beside its shape (TrainConfig), one configurable per concern:

    LossConfig         what the loss adds and how it is chunked (models/loss.py)
    CheckpointConfig   when to save, how many steps to keep, and how to resume
    ResilienceConfig   peers, hangs and non-finite steps (jaxtrain/resilience/)
    ObserveConfig      logs and their trackers, evals, samples, MFU, profiles and the sharding audit at start

Each is bound from the Experiment (`Experiment.checkpoint = @CheckpointConfig()`), or left
unbound to take its gin bindings and defaults, like every other part.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import gin

from jaxtrain.observe.trackers import check_trackers
from jaxtrain.resilience.nonfinite import Halt
from jaxtrain.training.config_types import check_config_types


def _check_positive(config, names, strictly: bool = True) -> None:
    for name in names:
        value = getattr(config, name)
        if not (value > 0 if strictly else value >= 0):
            raise ValueError(f"{type(config).__name__}.{name} must be {'positive' if strictly else '>= 0'}, "
                             f"got {value}")


@gin.configurable(module="jaxtrain")
@dataclasses.dataclass(frozen=True)
class LossConfig:
    z_loss: float = 0.0  # weight of the log-partition² penalty added to the loss
    loss_chunk: int = 1024  # tokens of sequence per chunk in the chunked cross-entropy

    def validate(self) -> None:
        check_config_types(self)
        _check_positive(self, ("loss_chunk",))
        _check_positive(self, ("z_loss",), strictly=False)


@gin.configurable(module="jaxtrain")
@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    checkpoint_every: int = 100  # 0: only at the end
    keep_checkpoints: int = 3
    async_checkpoint: bool = True
    # Checkpoint items to start fresh on resume, on purpose ("opt_state", "data"); a step
    # lacking an item the run needs is otherwise an error.
    reset_on_resume: tuple[str, ...] = ()
    strict_restore: bool = False  # a corrupt newest checkpoint is an error, not a fallback
    # A step without a manifest (or fingerprints) cannot be verified: refused (exit 4) unless True,
    # then restored with a warning.
    allow_unverified_restore: bool = False

    def validate(self) -> None:
        check_config_types(self)
        _check_positive(self, ("keep_checkpoints",))
        _check_positive(self, ("checkpoint_every",), strictly=False)
        unknown = set(self.reset_on_resume) - {"opt_state", "data"}
        if unknown:
            raise ValueError(f"CheckpointConfig.reset_on_resume may hold 'opt_state' and 'data', got {sorted(unknown)}")


@gin.configurable(module="jaxtrain")
@dataclasses.dataclass(frozen=True)
class ResilienceConfig:
    # A missing or dead peer, or a failure reported by one, ends every process within
    # peer_timeout_s; a step slower than hang_factor x the median step (and than hang_min_s)
    # dumps every thread's stack and exits (jaxtrain/resilience/watchdog.py), as does each of the
    # first steps (compilation included) past hang_first_steps_s, and a restore, a save (with its
    # wait for the write) or an eval past its own bound.
    peer_timeout_s: float = 60.0
    hang_factor: float = 10.0
    hang_min_s: float = 120.0
    hang_first_steps_s: float = 3600.0
    hang_restore_s: float = 3600.0
    hang_save_s: float = 1800.0
    hang_eval_s: float = 1800.0
    # A step whose loss, gradient norm or new parameters are not finite is never applied; then
    # @Halt() (exit 3), @Skip() (drop the batch) or @Rollback() (newest checkpoint, skip the batch).
    nonfinite: Any = Halt()

    def validate(self) -> None:
        check_config_types(self)
        _check_positive(self, ("peer_timeout_s", "hang_factor", "hang_min_s", "hang_first_steps_s", "hang_restore_s",
                               "hang_save_s", "hang_eval_s"))
        if not hasattr(self.nonfinite, "decide"):
            raise ValueError(f"ResilienceConfig.nonfinite must be @Halt(), @Skip() or @Rollback(), "
                             f"got {self.nonfinite!r}")


@gin.configurable(module="jaxtrain")
@dataclasses.dataclass(frozen=True)
class ObserveConfig:
    log_every: int = 10
    eval_every: int = 100  # 0 disables periodic eval (a final eval still runs); DataConfig.eval_files=[]: no eval
    eval_batches: int = 4
    # Greedy samples of sample_prompts every sample_every steps (0: none), sample_tokens new tokens
    # each, to metrics.jsonl (kind "sample") and TensorBoard's text tab (jaxtrain/generate/).
    sample_every: int = 0
    sample_prompts: tuple[str, ...] = ()
    sample_tokens: int = 32
    # lm-eval task (or group) names scored at every eval step and at the end (jaxtrain/harness/),
    # logged as kind "tasks" ("task/metric" keys); tasks in eval_tasks_include_path are your own
    # YAMLs; eval_tasks_limit caps the documents per task (a fraction below 1).
    eval_tasks: tuple[str, ...] = ()
    eval_tasks_include_path: str | None = None
    eval_tasks_limit: float | None = None
    peak_flops_per_device: float | None = None  # overrides the device table for MFU
    # (start, stop): a jax.profiler trace of steps start..stop into <workdir>/profile (jaxtrain/observe/profiling.py)
    profile_steps: tuple[int, int] | None = None
    # The parameters' sharding audit is printed at start (meshes/sharding_audit.py); a run whose
    # replicated copies exceed this fraction of a device's parameter bytes stops there (exit 2).
    max_replicated: float | None = None
    # Where the metrics rows go besides metrics.jsonl, from process 0 with the run's config: any of
    # "tensorboard", "wandb", "mlflow" (jaxtrain/observe/trackers.py; wandb and mlflow are pip extras).
    trackers: tuple[str, ...] = ("tensorboard",)

    def validate(self) -> None:
        check_config_types(self)
        _check_positive(self, ("log_every", "eval_batches"))
        _check_positive(self, ("eval_every",), strictly=False)
        if self.sample_every < 0 or self.sample_tokens < 1:
            raise ValueError(f"ObserveConfig.sample_every must be >= 0 and sample_tokens >= 1, got "
                             f"{self.sample_every} and {self.sample_tokens}")
        if self.sample_every and not self.sample_prompts:
            raise ValueError("ObserveConfig.sample_every is set but sample_prompts is empty")
        if self.eval_tasks_limit is not None and not self.eval_tasks_limit > 0:
            raise ValueError(f"ObserveConfig.eval_tasks_limit must be > 0, got {self.eval_tasks_limit}")
        if self.profile_steps is not None and not 1 <= self.profile_steps[0] <= self.profile_steps[1]:
            raise ValueError(f"ObserveConfig.profile_steps must be (start, stop) with 1 <= start <= stop, "
                             f"got {self.profile_steps}")
        if self.max_replicated is not None and not 0 <= self.max_replicated <= 1:
            raise ValueError(f"ObserveConfig.max_replicated must be a fraction in [0, 1], got {self.max_replicated}")
        check_trackers(self.trackers)  # a name it does not know, or a tracker whose package is missing


RUN_CONFIGS = {"loss": LossConfig, "checkpoint": CheckpointConfig, "resilience": ResilienceConfig, "observe": ObserveConfig}
