"""The step loop of one run: batches in, metrics out one step late, checkpoints, and what happens
when a step is not finite, a signal arrives, a save fails or a peer goes away.

Metrics of step n are fetched while step n+1 runs, so the host never stalls the device queue;
the price is that the host learns of a non-finite step one step late. That is safe because the
step never applies a non-finite update (jaxtrain/training/step.py): step n+1 ran on good state. At a
checkpoint step the loop settles the step's metrics first, so a save always knows its state is
finite (a sync the save needs anyway).
"""
from __future__ import annotations

import time

import jax

from jaxtrain.checkpoints.checkpointer import CheckpointSaveError
from jaxtrain.data.store.loader import source_token_counts
from jaxtrain.observe.flops import model_flops_utilization
from jaxtrain.observe.metrics import MetricsWriter, device_memory
from jaxtrain.observe.profiling import StepProfiler
from jaxtrain.resilience import exit_codes
from jaxtrain.resilience.exit_codes import RunStopped
from jaxtrain.resilience.nonfinite import HALT, ROLLBACK, NonFiniteTracker
from jaxtrain.resilience.preemption import StopSignals
from jaxtrain.resilience.watchdog import Watchdog
from jaxtrain.training.state import TrainState
from jaxtrain.training.train_loop_parts import LoopParts
from jaxtrain.meshes.mesh import describe


class _RolledBack(Exception):
    """Raised inside the loop to restart it from the restored checkpoint."""


