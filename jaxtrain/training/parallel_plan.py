"""ParallelPlan: everything that decides how a run is laid out over the devices, in one object.

    mesh sizes (+ DCN split)   pipeline, data, context, expert, tensor
    rules                      rule table and overlays (meshes/rules.py): "fsdp+experts_folded"
    microbatches               gradient accumulation, or the microbatches a pipeline streams
    pipeline                   schedule, layer split, stage remat (used when pipeline > 1)
    context_parallel           sequence order and K/V exchange over `context`

A plan comes from gin (the fields of MeshConfig, TrainConfig.rules / microbatches /
context_parallel and Experiment.pipeline: `ParallelPlan.from_experiment`) or from one spec
string, on top of another plan:

    ParallelPlan().with_spec("pipeline=2,data=2,context=2,tensor=2,rules=fsdp,split=14/13,microbatches=4")

(`Experiment.layout` takes the same string in gin; `python -m jaxtrain.bench step --layout`
too). `validate` checks it against a model and a batch once, before anything is built.
"""
from __future__ import annotations

import dataclasses
import math

from jaxtrain.pipeline.config import PipelineConfig
from meshes.context_layout import AllGatherKV, ContextParallel, Contiguous, LoadBalanced, RingKV
from meshes.mesh_config import AXES, MeshConfig
from meshes.pipeline_schedules import SCHEDULES, GPipe
from meshes.rules import DATA_PARALLEL_AXES, RuleSet, get_rule_set

_KV_EXCHANGES = {"ring": RingKV, "allgather": AllGatherKV}
_ORDERS = {"balanced": LoadBalanced, "contiguous": Contiguous}


@dataclasses.dataclass(frozen=True)
class ParallelPlan:
    mesh: MeshConfig = MeshConfig()
    rules: str = "dp"
    microbatches: int = 1
    pipeline: PipelineConfig = PipelineConfig()
    context_parallel: ContextParallel = ContextParallel()

    @classmethod
    def from_experiment(cls, exp) -> "ParallelPlan":
        """The plan an Experiment's gin fields describe, with `Experiment.layout` applied on top."""
        t = exp.train
        plan = cls(mesh=exp.mesh or MeshConfig(), rules=t.rules, microbatches=t.microbatches,
                   pipeline=exp.pipeline or PipelineConfig(), context_parallel=t.context_parallel)
        return plan.with_spec(exp.layout) if getattr(exp, "layout", None) else plan

    @classmethod
    def parse(cls, spec: str) -> "ParallelPlan":
        """A plan from a spec string alone; unnamed mesh axes are 1 (not -1)."""
        return cls(mesh=MeshConfig(**{a: 1 for a in AXES})).with_spec(spec)

    def with_spec(self, spec: str) -> "ParallelPlan":
        """This plan with the settings a spec string names changed. Naming any mesh axis sets
        the unnamed ones to 1, so `data=8,tensor=2` means exactly that mesh."""
        mesh_sizes, changes, pipeline, cp = {}, {}, {}, {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, value = part.partition("=")
            if not sep or not value:
                raise ValueError(f"layout {spec!r}: {part!r} is not key=value")
            try:
                if key in AXES:
                    mesh_sizes[key] = int(value)
                elif key == "dcn":
                    mesh_sizes["dcn"] = tuple(int(n) for n in value.split("/"))
                elif key == "rules":
                    get_rule_set(value)  # names the unknown table or overlay
                    changes["rules"] = value
                elif key == "microbatches":
                    changes["microbatches"] = int(value)
                elif key == "schedule":
                    pipeline["schedule"] = _schedule(value)
                elif key == "split":
                    pipeline["stages_layers"] = tuple(int(n) for n in value.split("/"))
                elif key == "stage_remat":
                    pipeline["remat"] = value
                elif key == "kv":
                    cp["kv_exchange"] = _choice(_KV_EXCHANGES, key, value)()
                elif key == "order":
                    cp["layout"] = _choice(_ORDERS, key, value)()
                else:
                    raise ValueError(f"unknown key {key!r}: use the mesh axes {', '.join(AXES)}, dcn=a/b/c/d/e, "
                                     f"rules, microbatches, schedule=gpipe|interleaved<V>, split=a/b/..., "
                                     f"stage_remat, kv={'|'.join(_KV_EXCHANGES)}, order={'|'.join(_ORDERS)}")
            except ValueError as e:
                raise ValueError(f"layout {spec!r}: {part!r}: {e}") from None
        mesh = self.mesh
        if mesh_sizes:
            axes = {a: 1 for a in AXES}
            mesh = dataclasses.replace(mesh, **{**axes, **mesh_sizes})
        return dataclasses.replace(self, mesh=mesh, pipeline=dataclasses.replace(self.pipeline, **pipeline),
                                   context_parallel=dataclasses.replace(self.context_parallel, **cp), **changes)

    def spec(self) -> str:
        """The plan as a spec string (mesh, rules, microbatches, and pipeline settings if any)."""
        parts = [f"{a}={getattr(self.mesh, a)}" for a in AXES]
        parts += [f"rules={self.rules}", f"microbatches={self.microbatches}"]
        if self.mesh.pipeline != 1:
            s = self.pipeline.schedule
            parts.append("schedule=" + ("gpipe" if isinstance(s, GPipe) else f"interleaved{s.virtual_stages}"))
            if self.pipeline.stages_layers:
                parts.append("split=" + "/".join(map(str, self.pipeline.stages_layers)))
        return ",".join(parts)

    def rule_set(self) -> RuleSet:
        return get_rule_set(self.rules)

    def validate(self, model_cfg, *, global_batch: int, seq_len: int, mesh_shape: dict,
                 platform: str | None = None) -> None:
        """Errors for a plan that cannot run this model on this batch and mesh, before anything
        is built (the pipeline's layer split is checked when the stage plan is made)."""
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
        model_cfg.validate(dict(mesh_shape))
        attention = getattr(model_cfg, "attention", None)
        if platform is not None and attention is not None and hasattr(attention, "check_backend"):
            attention.check_backend(platform)
        if mesh_shape["pipeline"] > 1:
            self.pipeline.validate(mesh_shape["pipeline"], self.microbatches)


def _schedule(value: str):
    name = value.rstrip("0123456789")
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {value!r}: choose gpipe or interleaved<V> (e.g. interleaved2)")
    virtual = value[len(name):]
    if name == "gpipe":
        if virtual:
            raise ValueError("gpipe takes no virtual-stage count")
        return SCHEDULES[name]()
    return SCHEDULES[name](int(virtual) if virtual else 2)


def _choice(table: dict, key: str, value: str):
    if value not in table:
        raise ValueError(f"{key}={value!r}: choose one of {'|'.join(table)}")
    return table[value]
