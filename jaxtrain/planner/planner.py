"""Evaluate and rank layouts: for each candidate, the memory per device (memory_model.py), the
step time (time_model.py), whether it fits, and its tokens per second.

    planner = Planner(workload, group, links)
    ranked = planner.rank(candidates(...))          # fitting layouts first, fastest first

A layout *fits* when its predicted peak, raised by `margin` (the model's error band against
compiled programs), stays under `headroom` of the device memory: the planner claims at most
peak x (1 + margin) and never ranks a layout above one it is surer of for lack of room.
"""
from __future__ import annotations

import dataclasses
import functools
import math

from jaxtrain.planner.cluster import DeviceGroup
from jaxtrain.planner.layer_profile import ModelProfile, profile_model
from jaxtrain.planner.links import LinkTable
from jaxtrain.planner.memory_model import GPU, MemoryEstimate, Platform, estimate_memory
from jaxtrain.planner.state_bytes import StateBytes, state_bytes, state_shapes
from jaxtrain.planner.time_model import Efficiency, StepTime, estimate_time
from jaxtrain.training.parallel_plan import ParallelPlan
from jaxtrain.meshes.rules import ShardingRuleError, get_rule_set
from jaxtrain.meshes.weight_gather import strategy as weight_gather_strategy
from jaxtrain.models.stage_program import layer_cost, layer_stacks


@dataclasses.dataclass(frozen=True)
class Workload:
    model: object  # a model config (a candidate plan's `remat` overrides its own)
    global_batch: int
    seq_len: int
    loss_chunk: int = 1024
    optimizer: object = None  # OptimizerConfig (the default AdamW when None)


@dataclasses.dataclass(frozen=True)
class Evaluation:
    candidate: ParallelPlan  # the layout evaluated (its remat: the policy, None the model's)
    memory: MemoryEstimate | None = None
    time: StepTime | None = None
    claimed_bytes: float = math.inf  # peak x (1 + margin)
    fits: bool = False
    tokens_per_sec_per_device: float = 0.0
    mfu: float = 0.0
    error: str | None = None  # why the layout cannot run at all

    @property
    def ok(self) -> bool:
        return self.error is None


