"""The one assembly function: (model config, ParallelPlan, TrainConfig, OptimizerConfig) ->
everything a run compiles, for any layout — mesh, rules, optimizer, state layout, gradient
strategy, batch shardings, train and eval steps; with DeviceGroups, the same over device groups
with uneven batch shares (jaxtrain/training/device_groups.py).

The Trainer, the bench, the eval CLI, the Python API (jaxtrain/api.py) and the tests all call
`build_train_setup`, so a pipelined and an unpipelined run differ only in the two strategies
chosen here (state layout and gradients).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.pipeline import PipelinedGradients, StagedState, build_pipeline
from jaxtrain.training.batch_shards import process_batch_shard
from jaxtrain.training.device_groups import BatchShares, DeviceGroups, GroupLayout, split_devices
from jaxtrain.training.group_step import GroupedEvalStep, GroupedTrainStep, group_gradients
from jaxtrain.training.optim import OptimizerConfig, make_optimizer
from jaxtrain.training.parallel_plan import ParallelPlan
from jaxtrain.training.run_configs import LossConfig
from jaxtrain.training.state import TrainState, optimizer_roles
from jaxtrain.training.state_layouts import CanonicalState
from jaxtrain.training.trained_params import trained_params
from jaxtrain.training.step import BATCH_KEYS, AccumulatedGradients, batch_shardings, make_eval_step, make_train_step
from jaxtrain.meshes.mesh import build_mesh
from jaxtrain.meshes.rules import RuleSet

BATCH_DTYPES = {k: jnp.float32 if k == "loss_mask" else jnp.int32 for k in BATCH_KEYS}


@dataclasses.dataclass(frozen=True)
class Restored:
    """A restored checkpoint: its step, the state ready to step (None when only the parameters
    were read), the parameters and the step's manifest."""
    step: int
    state: TrainState | None
    params: dict
    manifest: dict


@dataclasses.dataclass
class TrainSetup:
    plan: ParallelPlan
    mesh: object
    rules: RuleSet
    tx: object
    lr_schedule: object
    state: CanonicalState | StagedState
    gradients: AccumulatedGradients | PipelinedGradients
    batch_sharding: dict
    train_step: object
    eval_step: object
    summary: str = ""  # the pipeline layout in a line, for the log (empty without one)

    def ready_to_step(self, items: dict, step: int) -> TrainState:
        """Restored or given items (params in this run's layout; opt_state optional) made a state
        ready for the train step: a fresh optimizer state where it has none, and `step`."""
        shardings = self.state.shardings
        params = items["params"]
        opt_state = items.get("opt_state")
        if opt_state is None:  # a converted checkpoint, given params, or a reset on purpose
            opt_state = jax.jit(self.tx.init, out_shardings=shardings.opt_state)(params)
        return TrainState(step=jax.device_put(jnp.asarray(step, jnp.int32), shardings.step), params=params,
                          opt_state=opt_state)

    def state_from_params(self, params: dict, step: int = 0) -> TrainState:
        """A state starting from canonical parameters (host or device arrays), in this run's layout."""
        disk = jax.tree.map(lambda a: a.sharding, self.state.disk_abstract["params"])
        return self.ready_to_step(self.state.from_disk({"params": jax.device_put(params, disk)}), step)

    def restore(self, checkpointer, step: int | None = None, *, params_only: bool = False, as_saved: bool = False,
                data_iterator=None, reset=(), strict: bool = False, quarantine: bool = True,
                allow_unverified: bool = False) -> "Restored | None":
        """The one restore path (the Trainer, `api.Run`, eval and generation call it): checkpoint
        `step` of `checkpointer` (default: the newest intact one; None when there is no step at
        all) read straight into this run's layout. `params_only`: the parameters alone (no
        optimizer state is read or made); `as_saved`: parameters in the canonical layout
        checkpoints hold rather than this run's (pipeline stages regrouped back). `data_iterator`
        is restored in place; `reset`, `strict`, `quarantine` and `allow_unverified` as
        Checkpointer.restore_latest takes them."""
        abstract = {"params": self.state.disk_abstract["params"]} if params_only else self.state.disk_abstract
        if step is None:
            found = checkpointer.restore_latest(abstract, data_iterator, reset=reset, strict=strict,
                                                quarantine=quarantine, allow_unverified=allow_unverified)
            if found is None:
                return None
            step, saved, manifest = found
        else:
            saved = checkpointer.restore(step, abstract, data_iterator, reset=reset, allow_unverified=allow_unverified)
            manifest = checkpointer.manifest(step) or {}
        if params_only:
            params = saved["params"] if as_saved else self.state.from_disk({"params": saved["params"]})["params"]
            return Restored(step, None, params, manifest)
        state = self.ready_to_step(self.state.from_disk(saved), step)
        return Restored(step, state, state.params, manifest)

    def abstract_batch(self, global_batch: int, seq_len: int) -> dict:
        """ShapeDtypeStructs of a global batch with its shardings (for compile-only sizing)."""
        return {k: jax.ShapeDtypeStruct((global_batch, seq_len), BATCH_DTYPES[k], sharding=s)
                for k, s in self.batch_sharding.items()}

    def device_batch(self, host: dict) -> dict:
        """The whole global batch (numpy arrays, the same on every process) -> sharded device
        arrays, each device taking its own shard."""
        return _device_arrays(host, self.batch_sharding)

    # The batch strategy of a data pipeline that reads per process (the Trainer's):
    def process_rows(self, global_batch: int, seq_len: int) -> tuple[int, int]:
        """(shard, shards): this process reads shard `shard` of `shards` equal row ranges of each
        global batch. Processes that differ only along axes the batch is replicated over
        (pipeline stages on different hosts) read the same rows."""
        return process_batch_shard(self.batch_sharding["inputs"], (global_batch, seq_len), jax.process_index())

    def batch_from_process_rows(self, local: dict) -> dict:
        """This process's rows of a batch (process_rows) -> what the steps take."""
        return {k: jax.make_array_from_process_local_data(self.batch_sharding[k], np.asarray(local[k]))
                for k in self.batch_sharding}