class TrainLoop:
    def __init__(self, parts: LoopParts, checkpointer, peers, state: TrainState, resume: dict,
                 stop_after: int | None, *, watchdog: Watchdog | None = None, signals: StopSignals | None = None):
        """`watchdog` (started, already timing the run's restore) and `signals` (installed before
        start-up by the CLI) are the Trainer's; the loop makes its own when not given."""
        self.parts, self.setup, self.checkpointer, self.peers = parts, parts.setup, checkpointer, peers
        self.watchdog, self.signals = watchdog, signals
        t = parts.train
        self.t, self.observe, self.state = t, parts.observe, state
        self.step = int(jax.device_get(state.step))
        self.end = min(t.steps, stop_after) if stop_after else t.steps
        self.position = resume["data_position"]  # batches drawn from the data iterator so far
        self.skipped = set(resume["skipped_batches"])  # batch positions never to train on
        self.saved_step = resume.get("step")  # the newest step on disk, if any
        self.tracker = NonFiniteTracker(parts.resilience.nonfinite)
        self.is_main = jax.process_index() == 0
        # opened at the first row, keeping the rows up to the step resumed from: a stop before the
        # first step writes nothing
        self._writer, self.resumed_at = None, self.step
        self._sampler = None  # built at the first sample (ObserveConfig.sample_every)
        self.history, self.stopped_by = [], None
        self.tokens_per_step = t.global_batch * t.seq_len
        self._source_tokens = {}  # batch position -> this process's trained tokens per blend source
        self._t0 = time.perf_counter()

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> list[dict]:
        setup = self.setup
        if self.is_main:
            print(f"jaxtrain: {setup.state.num_params / 1e6:.2f}M params{trained_note(setup)}, mesh "
                  f"{describe(setup.mesh)}, rules {setup.rules.name}, steps {self.step}->{self.end}", flush=True)
            if setup.summary:
                print(f"jaxtrain: {setup.summary}", flush=True)
            if self.parts.evaluate is None:
                print("jaxtrain: no evaluation (DataConfig.eval_files is empty)", flush=True)
            blend = self.parts.blend
            if blend:  # what the metrics' source_tokens_<j> count
                sources = enumerate(zip(blend[0::2], blend[1::2]))
                print("jaxtrain: blend " + ", ".join(f"source_tokens_{j} = {path} (weight {weight})"
                                                     for j, (weight, path) in sources), flush=True)
        # last_step: a request made while a process passes the run's last step is answered there
        own_signals = self.signals is None
        signals = StopSignals(self.peers).install() if own_signals else self.signals.attach(self.peers)
        signals.last_step = self.end
        self.profiler = StepProfiler(self.parts.workdir, self.observe.profile_steps)
        if self.watchdog is None:
            self.watchdog = Watchdog.for_run(self.parts.resilience, self.peers).start()
        try:
            while True:
                try:
                    self._steps(signals)
                    break
                except _RolledBack:
                    continue
            signals.steps_began()  # (a run resumed at its end has no step to begin)
            self._finish()
        except CheckpointSaveError as e:
            message = f"process {jax.process_index()}: {e}"
            self.peers.report_failure(message)
            if self._writer is not None:
                self._writer.close(failed=True)
            raise RunStopped(message, exit_codes.CHECKPOINT) from None
        except BaseException:  # halted (non-finite), or an unexpected error: keep what was saved
            try:
                self._close(failed=True)
            except RunStopped:
                pass
            raise
        finally:
            self.profiler.close()
            self.watchdog.stop()
            if own_signals:
                signals.restore()
        self._close()
        return self.history

    def _steps(self, signals) -> None:
        pending = None  # (step, metrics on device, batch position) of the step in flight
        while self.step < self.end:
            self.watchdog.step_started(self.step + 1)
            position, batch = self._next_batch()
            self.profiler.before_step(self.step + 1)
            new_state, metrics = self.setup.train_step(self.state, batch)
            signals.steps_began()  # compiled and dispatched: a signal now stops after a step, saved
            self.profiler.after_step(self.step + 1, (new_state, metrics))
            if pending is not None:
                self._settle(*pending)  # the previous step's metrics, while this one runs
            self.state, self.step = new_state, self.step + 1
            pending = (self.step, metrics, position)
            self.checkpointer.check()
            stop = signals.should_stop(self.step)
            checkpoint_due = _every(self.parts.checkpoint.checkpoint_every, self.step) and self.step != self.end
            if checkpoint_due or stop:  # a save must know its step was finite
                self._settle(*pending)
                pending = None
            if _every(self.observe.eval_every, self.step) and self.step != self.end:
                self._evaluate("the eval")
            if _every(self.observe.sample_every, self.step):
                self._sample()
            if checkpoint_due or stop:
                self._save(wait=stop)
            if stop:
                self.stopped_by = signals.requested or "a peer's signal"
                if self.is_main:
                    print(f"jaxtrain: stopped by {self.stopped_by} after step {self.step}; checkpoint saved",
                          flush=True)
                self.end = self.step
                return
        if pending is not None:
            self._settle(*pending)

    def _sample(self) -> None:
        """Greedy samples of ObserveConfig.sample_prompts from the current parameters (every process
        runs the generation; process 0 writes)."""
        if self._sampler is None:
            self._sampler = self.parts.make_sampler()
        with self.watchdog.phase("eval", f"the samples at step {self.step}"):
            self.writer.write_samples(self.step, self._sampler(self.state.params))

    def _finish(self) -> None:
        if self.saved_step != self.step and self.step > 0:
            self._save(wait=True)
        if self.stopped_by is None and self.step == self.t.steps:
            self._evaluate("the final eval")

    def _evaluate(self, what: str) -> None:
        """The eval data's loss (kind "eval") and the lm-eval task scores (kind "tasks"), each when
        the run has them."""
        if self.parts.evaluate is not None:
            with self.watchdog.phase("eval", f"{what} at step {self.step}"):
                self.writer.write(self.step, self.parts.evaluate(self.state.params), kind="eval")
        if self.parts.evaluate_tasks is not None:
            with self.watchdog.phase("eval", f"{what}'s tasks at step {self.step}"):
                self.writer.write(self.step, self.parts.evaluate_tasks(self.state.params), kind="tasks")

    def _next_batch(self):
        """The next batch not in the skip list, as global arrays; and its position."""
        while True:
            local, position = next(self.parts.train_iter), self.position
            self.position += 1
            if position not in self.skipped:
                if "source_ids" in local:  # a blend: count each source's trained tokens (stripped by the batch)
                    self._source_tokens[position] = source_token_counts(local, len(self.parts.blend) // 2)
                return position, self.setup.batch_from_process_rows(local)

    # -- one step's outcome ------------------------------------------------------------------
    def _settle(self, step: int, metrics, position: int) -> None:
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        counts = self._source_tokens.pop(position, None)
        if counts is not None:
            values.update({f"source_tokens_{j}": n for j, n in
                           enumerate(_all_processes(counts, self.parts.data_shards))})
        self.watchdog.step_finished(step)
        now = time.perf_counter()
        elapsed, self._t0 = now - self._t0, now
        if not values.pop("nonfinite"):
            self.tracker.finite(step)
            values.pop("first_nonfinite_grad")
            self._log(step, values, elapsed)
            return
        action = self.tracker.nonfinite()
        what = self._describe_nonfinite(step, values, position)
        self.writer.write(step, {**values, "batch": position}, kind="nonfinite", echo=False)
        if action == HALT:
            raise RunStopped(f"{what}; {self.tracker.halt_reason()}: halting, nothing saved", exit_codes.NON_FINITE)
        self.skipped.add(position)
        if self.is_main:
            print(f"warning: {what}; {action}: batch {position} will not be trained on", flush=True)
        if action == ROLLBACK:
            self._rollback()  # raises _RolledBack; SKIP simply goes on

    def _describe_nonfinite(self, step: int, values: dict, position: int) -> str:
        index = int(values.get("first_nonfinite_grad", -1))
        paths = self.parts.leaf_paths
        grad = f", first non-finite gradient {paths[index]}" if 0 <= index < len(paths) else ""
        return (f"step {step} (batch {position}) is not finite: loss {values['loss']:.4g}, grad_norm "
                f"{values['grad_norm']:.4g}, param_norm {values['param_norm']:.4g}{grad}")

    def _rollback(self) -> None:
        """Back to the newest checkpoint (or the initial state) and its data position; the
        offending batches are in the skip list, so the replay trains past them."""
        with self.watchdog.phase("restore", "the rollback's restore"):
            self.checkpointer.wait()
            state, resume = self.parts.restore_or_init(self.checkpointer)
        self.state, self.step = state, int(jax.device_get(state.step))
        self.skipped |= set(resume["skipped_batches"])
        self.position = resume["data_position"]  # the iterator was restored (or reset) with the state
        self.writer.rewind(self.step)
        self.history = [h for h in self.history if h["step"] <= self.step]
        if self.is_main:
            print(f"jaxtrain: rolled back to step {self.step}", flush=True)
        raise _RolledBack()

    # -- saving ------------------------------------------------------------------------------
    def _save(self, wait: bool) -> None:
        with self.watchdog.phase("save", f"the save of step {self.step}"):
            # (every saved state is finite: the step never applies a non-finite update)
            extra = {"data_position": self.position, "skipped_batches": sorted(self.skipped)}
            self.checkpointer.save(self.step, self.setup.state.to_disk(self.state.checkpoint_items()),
                                   self.parts.train_iter, extra=extra)
            self.saved_step = self.step
            if wait:
                self.checkpointer.wait()

    def _close(self, failed: bool = False) -> None:
        try:
            self.checkpointer.close()
        except CheckpointSaveError as e:  # the last save failed
            message = f"process {jax.process_index()}: {e}"
            self.peers.report_failure(message)
            raise RunStopped(message, exit_codes.CHECKPOINT) from None
        finally:
            if self._writer is not None:
                self._writer.close(failed)

    @property
    def writer(self) -> MetricsWriter:
        if self._writer is None:
            self._writer = MetricsWriter(self.parts.workdir, self.t.steps, self.resumed_at, enabled=self.is_main,
                                         trackers=self.observe.trackers, config=self.parts.tracked_config,
                                         gin=self.parts.config_text)
        return self._writer

    def _log(self, step: int, values: dict, elapsed: float) -> None:
        """One metrics row per step; the time is measured between successive fetches, so the
        first step's row includes compilation."""
        tps = self.tokens_per_step / max(elapsed, 1e-9)
        values.update(step_time=elapsed, tokens_per_sec=tps, **device_memory(),
                      mfu=model_flops_utilization(self.parts.flops_per_token, tps, self.parts.peak_flops,
                                                  self.setup.mesh.size))
        self.writer.write(step, values, echo=step % self.observe.log_every == 0 or step == 1)
        self.history.append({"step": step, **values})


def _all_processes(counts, data_shards: int):
    """Per-source counts over the global batch: summed over processes, each row counted once
    (processes that differ only along axes the batch is replicated over read the same rows)."""
    if jax.process_count() == 1:
        return counts.tolist()
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(counts)
    return (gathered.sum(axis=0) * data_shards / jax.process_count()).tolist()


def _every(every: int, step: int) -> bool:
    """Step `step` ends an interval of `every` steps (0: never)."""
    return bool(every) and step % every == 0


def trained_note(setup) -> str:
    """", of which N trained" when part of the model is frozen (a LoRA run's base), else ""."""
    from jaxtrain.training.lora_run import trained_part
    from jaxtrain.training.state import count_params

    part = trained_part(setup)
    if part is None:
        return ""
    trained = count_params(part.select(setup.state.abstract.params))
    return f", of which {trained / 1e6:.4f}M trained ({100 * trained / setup.state.num_params:.2f}%)"
