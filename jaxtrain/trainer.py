"""The training loop: mesh, sharded state, data, jitted step, metrics, eval and checkpoints.

Everything that can be checked without compiling (mesh vs devices, model vs mesh, batch vs
data-parallel size, data files) is checked in the constructor, before the workdir is touched.
"""
from __future__ import annotations

import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.batch_shards import process_batch_shard
from jaxtrain.checkpoint import Checkpointer
from jaxtrain.config import Experiment
from jaxtrain.data import make_eval_batches, make_train_iterator
from jaxtrain.flops import peak_flops
from jaxtrain.metrics import MetricsWriter, device_memory
from jaxtrain.optim import make_optimizer
from jaxtrain.train_setup import build_train_setup
from meshes.mesh import build_mesh, describe
from meshes.rules import DATA_PARALLEL_AXES, get_rule_set


def check_layout(exp: Experiment, mesh) -> None:
    sizes = dict(mesh.shape)
    t = exp.train
    data_parallel = math.prod(sizes[a] for a in DATA_PARALLEL_AXES)
    per_microbatch = t.global_batch // t.microbatches
    if per_microbatch % data_parallel:
        raise ValueError(f"global_batch={t.global_batch} / microbatches={t.microbatches} = {per_microbatch} "
                         f"rows per microbatch is not divisible by the data-parallel size {data_parallel} "
                         f"(data x expert = {' x '.join(str(sizes[a]) for a in DATA_PARALLEL_AXES)})")
    if t.seq_len % sizes["context"]:
        raise ValueError(f"seq_len={t.seq_len} is not divisible by the context axis size {sizes['context']}")
    try:
        t.context_parallel.validate(t.seq_len, sizes["context"])
    except ValueError as e:
        raise ValueError(f"TrainConfig.seq_len={t.seq_len}: {e}") from None
    exp.model.validate(sizes)
    attention = getattr(exp.model, "attention", None)
    if attention is not None and hasattr(attention, "check_backend"):
        attention.check_backend(mesh.devices.flat[0].platform)
    # The pipeline (schedule vs microbatches, the layer split) is checked by build_train_setup,
    # which every caller runs next, still before anything is compiled or written.