@dataclasses.dataclass
class GroupedTrainSetup(TrainSetup):
    """A run over device groups: `mesh` is the global mesh (state replicated over its `groups`
    axis), `gradients` and `batch_sharding` are per group, and the steps take {group: its rows}
    for this process's groups (`device_batch` makes them from the whole global batch)."""
    layout: GroupLayout | None = None
    shares: BatchShares | None = None

    def device_batch(self, host: dict) -> dict:
        """The whole global batch (numpy arrays, the same on every process) -> this process's
        groups' rows (BatchShares.row_indices), each group's on its own mesh."""
        return {g: _device_arrays({k: np.asarray(host[k])[self.shares.row_indices(g)] for k in self.batch_sharding[g]},
                                  self.batch_sharding[g]) for g in self.layout.own}

    def abstract_batch(self, global_batch: int, seq_len: int) -> dict:
        raise NotImplementedError("a run over device groups compiles one program per group: no one abstract batch")

    def process_rows(self, global_batch: int, seq_len: int) -> tuple[int, int]:
        """Every process reads whole global batches and its groups take their rows
        (device_batch): the data state is that of one reader."""
        return 0, 1

    def batch_from_process_rows(self, local: dict) -> dict:
        return self.device_batch(local)


def _device_arrays(host: dict, shardings: dict) -> dict:
    out = {}
    for k, sharding in shardings.items():
        value = np.asarray(host[k], BATCH_DTYPES[k])
        out[k] = jax.make_array_from_callback(value.shape, sharding, lambda index, v=value: v[index])
    return out


