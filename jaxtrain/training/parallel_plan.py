"""ParallelPlan: everything that decides how a run is laid out over the devices, in one value.

    mesh (+ DCN split)     pipeline, data, context, expert, tensor
    rules                  rule table and overlays (meshes/rules.py): "fsdp+experts_folded"
    microbatches           gradient accumulation, or the microbatches a pipeline streams
    schedule, split,       the pipeline (used when pipeline > 1)
      stage_remat, stage_loop
    context_parallel       sequence order and K/V exchange over `context`
    remat, attention       overrides of the model config's own (None: the config's)
    groups                 device groups' rows of each batch (jaxtrain/training/device_groups.py)

A plan comes from gin (`Experiment.plan`: MeshConfig, TrainConfig.rules / microbatches /
context_parallel, Experiment.pipeline and DeviceGroups.rows, with `Experiment.layout` on top) or
from one spec string over another plan:

    ParallelPlan().with_spec("pipeline=2,data=2,context=2,tensor=2,rules=fsdp,split=14/13,microbatches=4")

Every key is in one table (jaxtrain/training/plan_keys.py); `spec()` writes every field, so
`ParallelPlan.parse(plan.spec()) == plan`. This module imports no jax (the CLI reads a layout
before jax starts); what needs jax (the rule set, the pipeline config, the attention objects) is
resolved by the methods that return it. `validate` checks a plan against a model and a batch
once, before anything is built.
"""
from __future__ import annotations

import dataclasses
import math

from jaxtrain.training import plan_keys
from jaxtrain.meshes.context_settings import ContextParallel
from jaxtrain.meshes.mesh_config import AXES, MeshConfig
from jaxtrain.meshes.pipeline_schedules import GPipe