class Planner:
    def __init__(self, workload: Workload, group: DeviceGroup, links: LinkTable, *, platform: Platform = GPU,
                 headroom: float = 0.92, margin: float = 0.25, efficiency: Efficiency = Efficiency(),
                 host_gbps: float = 25.0):
        from jaxtrain.training.optim import OptimizerConfig, make_optimizer
        from jaxtrain.training.state import optimizer_roles

        self.workload, self.group, self.links, self.platform = workload, group, links, platform
        self.headroom, self.margin, self.efficiency, self.host_gbps = headroom, margin, efficiency, host_gbps
        model = workload.model
        self.profile: ModelProfile = profile_model(model.with_runtime(remat="none"))
        self.tx, _ = make_optimizer(workload.optimizer or OptimizerConfig(), 1000, optimizer_roles(model))
        self.has_experts = any(k.top_k for k in self.profile.kinds)
        self.layers = len(self.profile.sequence)
        self.flops_per_token = model.flops_per_token(workload.seq_len)

    @property
    def budget(self) -> float:
        return self.headroom * self.group.spec.memory_bytes

    @functools.lru_cache(maxsize=64)
    def _shapes(self, stages: int, pipeline):
        return state_shapes(self.workload.model, self.tx, pipeline, stages)

    @functools.lru_cache(maxsize=64)
    def _pipeline_shape(self, stages: int, pipeline) -> tuple[int, int, float]:
        """(passes, slots per pass, a stage's work per pass / an even share) of a pipeline split."""
        from flax import nnx

        plan = pipeline.plan(self.workload.model, stages)
        model = nnx.eval_shape(lambda: self.workload.model.build(nnx.Rngs(0)))
        cost = {kind: layer_cost(stack) for kind, stack in layer_stacks(model).items()}
        total = sum(cost[k] * n for k, n in plan.layers.items())
        per_pass = sum(cost[k] for k in plan.pattern)
        return plan.repeats, len(plan.pattern), per_pass * stages * plan.repeats / total

    def policy(self, plan: ParallelPlan) -> str:
        """The remat policy a plan runs the model with (its own, or the model config's)."""
        return plan.apply_to_model(self.workload.model).runtime().remat

    def state(self, plan: ParallelPlan) -> StateBytes:
        sizes = plan.mesh.sizes()
        return state_bytes(self._shapes(sizes["pipeline"], plan.pipeline if sizes["pipeline"] > 1 else None),
                           sizes, get_rule_set(plan.rules))

    def memory(self, plan: ParallelPlan, state: StateBytes, platform: Platform | None = None,
               global_batch: int | None = None) -> MemoryEstimate:
        """`global_batch`: another batch than the workload's (a device group's share)."""
        w = self.workload
        sizes = plan.mesh.sizes()
        ticks, passes, work = self._ticks(plan)
        return estimate_memory(self.profile, state, policy=self.policy(plan), sizes=sizes, rules_name=plan.rules,
                               global_batch=global_batch or w.global_batch, seq_len=w.seq_len,
                               microbatches=plan.microbatches, loss_chunk=w.loss_chunk, platform=platform or self.platform, pipeline_ticks=ticks,
                               pipeline_passes=passes, pipeline_work=work, kv_exchange=plan.context_parallel.kv_exchange)

    def _ticks(self, plan: ParallelPlan) -> tuple[int, int, float]:
        stages = plan.mesh.pipeline
        if stages == 1:
            return 0, 1, 1.0
        passes, _, work = self._pipeline_shape(stages, plan.pipeline)
        return plan.pipeline.schedule.ticks(stages, plan.microbatches), passes, work

    def evaluate(self, plan: ParallelPlan) -> Evaluation:
        w = self.workload
        sizes = plan.mesh.sizes()
        try:
            plan.validate(w.model, global_batch=w.global_batch, seq_len=w.seq_len, mesh_shape=sizes)
            state = self.state(plan)
            memory = self.memory(plan, state)
        except (ValueError, ShardingRuleError) as e:
            return Evaluation(plan, error=str(e).split("\n")[0])
        ticks, passes, work = self._ticks(plan)
        host = memory.optimizer_host + memory.host_activations
        time = estimate_time(self.profile, state, policy=self.policy(plan), flops_per_token=self.flops_per_token,
                             sizes=sizes, global_batch=w.global_batch, seq_len=w.seq_len,
                             microbatches=plan.microbatches, peak_flops=self.group.spec.peak_flops, links=self.links,
                             devices_per_node=self.group.spec.devices_per_node, host_bytes=host,
                             host_gbps=self.host_gbps, pipeline_ticks=ticks, pipeline_passes=passes,
                             pipeline_work=work, efficiency=self.efficiency,
                             kv_exchange=plan.context_parallel.kv_exchange,
                             weight_gather=weight_gather_strategy(get_rule_set(plan.rules)))
        claimed = memory.peak * (1 + self.margin)
        devices = math.prod(sizes.values())
        tokens = w.global_batch * w.seq_len / time.total
        return Evaluation(plan, memory, time, claimed, claimed <= self.budget, tokens / devices,
                          self.flops_per_token * tokens / (self.group.spec.peak_flops * devices))

    def rank(self, candidates) -> list[Evaluation]:
        """Every candidate evaluated; those that can run, fitting ones first by predicted step
        time (then peak memory), then the others by peak memory. Refused ones are dropped
        (`self.refused` counts their reasons)."""
        evaluations = [self.evaluate(c) for c in candidates]
        self.refused: dict[str, int] = {}
        for e in evaluations:
            if not e.ok:
                self.refused[e.error] = self.refused.get(e.error, 0) + 1
        runnable = [e for e in evaluations if e.ok]
        fitting = sorted((e for e in runnable if e.fits), key=lambda e: (e.time.total, e.memory.peak))
        others = sorted((e for e in runnable if not e.fits), key=lambda e: e.memory.peak)
        return fitting + others


class NoLayoutFits(ValueError):
    """No layout of the search space fits the devices' memory."""


def require_fit(ranked: list[Evaluation], planner: Planner) -> None:
    """NoLayoutFits saying how far the best layout is from fitting, when none fits."""
    if not ranked:
        reasons = sorted(planner.refused.items(), key=lambda kv: -kv[1])[:3]
        raise NoLayoutFits("no layout of the search space can run this model and batch: "
                           + "; ".join(f"{n} x {r}" for r, n in reasons))
    if not ranked[0].fits:
        best = ranked[0]
        raise NoLayoutFits(
            f"no layout fits {planner.group.spec.kind}'s memory: the smallest, {best.candidate.label()}, needs "
            f"{best.claimed_bytes / 2**30:.1f} GiB per device (predicted peak {best.memory.peak / 2**30:.1f} GiB "
            f"+ {planner.margin:.0%} margin) against {planner.budget / 2**30:.1f} GiB usable "
            f"({best.claimed_bytes / planner.budget:.2f}x); more devices, a shorter sequence or a smaller batch "
            f"would be needed")