def build_train_setup(model_cfg, plan: ParallelPlan, train, optimizer: OptimizerConfig,
                      devices=None, groups: DeviceGroups | None = None, loss: LossConfig | None = None) -> TrainSetup:
    """Validates the plan against the model and batch (before anything is compiled), then
    builds the run's parts. `train`: a TrainConfig (steps, batch, sequence); `loss`: the loss
    settings (default: LossConfig() as gin binds it, its defaults when unbound).
    `groups` (default: the plan's `groups`): data parallelism over device groups with uneven
    shares of the batch (each group laid out by `plan`; `devices` then a flat list or one list per
    group). The variant is chosen here, once: a GroupedTrainSetup brings its own steps and batch
    strategy, so its callers never branch on it."""
    model_cfg = plan.apply_to_model(model_cfg)  # the plan's remat / attention overrides
    loss = loss if loss is not None else LossConfig()
    loss.validate()
    if groups is None or not groups.rows:
        groups = plan.device_groups()
    if groups is not None:
        return _build_grouped_train_setup(model_cfg, plan, train, optimizer, devices, groups, loss)
    mesh = build_mesh(plan.mesh, devices)
    plan.validate(model_cfg, global_batch=train.global_batch, seq_len=train.seq_len, mesh_shape=dict(mesh.shape),
                  platform=mesh.devices.flat[0].platform)
    rules = plan.rule_set()
    roles = optimizer_roles(model_cfg)
    trained = trained_params(roles)  # all parameters, or the adapters alone (models/lora.py)
    tx, lr_schedule = make_optimizer(optimizer, train.steps, roles)
    if mesh.shape["pipeline"] > 1:
        state, gradients, summary = build_pipeline(model_cfg, plan, tx, mesh, rules, loss, trained)
    else:
        state = CanonicalState(model_cfg, tx, mesh, rules)
        gradients = AccumulatedGradients(state.graphdef, microbatches=plan.microbatches, loss_chunk=loss.loss_chunk,
                                         z_loss=loss.z_loss, trained=trained)
        summary = ""
    bsh = batch_shardings(mesh, rules, train.global_batch, train.seq_len)
    cp = plan.context_parallel
    train_step = make_train_step(state.graphdef, tx, lr_schedule, gradients, mesh=mesh, rules=rules,
                                 state_shardings=state.shardings, batch_sharding=bsh, context_parallel=cp,
                                 trained=trained)
    eval_step = make_eval_step(gradients.sums, mesh=mesh, rules=rules, params_shardings=state.shardings.params,
                               batch_sharding=bsh, context_parallel=cp)
    return TrainSetup(plan, mesh, rules, tx, lr_schedule, state, gradients, bsh, train_step, eval_step, summary)


def _build_grouped_train_setup(model_cfg, plan: ParallelPlan, train, optimizer: OptimizerConfig, devices,
                               groups: DeviceGroups, loss: LossConfig) -> GroupedTrainSetup:
    shares = groups.shares(train.global_batch, plan.microbatches)
    devices = jax.devices() if devices is None else devices
    layout = GroupLayout(plan.mesh, split_devices(devices, len(shares.rows), plan.mesh))
    group_shape = layout.group_shape
    if group_shape["pipeline"] > 1:
        raise ValueError(f"pipeline={group_shape['pipeline']} within device groups is not supported: lay each "
                         f"group out with data, context, expert and tensor only")
    plan.validate(model_cfg, global_batch=train.global_batch, seq_len=train.seq_len, mesh_shape=group_shape,
                  platform=layout.mesh.devices.flat[0].platform)
    rules = plan.rule_set()
    roles = optimizer_roles(model_cfg)
    trained = trained_params(roles)  # all parameters, or the adapters alone (models/lora.py)
    tx, lr_schedule = make_optimizer(optimizer, train.steps, roles)
    state = CanonicalState(model_cfg, tx, layout.mesh, rules)
    gradients = group_gradients(shares, state.graphdef, loss_chunk=loss.loss_chunk, z_loss=loss.z_loss,
                                trained=trained)
    bsh = {g: batch_shardings(mesh, rules, rows, train.seq_len) for g, (mesh, rows) in
           enumerate(zip(layout.meshes, shares.rows))}
    cp = plan.context_parallel
    train_step = GroupedTrainStep(layout, gradients, state.graphdef, tx, lr_schedule, rules=rules,
                                  state_shardings=state.shardings, batch_shardings=bsh, context_parallel=cp,
                                  trained=trained)
    eval_step = GroupedEvalStep(layout, gradients, rules=rules, params_shardings=state.shardings.params,
                                batch_shardings=bsh, context_parallel=cp)
    summary = (f"{layout.count} device groups of {layout.meshes[0].size} devices, rows {shares.rows} of each batch "
               f"in microbatches of {shares.microbatch_rows} ({shares.microbatches})")
    return GroupedTrainSetup(plan, layout.mesh, rules, tx, lr_schedule, state, gradients, bsh, train_step, eval_step,
                             summary, layout=layout, shares=shares)
