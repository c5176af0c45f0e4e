"""Pipeline schedules: at each tick, which microbatch and which repeat each stage works on.

All stages advance in lockstep (one SPMD program): at every tick each stage applies one chunk
of layers to one microbatch, then hands the result to the next stage. A stage's k-th work item
is processed at tick `stage + k`; a schedule says what item k is. Ticks where a stage has no
item are the bubble: (stages - 1) of the T ticks, for every stage alike.

- GPipe: the model is cut into `stages` chunks; item k is microbatch k. T = M + S - 1.
- Interleaved (circular): the model is cut into `stages × virtual_stages` chunks, stage s
  holding chunks s, s + S, s + 2S, ... Item k is microbatch k mod M on its (k // M)-th pass
  through the stages: the last stage's output loops back to stage 0 for the next pass. Ticks
  are 1/V as long, so the bubble shrinks by V: T = M·V + S - 1. A microbatch leaving the last
  stage is needed again by stage 0 M - S ticks later, so M >= S.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GPipe:
    """All forward passes through the stages, then (by autodiff) all backward passes."""

    @property
    def virtual_stages(self) -> int:
        return 1

    def validate(self, stages: int, microbatches: int) -> None:
        if microbatches < stages:
            raise ValueError(f"pipeline schedule GPipe needs at least as many microbatches as stages: "
                             f"TrainConfig.microbatches={microbatches} < pipeline={stages}")

    def ticks(self, stages: int, microbatches: int) -> int:
        return microbatches + stages - 1

    def bubble_fraction(self, stages: int, microbatches: int) -> float:
        return (stages - 1) / self.ticks(stages, microbatches)

    def work(self, stage, tick, microbatches: int):
        """(microbatch, repeat, valid) of `stage` at `tick` (jnp scalars)."""
        import jax.numpy as jnp  # here, not at the top: a schedule is a plan value, read before jax starts
        k = tick - stage
        return jnp.clip(k, 0, microbatches - 1), jnp.zeros_like(k), (k >= 0) & (k < microbatches)


@dataclasses.dataclass(frozen=True)
class Interleaved:
    """Circular schedule over `virtual_stages` passes: each stage holds that many chunks."""
    virtual_stages: int = 2

    def validate(self, stages: int, microbatches: int) -> None:
        if self.virtual_stages < 2:
            raise ValueError(f"Interleaved.virtual_stages={self.virtual_stages} must be at least 2 "
                             f"(1 is GPipe)")
        if microbatches < stages:
            raise ValueError(f"the interleaved schedule needs at least as many microbatches as stages "
                             f"(an output loops back to stage 0 before it is needed): "
                             f"TrainConfig.microbatches={microbatches} < pipeline={stages}")

    def ticks(self, stages: int, microbatches: int) -> int:
        return microbatches * self.virtual_stages + stages - 1

    def bubble_fraction(self, stages: int, microbatches: int) -> float:
        return (stages - 1) / self.ticks(stages, microbatches)

    def work(self, stage, tick, microbatches: int):
        import jax.numpy as jnp
        k = jnp.maximum(tick - stage, 0)
        valid = (tick - stage >= 0) & (k < microbatches * self.virtual_stages)
        return k % microbatches, jnp.minimum(k // microbatches, self.virtual_stages - 1), valid


SCHEDULES = {"gpipe": GPipe, "interleaved": Interleaved}
