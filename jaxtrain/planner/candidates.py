"""The layouts the planner considers for a model on a number of devices.

A candidate is a ParallelPlan: the five axis sizes, a rule table with overlays, microbatches,
the pipeline schedule and the model's remat policy (`plan.remat`, which overrides the model
config's where the model is built). The search space is what a person would try by hand, written
down:

    tensor      within a node (divides devices_per_node), never more than 8
    pipeline    1, 2, 4, 8 stages (at most the layers), GPipe or interleaved with 2 passes
    context     1, 2, 4, 8 (the sequence a multiple of 2 x context)
    expert      only for models with routed experts
    data        the devices left
    rules       dp, zero1, fsdp (+ the sequence-parallel variants with tensor > 1); for MoE
                models also experts folded over the token axes and expert tensor parallelism;
                optimizer state in host memory (`+opt_host`) with ZeRO-1 and FSDP
    microbatches  1, 2, 4, 8 (with a pipeline: pipeline, 2 x and 4 x pipeline)
    remat       none, dots_no_batch, full, offload_dots

Combinations a run would refuse (a batch that does not divide, heads that tensor does not
divide) are dropped when evaluated, with the reason counted.
"""
from __future__ import annotations

import dataclasses
import itertools

from jaxtrain.planner.layer_profile import pipelined_policy
from jaxtrain.training.parallel_plan import ParallelPlan
from jaxtrain.meshes.mesh_config import MeshConfig
from jaxtrain.meshes.pipeline_schedules import GPipe, Interleaved

REMAT_POLICIES = ("none", "dots_no_batch", "full", "offload_dots")
BASE_RULES = ("dp", "zero1", "fsdp")
SEQUENCE_PARALLEL = ("dp_sp", "fsdp_sp")
HOST_OPTIMIZER_BASES = ("zero1", "fsdp")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def axis_sizes(devices: int, *, devices_per_node: int, layers: int, seq_len: int, has_experts: bool):
    """Every (pipeline, data, context, expert, tensor) of the search space for `devices`."""
    for tensor in _divisors(devices):
        if tensor > min(8, devices_per_node) or devices_per_node % tensor:
            continue
        for pipeline in (p for p in (1, 2, 4, 8) if devices % (tensor * p) == 0 and p <= layers):
            for context in (c for c in (1, 2, 4, 8) if devices % (tensor * pipeline * c) == 0
                            and seq_len % (2 * c) == 0):
                rest = devices // (tensor * pipeline * context)
                for expert in (_divisors(rest) if has_experts else [1]):
                    yield {"pipeline": pipeline, "data": rest // expert, "context": context, "expert": expert,
                           "tensor": tensor}


def rule_names(sizes: dict[str, int], has_experts: bool, host_optimizer: bool) -> list[str]:
    bases = list(BASE_RULES) + (list(SEQUENCE_PARALLEL) if sizes["tensor"] > 1 else [])
    overlays = [""]
    if has_experts:
        overlays += ["+experts_folded"] + (["+expert_tp", "+experts_folded+expert_tp"] if sizes["tensor"] > 1 else [])
    names = [b + o for b in bases for o in overlays]
    if host_optimizer:
        names += [n + "+opt_host" for n in names if n.split("+")[0].removesuffix("_sp") in HOST_OPTIMIZER_BASES]
    return names


def microbatch_counts(global_batch: int, data_parallel: int, pipeline: int) -> list[int]:
    rows = global_batch // data_parallel if global_batch % data_parallel == 0 else 0
    options = (pipeline, 2 * pipeline, 4 * pipeline) if pipeline > 1 else (1, 2, 4, 8)
    return [m for m in options if rows and rows % m == 0]


def schedules(pipeline: int, layers: int):
    if pipeline == 1:
        return [GPipe()]
    out = [GPipe()]
    if layers >= 2 * pipeline:
        out.append(Interleaved(2))
    return out


def candidates(devices: int, *, devices_per_node: int, layers: int, seq_len: int, global_batch: int,
               has_experts: bool, remats=REMAT_POLICIES, host_optimizer: bool = True,
               base: ParallelPlan = ParallelPlan()):
    """Every plan of the search space (module docstring), `base`'s other settings kept."""
    for sizes in axis_sizes(devices, devices_per_node=devices_per_node, layers=layers, seq_len=seq_len,
                            has_experts=has_experts):
        mesh = MeshConfig(**sizes)
        data_parallel = sizes["data"] * sizes["expert"]
        for rules, microbatches, schedule, remat in itertools.product(
                rule_names(sizes, has_experts, host_optimizer),
                microbatch_counts(global_batch, data_parallel, sizes["pipeline"]),
                schedules(sizes["pipeline"], layers), remats):
            if sizes["pipeline"] > 1 and pipelined_policy(remat, schedule.virtual_stages) != remat:
                continue  # the same program as another policy's inside a pipeline stage
            yield dataclasses.replace(base, mesh=mesh, rules=rules, microbatches=microbatches, schedule=schedule,
                                      split=None, remat=remat)
