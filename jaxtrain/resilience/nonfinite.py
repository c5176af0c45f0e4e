"""What the loop does when a step's loss, gradient norm or updated parameters are not finite.

The step itself never applies such an update (jaxtrain/training/step.py keeps the previous params and
optimizer state on device and reports `nonfinite`), so the state in memory, and every
checkpoint written from it, stays finite whatever the policy. The host learns of it one step
late, with the metrics, and asks the policy (`ResilienceConfig.nonfinite`):

  Halt()                  stop: save nothing, exit 3 naming the step and the first parameter
                          whose gradient is not finite (the default)
  Skip(max_consecutive)   drop the batch, log it, go on; halt after `max_consecutive` in a row
  Rollback(max_rollbacks) restore the newest checkpoint, skip the offending batches from there
                          (recorded in later checkpoints, so a resume skips them too); halt
                          after `max_rollbacks` rollbacks that got no further than before
"""
from __future__ import annotations

import dataclasses

import gin

HALT, SKIP, ROLLBACK = "halt", "skip", "rollback"


@dataclasses.dataclass(frozen=True)
class Halt:
    def decide(self, consecutive: int, rollbacks: int) -> str:
        return HALT


@dataclasses.dataclass(frozen=True)
class Skip:
    max_consecutive: int = 10

    def decide(self, consecutive: int, rollbacks: int) -> str:
        return SKIP if consecutive <= self.max_consecutive else HALT


@dataclasses.dataclass(frozen=True)
class Rollback:
    max_rollbacks: int = 3

    def decide(self, consecutive: int, rollbacks: int) -> str:
        return ROLLBACK if rollbacks < self.max_rollbacks else HALT


for _policy in (Halt, Skip, Rollback):  # named in gin files: `...nonfinite = @Skip()`
    gin.external_configurable(_policy, module="jaxtrain")


class NonFiniteTracker:
    """Counts consecutive non-finite steps, and rollbacks since the run last got further than
    ever before (replaying the steps up to a rollback's cause proves nothing); names the halt."""

    def __init__(self, policy):
        self.policy, self.consecutive, self.rollbacks, self.frontier = policy, 0, 0, -1

    def finite(self, step: int) -> None:
        self.consecutive = 0
        if step > self.frontier:
            self.frontier, self.rollbacks = step, 0

    def nonfinite(self) -> str:
        self.consecutive += 1
        action = self.policy.decide(self.consecutive, self.rollbacks)
        if action == ROLLBACK:
            self.rollbacks += 1
        return action

    def halt_reason(self) -> str:
        if isinstance(self.policy, Skip):
            return f"{self.consecutive} non-finite steps in a row (Skip.max_consecutive={self.policy.max_consecutive})"
        if isinstance(self.policy, Rollback):
            return (f"still non-finite after {self.rollbacks} rollbacks "
                    f"(Rollback.max_rollbacks={self.policy.max_rollbacks})")
        return "ResilienceConfig.nonfinite=@Halt()"
