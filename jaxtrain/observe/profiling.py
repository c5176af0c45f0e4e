"""`ObserveConfig.profile_steps=(start, stop)`: a jax.profiler trace of steps start..stop (inclusive)
in `<workdir>/profile/process_<i>/`, on every process. Open it with TensorBoard's profile plugin
(`tensorboard --logdir <workdir>/profile`) or load the `perfetto_trace.json.gz` it holds at
ui.perfetto.dev."""
from __future__ import annotations

import os

import jax


class StepProfiler:
    def __init__(self, workdir: str, steps: tuple[int, int] | None):
        self.steps = tuple(steps) if steps else None
        self.directory = os.path.join(workdir, "profile", f"process_{jax.process_index()}")
        self.active = False

    def before_step(self, step: int) -> None:
        """Called before dispatching `step` (1-based)."""
        if self.steps and step == self.steps[0] and not self.active:
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
            self.active = True

    def after_step(self, step: int, outputs) -> None:
        """Called after dispatching `step`; the trace ends once that step has run on device."""
        if self.active and step >= self.steps[1]:
            jax.block_until_ready(outputs)
            self.close()

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
