"""The training loop: mesh, sharded state, data, jitted step, metrics, eval and checkpoints.

Everything that can be checked without compiling (mesh vs devices, model vs mesh, batch vs
data-parallel size, data files) is checked in the constructor, before the workdir is touched:
the run's parts come from the one assembly function (jaxtrain/training/train_setup.py).
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
from typing import Callable

import jax

from jaxtrain.checkpoints.adapter_base import BASE_KEY, AdapterCheckpoints, FullCheckpoints
from jaxtrain.checkpoints.checkpointer import (ALL_ITEMS, CheckpointError, Checkpointer, CorruptCheckpoint,
                                               IncompatibleCheckpoint)
from jaxtrain.checkpoints.compatibility import roles_changed_line
from jaxtrain.training.config import Experiment
from jaxtrain.training.config_types import check_config_types
from jaxtrain.data.packing import check_sources_fit, make_eval_batches, make_train_iterator
from jaxtrain.checkpoints.fingerprint import leaf_path
from jaxtrain.observe.flops import peak_flops
from jaxtrain.observe.trackers import config_values
from jaxtrain.resilience import exit_codes
from jaxtrain.resilience.exit_codes import RunStopped
from jaxtrain.resilience.peers import Peers
from jaxtrain.resilience.watchdog import Watchdog
from jaxtrain.data.tokenizer import load_tokenizer
from jaxtrain.training.train_loop_parts import LoopParts
from jaxtrain.training.train_setup import build_train_setup
from jaxtrain.training.state import TrainState, optimizer_roles
from jaxtrain.training.workdir import WorkdirLock, changed_fields, check_same_model
from jaxtrain.meshes.sharding_audit import ShardingAuditError, audit_sharding, check_sufficiently_sharded


def check_vocabulary(exp: Experiment) -> None:
    """Every id the tokenizer emits must have an embedding row: an id past the table embeds as
    NaN (Flax's out-of-range gather fill), and the run would train on NaN from step 1."""
    ids = load_tokenizer(exp.data.tokenizer).vocab_size
    if exp.model.vocab_size < ids:
        raise ValueError(f"{type(exp.model).__name__}.vocab_size={exp.model.vocab_size} is smaller than the "
                         f"{ids} token ids of DataConfig.tokenizer={exp.data.tokenizer!r}: bind "
                         f"{type(exp.model).__name__}.vocab_size >= {ids}")
    check_sources_fit(exp.data, exp.model.vocab_size)  # stores and Megatron files: the ids they hold


def _write_atomically(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _warn_about_set_aside_steps(directory: str) -> None:
    """A run starting from step 0 next to steps moved aside earlier says so: they may be good
    progress a later fix can resume from."""
    aside = directory + "_corrupt"
    if jax.process_index() == 0 and os.path.isdir(aside) and os.listdir(aside):
        print(f"warning: no checkpoint in {directory}, but {aside} holds {sorted(os.listdir(aside))} moved aside "
              f"earlier; starting from step 0", file=sys.stderr, flush=True)


class Trainer:
    def __init__(self, exp: Experiment, workdir: str, devices=None, config_text: str | None = None,
                 sampler: Callable[["Trainer"], Callable[[object], list[dict]]] | None = None,
                 task_evaluator: Callable[["Trainer"], Callable[[object], dict]] | None = None):
        """`config_text`: the gin config to keep as `<workdir>/config.gin` once the run has
        checked that the workdir's checkpoints fit it (the CLI passes gin.config_str()).
        `sampler`: builds, from this Trainer, the params -> samples callable ObserveConfig.sample_every
        needs (jaxtrain.generate.during_training.TrainingSampler, which the train CLI passes); built
        here, so a layout or prompt it cannot serve fails at start. Passed in, not imported, because
        generation builds on training.
        `task_evaluator`: likewise for ObserveConfig.eval_tasks: builds the params -> task scores
        callable (jaxtrain.harness.training.TrainingTaskEvaluator)."""
        for part in (exp.model, exp.mesh, exp.data, exp.optimizer):
            check_config_types(part)
        exp.validate()
        self.exp, self.workdir, self.config_text = exp, os.path.abspath(workdir), config_text
        self.stopped_by = None
        t = exp.train
        check_vocabulary(exp)  # the Trainer feeds corpus tokens (the bench feeds ids below the vocabulary)
        self.plan = exp.plan
        # (device groups: the plan's)
        setup = build_train_setup(exp.model, self.plan, t, exp.optimizer, devices, loss=exp.loss)
        self.setup, self.mesh, self.rules, self.tx = setup, setup.mesh, setup.rules, setup.tx
        self.sharding_audit = audit_params(setup, exp.observe.max_replicated)  # before anything is compiled
        # The rows of each global batch this process reads (the setup's batch strategy: its own
        # shard of the batch, or whole batches its device groups take their rows of).
        shard, shards = setup.process_rows(t.global_batch, t.seq_len)
        self.train_iter = make_train_iterator(exp.data, seq_len=t.seq_len, global_batch=t.global_batch,
                                              seed=t.seed, process_index=shard, process_count=shards)
        self.fresh_data_state = self.train_iter.get_state()
        self.data_shards = shards  # (per-source token counts sum each shard's rows once)
        self.eval_data = None  # empty DataConfig.eval_files: the run does not evaluate
        if exp.data.eval_files:
            self.eval_data = make_eval_batches(exp.data, seq_len=t.seq_len, batch_size=t.global_batch,
                                               max_batches=exp.observe.eval_batches, process_index=shard,
                                               process_count=shards)
        self.state_layout = setup.state  # canonical, or pipeline stages (converted at save/restore)
        self.shardings = setup.state.shardings
        self.pipeline_summary = setup.summary
        self.leaf_paths = [leaf_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(setup.state.abstract.params)]
        self.sampler = None
        if exp.observe.sample_every:
            if sampler is None:
                raise ValueError("ObserveConfig.sample_every is set but this Trainer was given no sampler: pass "
                                 "Trainer(..., sampler=jaxtrain.generate.during_training.TrainingSampler)")
            self.sampler = sampler(self)
        self.task_evaluator = None
        if exp.observe.eval_tasks:
            if task_evaluator is None:
                raise ValueError("ObserveConfig.eval_tasks is set but this Trainer was given no task evaluator: pass "
                                 "Trainer(..., task_evaluator=jaxtrain.harness.training.TrainingTaskEvaluator)")
            self.task_evaluator = task_evaluator(self)

    # -- state -------------------------------------------------------------------------------
    def restore_or_init(self, checkpointer: Checkpointer) -> tuple[TrainState, dict]:
        """(state, resume info: data position and skipped batches) from the newest intact
        checkpoint (checked to hold this model's shapes), or freshly initialized."""
        c = self.exp.checkpoint
        latest = checkpointer.latest_step()
        on_base = latest is not None and _recorded_base(checkpointer, latest) is not None
        if isinstance(checkpointer.saves, AdapterCheckpoints) and not on_base:
            return self._start_on_base(checkpointer.saves)
        if latest is not None and not on_base:  # (adapter steps hold a part: the restore checks it)
            try:
                saved = checkpointer.saved_shapes(latest)
            except Exception:  # unreadable metadata: restore_latest names it and falls back
                saved = None
            if saved is not None:
                check_same_model(saved, self.state_layout.disk_abstract["params"], self.exp.model, self.workdir,
                                 latest)
        try:
            restored = self.setup.restore(checkpointer, data_iterator=self.train_iter, reset=c.reset_on_resume,
                                          strict=c.strict_restore, allow_unverified=c.allow_unverified_restore)
        except IncompatibleCheckpoint as e:
            raise IncompatibleCheckpoint(f"{e}{self._changed_optimizer_fields()}") from None
        if restored is None:
            _warn_about_set_aside_steps(checkpointer.directory)
            self.train_iter.set_state(self.fresh_data_state)
            return self.state_layout.init(self.exp.train.seed), {"data_position": 0, "skipped_batches": []}
        step, manifest = restored.step, restored.manifest
        roles_line = roles_changed_line(step, manifest.get("roles"), self.param_roles())
        if roles_line and jax.process_index() == 0:
            print(roles_line, file=sys.stderr, flush=True)
        fresh_data = "data" in c.reset_on_resume or "data" not in manifest.get("items", ALL_ITEMS)
        if fresh_data:  # the iterator restarts with the count (a Trainer that already ran had moved it on)
            self.train_iter.set_state(self.fresh_data_state)
        position = 0 if fresh_data else manifest.get("data_position", step)
        return restored.state, {"data_position": position, "skipped_batches": manifest.get("skipped_batches", []),
                                "step": step}

    def checkpoint_saves(self, checkpoint_dir: str) -> FullCheckpoints | AdapterCheckpoints:
        """What this run's checkpoints hold: everything, or (a LoRA run) the adapters on a base:
        the one recorded by the newest adapter step, else the newest step of Experiment.lora_base
        or of this workdir (a converted base model)."""
        from jaxtrain.checkpoints.adapter_base import BaseRecord
        from jaxtrain.checkpoints.checkpointer import base_record
        from jaxtrain.training.lora_run import trained_part

        part = trained_part(self.setup)
        if part is None:
            return FullCheckpoints()
        own = Checkpointer(checkpoint_dir, keep=None, async_save=False)
        try:
            latest = own.latest_step()
            recorded = _recorded_base(own, latest) if latest is not None else None
        finally:
            own.close()
        if self.exp.lora_base is not None:
            base = base_record(os.path.join(self.exp.lora_base, "checkpoints"), what="Experiment.lora_base")
        elif recorded:
            base = BaseRecord.from_json(recorded)
        elif latest is None:
            raise IncompatibleCheckpoint(
                f"a LoRA run needs a base model: convert one into {self.workdir} (python -m jaxtrain.convert "
                f"--hf_dir=... --workdir={self.workdir}) or bind Experiment.lora_base to a workdir holding one")
        else:
            base = base_record(checkpoint_dir, latest, what="the base model")
        return AdapterCheckpoints(base, part)

    def _start_on_base(self, saves: AdapterCheckpoints) -> tuple[TrainState, dict]:
        """A LoRA run's first state: the base's parameters and fresh adapters, fresh optimizer and data."""
        from jaxtrain.training.lora_run import state_on_base

        state = state_on_base(self.setup, saves.base, saves.part, self.exp.train.seed)
        self.train_iter.set_state(self.fresh_data_state)
        if jax.process_index() == 0:
            print(f"jaxtrain: LoRA on base {saves.base.describe()}, adapters fresh", flush=True)
        return state, {"data_position": 0, "skipped_batches": []}

    def param_roles(self) -> dict:
        """{parameter path: optimizer role} as the manifests record them."""
        if not hasattr(self, "_param_roles"):
            self._param_roles = {"/".join(map(str, p)): role for p, role in optimizer_roles(self.exp.model).items()}
        return self._param_roles

    def _changed_optimizer_fields(self) -> str:
        fields = changed_fields(os.path.join(self.workdir, "config.gin"), self.exp.optimizer)
        return (" (changed since the saved config.gin: " + ", ".join(f"{k} {a} -> {b}" for k, a, b in fields) + ")"
                if fields else "")

    def evaluate(self, params) -> dict:
        if self.eval_data is None:
            raise ValueError("DataConfig.eval_files is empty: this run has no eval data to evaluate on")
        totals = {"nll": 0.0, "tokens": 0.0, "correct": 0.0}
        for local in self.eval_data:
            out = jax.device_get(self.setup.eval_step(params, self.setup.batch_from_process_rows(local)))
            for k in totals:
                totals[k] += float(out[k])
        tokens = max(totals["tokens"], 1.0)
        loss = totals["nll"] / tokens
        return {"loss": loss, "perplexity": math.exp(min(loss, 80.0)), "accuracy": totals["correct"] / tokens,
                "tokens": totals["tokens"]}

    def loop_parts(self) -> LoopParts:
        """What the step loop works with (jaxtrain/training/train_loop.py)."""
        exp, t = self.exp, self.exp.train
        return LoopParts(
            setup=self.setup, train=t, checkpoint=exp.checkpoint, resilience=exp.resilience, observe=exp.observe,
            workdir=self.workdir, train_iter=self.train_iter, data_shards=self.data_shards,
            blend=tuple(exp.data.blend or ()), evaluate=self.evaluate if self.eval_data is not None else None,
            restore_or_init=self.restore_or_init, leaf_paths=self.leaf_paths,
            flops_per_token=exp.model.flops_per_token(t.seq_len),
            peak_flops=peak_flops(jax.devices()[0].device_kind, exp.observe.peak_flops_per_device),
            make_sampler=lambda: self.sampler, evaluate_tasks=self.task_evaluator,
            tracked_config=config_values(exp), config_text=self.config_text)

    # -- loop --------------------------------------------------------------------------------
    def run(self, stop_after: int | None = None, signals=None) -> list[dict]:
        """Trains to TrainConfig.steps (or stops after `stop_after`, saving); returns the train
        metrics rows. Raises RunStopped (with an exit code) when the run cannot go on.
        `signals`: a StopSignals installed before start-up (the CLI's, which ends the process on a
        signal before the first step); by default the loop handles signals from its first step."""
        from jaxtrain.training.train_loop import TrainLoop

        c, r = self.exp.checkpoint, self.exp.resilience
        is_main = jax.process_index() == 0
        lock = WorkdirLock(self.workdir).acquire() if is_main else None
        watchdog = None
        try:
            peers = Peers(timeout_s=r.peer_timeout_s)
            watchdog = Watchdog.for_run(r, peers).start()  # restore, compile, steps, saves, evals
            if signals is not None:  # a stop before the first step tells the peers from now on
                signals.attach(peers)
            checkpoint_dir = os.path.join(self.workdir, "checkpoints")
            peers.check_shared_directory(checkpoint_dir)
            try:
                saves = self.checkpoint_saves(checkpoint_dir)
            except IncompatibleCheckpoint as e:  # no base, or not one: a config error, nothing written
                raise RunStopped(str(e), exit_codes.BAD_INPUT) from None
            checkpointer = Checkpointer(checkpoint_dir, keep=c.keep_checkpoints, async_save=c.async_checkpoint,
                                        roles=self.param_roles(), saves=saves)
            try:
                with watchdog.phase("restore", "the restore of the newest checkpoint (or the initialization)"):
                    state, resume = self.restore_or_init(checkpointer)
            except IncompatibleCheckpoint as e:  # a config change, not a damaged step: nothing was moved
                checkpointer.close()
                raise RunStopped(str(e), exit_codes.BAD_INPUT) from None
            except CheckpointError as e:
                checkpointer.close()
                raise RunStopped(str(e), exit_codes.CHECKPOINT) from None
            except ValueError:
                checkpointer.close()
                raise
            if is_main and self.config_text is not None:  # only once the checkpoints are known to fit
                with signals.writing() if signals is not None else contextlib.nullcontext():
                    _write_atomically(os.path.join(self.workdir, "config.gin"), self.config_text)
            loop = TrainLoop(self.loop_parts(), checkpointer, peers, state, resume, stop_after, watchdog=watchdog,
                             signals=signals)
            history = loop.run()
            self.final_state, self.stopped_by = loop.state, loop.stopped_by
            return history
        finally:
            if watchdog is not None:  # (the loop stops it, first telling the peers of an error)
                watchdog.stop(blame=False)
            if lock is not None:
                lock.release()

    def canonical(self, state: TrainState | dict) -> dict:
        """The state (or a dict of some of its items) as checkpoints hold it: pipeline stages
        regrouped into layer stacks."""
        return self.state_layout.to_disk(state.checkpoint_items() if isinstance(state, TrainState) else state)


def audit_params(setup, max_replicated: float | None):
    """The parameters' sharding audit (meshes/sharding_audit.py), printed as one line by process 0;
    ShardingAuditError (a ValueError: exit 2) when replicated copies exceed `max_replicated` of a
    device's parameter bytes (ObserveConfig.max_replicated)."""
    report = audit_sharding(setup.state.abstract.params, name="params")
    if jax.process_index() == 0:
        print(f"jaxtrain: sharding audit: {report.summary()}", flush=True)
    if max_replicated is not None:
        try:
            check_sufficiently_sharded(report, max_replicated)
        except ShardingAuditError as e:
            raise ShardingAuditError(f"{e} (ObserveConfig.max_replicated={max_replicated:g}): lay the parameters "
                                     f"out with more sharding (e.g. rules=fsdp) or raise the bound") from None
    return report


def _recorded_base(checkpointer: Checkpointer, step: int) -> dict | None:
    """The base recorded by `step` (a step of adapters), else None; a step whose metadata cannot
    be read is left to restore_latest, which names it and falls back to an older step."""
    try:
        manifest = checkpointer.manifest(step) or {}
    except CorruptCheckpoint:
        return None
    return manifest.get(BASE_KEY) or None