@dataclasses.dataclass(frozen=True)
class ParallelPlan:
    mesh: MeshConfig = MeshConfig()
    rules: str = "dp"
    microbatches: int = 1
    schedule: object = GPipe()  # GPipe() | Interleaved(virtual_stages)
    split: tuple[int, ...] | None = None  # layers per pipeline chunk; None: balanced by cost
    stage_remat: str = "none"  # none | layer | stage
    stage_loop: str = "auto"  # auto | runs | switched | kinds (models/stage_program.py)
    context_parallel: ContextParallel = ContextParallel()
    remat: str | None = None  # the model's remat policy; None: its config's
    attention: str | None = None  # a plan_keys.ATTENTION name; None: the model config's
    groups: tuple[int, ...] = ()  # DeviceGroups.rows; (): no device groups

    @classmethod
    def from_experiment(cls, exp) -> "ParallelPlan":
        """The plan an Experiment's gin fields describe, with `Experiment.layout` applied on top."""
        t, groups = exp.train, getattr(exp, "groups", None)
        plan = cls(mesh=exp.mesh or MeshConfig(), rules=t.rules, microbatches=t.microbatches,
                   context_parallel=t.context_parallel, groups=tuple(groups.rows) if groups is not None else ())
        plan = plan.with_pipeline(exp.pipeline)
        return plan.with_spec(exp.layout) if getattr(exp, "layout", None) else plan

    @classmethod
    def parse(cls, spec: str) -> "ParallelPlan":
        """A plan from a spec string alone; unnamed mesh axes are 1 (not -1)."""
        return cls(mesh=MeshConfig(**{a: 1 for a in AXES})).with_spec(spec)

    def with_spec(self, spec: str) -> "ParallelPlan":
        """This plan with the settings a spec string names changed. Naming any mesh axis sets
        the unnamed ones to 1, so `data=8,tensor=2` means exactly that mesh."""
        values = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, value = (s.strip() for s in part.partition("="))
            if not sep or not value:
                raise ValueError(f"layout {spec!r}: {part!r} is not key=value")
            if key not in plan_keys.BY_NAME:
                raise ValueError(f"layout {spec!r}: {part!r}: {plan_keys.unknown_key(key)}")
            k = plan_keys.BY_NAME[key]
            try:
                values[k.field] = k.parse(value)
            except ValueError as e:
                raise ValueError(f"layout {spec!r}: {part!r}: {e}") from None
        plan = self
        if any(field in (f"mesh.{a}" for a in AXES) for field in values):
            plan = dataclasses.replace(plan, mesh=dataclasses.replace(plan.mesh, **{a: 1 for a in AXES}))
        for field, value in values.items():
            plan = plan_keys.replace(plan, field, value)
        return plan

    def with_pipeline(self, pipeline) -> "ParallelPlan":
        """This plan with a PipelineConfig's settings (gin's `Experiment.pipeline`; None: unchanged)."""
        if pipeline is None:
            return self
        split = tuple(pipeline.stages_layers) if pipeline.stages_layers is not None else None
        return dataclasses.replace(self, schedule=pipeline.schedule, split=split, stage_remat=pipeline.remat,
                                   stage_loop=pipeline.stage_loop)

    def spec(self) -> str:
        """Every field as a spec string: `ParallelPlan.parse(p.spec()) == p`, and applied over any
        other plan it gives this one."""
        return ",".join(f"{k.name}={k.format(plan_keys.get(self, k.field))}" for k in plan_keys.KEYS)

    def label(self, omit: tuple[str, ...] = ()) -> str:
        """A short spec for display: the mesh axes not 1, the rules, and the other fields that
        differ from a default plan (it parses back to this plan); `omit` leaves keys out."""
        default = ParallelPlan()
        parts = [f"{a}={getattr(self.mesh, a)}" for a in AXES if getattr(self.mesh, a) != 1] or ["data=1"]
        for k in plan_keys.KEYS:
            if k.name in AXES or k.name in omit:
                continue
            value = plan_keys.get(self, k.field)
            if k.name == "rules" or value != plan_keys.get(default, k.field):
                parts.append(f"{k.name}={k.format(value)}")
        return ",".join(parts)

    def device_count(self) -> int:
        """Devices the plan's explicit sizes need, every device group's (a -1 axis counts as 1)."""
        return self.mesh.fixed_device_count() * max(len(self.groups), 1)

    # ---- resolved where they are used (these import jax) ------------------------------------

    @property
    def pipeline(self):
        """The pipeline settings as a PipelineConfig (jaxtrain/pipeline/config.py)."""
        from jaxtrain.pipeline.config import PipelineConfig
        return PipelineConfig(schedule=self.schedule, stages_layers=self.split, remat=self.stage_remat,
                              stage_loop=self.stage_loop)

    def rule_set(self):
        from jaxtrain.meshes.rules import get_rule_set
        return get_rule_set(self.rules)

    def device_groups(self):
        """The DeviceGroups this plan names, or None without groups."""
        from jaxtrain.training.device_groups import DeviceGroups
        return DeviceGroups(rows=self.groups) if self.groups else None

    def apply_to_model(self, model_cfg):
        """The model config with the plan's overrides (remat, attention) in place of its own
        (models/family.py's runtime settings; one the family lacks is a ValueError naming it)."""
        attention = None
        if self.attention is not None:
            from jaxtrain.models.layers import attention_impl
            name, kwargs = plan_keys.ATTENTION[self.attention]
            attention = getattr(attention_impl, name)(**kwargs)
        if self.remat is None and attention is None:
            return model_cfg
        try:
            return model_cfg.with_runtime(remat=self.remat, attention=attention)
        except ValueError as e:
            raise ValueError(f"layout {self.label()!r}: {e}") from None

    def validate(self, model_cfg, *, global_batch: int, seq_len: int, mesh_shape: dict,
                 platform: str | None = None) -> None:
        """Errors for a plan that cannot run this model on this batch and mesh, before anything
        is built (the pipeline's layer split is checked when the stage plan is made)."""
        from jaxtrain.meshes.rules import DATA_PARALLEL_AXES

        if self.microbatches < 1:
            raise ValueError(f"microbatches must be positive, got {self.microbatches}")
        if global_batch % self.microbatches:
            raise ValueError(f"TrainConfig.global_batch={global_batch} is not divisible by "
                             f"microbatches={self.microbatches}")
        data_parallel = math.prod(mesh_shape[a] for a in DATA_PARALLEL_AXES)
        per_microbatch = global_batch // self.microbatches
        if per_microbatch % data_parallel:
            raise ValueError(f"global_batch={global_batch} / microbatches={self.microbatches} = {per_microbatch} "
                             f"rows per microbatch is not divisible by the data-parallel size {data_parallel} "
                             f"(data x expert = {' x '.join(str(mesh_shape[a]) for a in DATA_PARALLEL_AXES)})")
        if seq_len % mesh_shape["context"]:
            raise ValueError(f"seq_len={seq_len} is not divisible by the context axis size {mesh_shape['context']}")
        try:
            self.context_parallel.validate(seq_len, mesh_shape["context"])
        except ValueError as e:
            raise ValueError(f"TrainConfig.seq_len={seq_len}: {e}") from None
        model_cfg = self.apply_to_model(model_cfg)
        model_cfg.validate(dict(mesh_shape))
        attention = model_cfg.runtime().attention
        if platform is not None and attention is not None and hasattr(attention, "check_backend"):
            attention.check_backend(platform)
        if mesh_shape["pipeline"] > 1:
            self.pipeline.validate(mesh_shape["pipeline"], self.microbatches)