class Trainer:
    def __init__(self, exp: Experiment, workdir: str, devices=None):
        exp.train.validate()
        self.exp, self.workdir = exp, os.path.abspath(workdir)
        t = exp.train
        self.mesh = build_mesh(exp.mesh, devices)
        self.rules = get_rule_set(t.rules)
        check_layout(exp, self.mesh)
        self.tx, self.schedule = make_optimizer(exp.optimizer, t.steps)
        setup = build_train_setup(exp.model, t, self.tx, self.schedule, self.mesh, self.rules, exp.pipeline)
        # Rows this process feeds: processes that differ only along axes the batch is replicated
        # over (pipeline stages on different hosts) read the same rows.
        shard, shards = process_batch_shard(setup.batch_sharding["inputs"], (t.global_batch, t.seq_len),
                                            jax.process_index())
        self.train_iter = make_train_iterator(exp.data, seq_len=t.seq_len, global_batch=t.global_batch,
                                              seed=t.seed, process_index=shard, process_count=shards)
        self.eval_data = make_eval_batches(exp.data, seq_len=t.seq_len, batch_size=t.global_batch,
                                           max_batches=t.eval_batches, process_index=shard, process_count=shards)
        self.state_layout = setup.state  # canonical, or pipeline stages (converted at save/restore)
        self.shardings, self.batch_sharding = setup.state.shardings, setup.batch_sharding
        self.train_step, self.eval_step = setup.train_step, setup.eval_step
        self.num_params = setup.state.num_params
        self.pipeline_summary = setup.summary
        self.flops_per_token = exp.model.flops_per_token(t.seq_len)
        self.peak = peak_flops(jax.devices()[0].device_kind, t.peak_flops_per_device)

    # -- data --------------------------------------------------------------------------------
    def global_batch(self, local: dict) -> dict:
        return {k: jax.make_array_from_process_local_data(self.batch_sharding[k], np.asarray(local[k]))
                for k in self.batch_sharding}

    # -- state -------------------------------------------------------------------------------
    def restore_or_init(self, checkpointer: Checkpointer):
        step = checkpointer.latest_step()
        if step is None:
            return self.state_layout.init(self.exp.train.seed)
        state = self.state_layout.from_disk(checkpointer.restore(step, self.state_layout.disk_abstract, self.train_iter))
        if "opt_state" not in state:  # a converted checkpoint: parameters only
            state["opt_state"] = jax.jit(self.tx.init, out_shardings=self.shardings["opt_state"])(state["params"])
        state["step"] = jax.device_put(jnp.asarray(step, jnp.int32), self.shardings["step"])
        return state

    def evaluate(self, params) -> dict:
        totals = {"nll": 0.0, "tokens": 0.0, "correct": 0.0}
        for local in self.eval_data:
            out = jax.device_get(self.eval_step(params, self.global_batch(local)))
            for k in totals:
                totals[k] += float(out[k])
        tokens = max(totals["tokens"], 1.0)
        loss = totals["nll"] / tokens
        return {"loss": loss, "perplexity": math.exp(min(loss, 80.0)), "accuracy": totals["correct"] / tokens,
                "tokens": totals["tokens"]}

    # -- loop --------------------------------------------------------------------------------
    def run(self, stop_after: int | None = None) -> list[dict]:
        """Trains to TrainConfig.steps (or stops after `stop_after`, saving); returns train metrics."""
        t = self.exp.train
        is_main = jax.process_index() == 0
        checkpointer = Checkpointer(os.path.join(self.workdir, "checkpoints"), keep=t.keep_checkpoints,
                                    async_save=t.async_checkpoint)
        state = self.restore_or_init(checkpointer)
        start = int(jax.device_get(state["step"]))
        end = min(t.steps, stop_after) if stop_after else t.steps
        writer = MetricsWriter(self.workdir, t.steps, start, enabled=is_main)
        if is_main:
            print(f"jaxtrain: {self.num_params / 1e6:.2f}M params, mesh {describe(self.mesh)}, rules "
                  f"{self.rules.name}, steps {start}->{end}", flush=True)
            if self.pipeline_summary:
                print(f"jaxtrain: {self.pipeline_summary}", flush=True)
        history, pending = [], None
        tokens_per_step = t.global_batch * t.seq_len
        interval = {"t0": time.perf_counter()}
        try:
            for step in range(start, end):
                state, metrics = self.train_step(state, self.global_batch(next(self.train_iter)))
                if pending is not None:  # fetch the previous step while this one runs
                    history.append(self._log(writer, *pending, interval, tokens_per_step))
                pending = (step + 1, metrics)
                done = step + 1
                if t.eval_every and done % t.eval_every == 0 and done != end:
                    writer.write(done, self.evaluate(state["params"]), kind="eval")
                if t.checkpoint_every and done % t.checkpoint_every == 0 and done != end:
                    checkpointer.save(done, self.state_layout.to_disk(state), self.train_iter)
            if pending is not None:
                history.append(self._log(writer, *pending, interval, tokens_per_step))
            if end > start:
                checkpointer.save(end, self.state_layout.to_disk(state), self.train_iter)
            if end == t.steps:
                writer.write(end, self.evaluate(state["params"]), kind="eval")
        finally:
            checkpointer.close()
            writer.close()
        self.final_state = state  # in memory layout; `canonical(final_state)` as saved
        return history

    def canonical(self, state: dict) -> dict:
        """The state as checkpoints hold it (pipeline stages regrouped into layer stacks)."""
        return self.state_layout.to_disk(state)

    def _log(self, writer, step, metrics, interval, tokens_per_step) -> dict:
        """One metrics row per step; the time is measured between successive fetches, so the
        first step's row includes compilation."""
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        elapsed, interval["t0"] = now - interval["t0"], now
        tps = tokens_per_step / max(elapsed, 1e-9)
        values.update(step_time=elapsed, tokens_per_sec=tps,
                      mfu=(self.flops_per_token * tps / (self.peak * self.mesh.size)) if self.peak else None,
                      **device_memory())
        writer.write(step, values, echo=step % self.exp.train.log_every == 0 or step == 1)
        return {"step": step, **values}
