"""Predicted time of one train step: compute, each collective over the link it crosses, the
pipeline bubble, and what overlaps.

    compute     executed FLOPs per device / (peak x matmul efficiency); executed = the model's
                FLOPs (6 x active matmul parameters + attention + SSD scan, per token), plus one
                more forward pass under remat `full` (a third of the 6N) and a sixth of it under
                the `dots` policies, plus the padded slots of a pipeline's stages
    collectives bus bytes per device (the nccl-tests convention: all-reduce 2(n-1)/n of the
                buffer, all-gather / reduce-scatter / all-to-all (n-1)/n, permute 1) / the link's
                bandwidth, for
                  FSDP      each layer's weights gathered for the forward and again for the
                            backward, per microbatch; gradients reduce-scattered (float32)
                  DP        gradients all-reduced over the axes a parameter is replicated on
                  ZeRO-1    gradients reduce-scattered, updated parameters all-gathered
                  tensor    one all-reduce of the layer output per row-parallel weight (those
                            mapping a tensor-split dimension to the model width), forward,
                            backward and the remat recompute
                  experts   all-to-all of the routed token copies there and back, forward,
                            backward and recompute
                  context   each attention layer's keys/values around the ring (MLA: per-head
                            keys/values, or its latent under kv=latent: context_kv.py),
                            forward, and keys/values plus their gradients backward
                  pipeline  each tick's activations to the next stage and gradients back
    overlap     FSDP gathers, gradient reductions and ring exchanges run beside the compute
                (hidden up to the compute time); tensor and expert exchanges sit on the
                critical path
    pipeline    the step takes ticks / (microbatches x passes) times the work of one pass

The matmul efficiency (`Efficiency`) and the links' reach of their data-sheet bandwidth
(links.py) are assumptions, stated in the planner's output: the ranking depends on them less
than the absolute times do.
"""
from __future__ import annotations

import dataclasses

from jaxtrain.planner.context_kv import exchanged_width
from jaxtrain.planner.layer_profile import ModelProfile, pipelined_policy
from jaxtrain.planner.links import BETWEEN_GROUPS, LinkTable, slowest_link
from jaxtrain.planner.state_bytes import TOKEN_AXES, StateBytes
from jaxtrain.meshes.context_settings import RingKV
from jaxtrain.meshes.weight_gather import CastWhereUsed

F32 = 4
RECOMPUTE = {"none": 0.0, "full": 1 / 3, "dots": 1 / 6, "dots_no_batch": 1 / 6, "offload_dots": 1 / 6}


@dataclasses.dataclass(frozen=True)
class Efficiency:
    matmul: float = 0.65  # fraction of peak FLOP/s the step's matmuls reach


@dataclasses.dataclass(frozen=True)
class StepTime:
    compute: float
    hidden_comm: float  # collectives that overlap the compute (FSDP, gradients, ring)
    exposed_comm: float  # collectives on the critical path (tensor, experts, pipeline)
    bubble: float  # pipeline idle time
    by_kind: dict  # collective kind -> seconds
    bytes_by_kind: dict  # collective kind -> bus bytes per device per step

    @property
    def total(self) -> float:
        return max(self.compute, self.hidden_comm) + self.exposed_comm + self.bubble


def _bus(op: str, n: int, nbytes: float) -> float:
    if n <= 1:
        return 0.0
    return nbytes * {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
                     "all_to_all": (n - 1) / n, "permute": 1.0}[op]


def _size(axes, sizes) -> int:
    n = 1
    for a in axes:
        n *= sizes[a]
    return n


def estimate_time(profile: ModelProfile, state: StateBytes, *, policy: str, flops_per_token: float,
                  sizes: dict[str, int], global_batch: int, seq_len: int, microbatches: int, peak_flops: float,
                  links: LinkTable, devices_per_node: int, host_bytes: float = 0.0, host_gbps: float = 25.0,
                  pipeline_ticks: int = 0, pipeline_passes: int = 1, pipeline_work: float = 1.0,
                  efficiency: Efficiency = Efficiency(), group_axes: tuple = (), kv_exchange=RingKV(),
                  weight_gather=CastWhereUsed()) -> StepTime:
    """`pipeline_work`: a stage's work per pass relative to an even share of the layers (padding);
    `host_bytes`: bytes per device that go to host memory and back each step (optimizer state
    with `+opt_host`, offloaded activations) over a `host_gbps` link; `group_axes`: axes whose
    collectives cross between device groups (mixed clusters); `kv_exchange`: the plan's K/V
    exchange over `context` (what MLA moves: context_kv.py); `weight_gather`: the rule set's FSDP
    gather strategy (meshes/weight_gather.py): one that casts before it gathers moves the compute
    dtype's bytes, else the stored float32 is counted (where XLA places the convert is its choice)."""
    devices = _size(sizes, sizes)
    if sizes["pipeline"] > 1:
        policy = pipelined_policy(policy, pipeline_passes)
    model_flops = flops_per_token * global_batch * seq_len
    executed = model_flops * (1 + RECOMPUTE.get(policy, 0.0)) * pipeline_work
    compute = executed / devices / (peak_flops * efficiency.matmul)
    by_kind: dict[str, float] = {}
    bytes_by_kind: dict[str, float] = {}

    def add(kind: str, op: str, axes, nbytes: float, repeats: float = 1.0):
        axes = tuple(a for a in axes if sizes[a] > 1)
        if not axes or not nbytes:
            return
        link = BETWEEN_GROUPS if set(axes) & set(group_axes) else slowest_link(axes, sizes, devices_per_node)
        bus = repeats * _bus(op, _size(axes, sizes), nbytes)
        by_kind[kind] = by_kind.get(kind, 0.0) + links.seconds(link, bus)
        bytes_by_kind[kind] = bytes_by_kind.get(kind, 0.0) + bus

    data_parallel = sizes["data"] * sizes["expert"]
    stage_layers = 1.0 / sizes["pipeline"]
    rows = global_batch / microbatches / data_parallel  # per device per microbatch
    tokens = rows * seq_len / sizes["context"]
    passes = 3 if policy == "full" else 2  # forward, backward (+ the recompute's forward)
    compute_bytes = profile.compute_itemsize
    per_microbatch = microbatches  # FSDP and gradient collectives repeat per microbatch

    for leaf in state.leaves:
        layers = leaf.layer_count if leaf.in_layers else 1
        full = leaf.gathered_bytes * layers  # this device's compute share, float32
        if leaf.gather_axes:
            on_wire = compute_bytes / leaf.itemsize if weight_gather.casts_before_gather else 1.0
            add("fsdp", "all_gather", leaf.gather_axes, full * min(on_wire, 1.0), 2 * per_microbatch)
        replicated = tuple(a for a in TOKEN_AXES if a not in leaf.compute_axes)
        if "experts" in leaf.names and "tensor" not in leaf.compute_axes:
            replicated += ("tensor",)  # expert data parallel: each tensor rank routed its share of the tokens
        sharded_for_optimizer = leaf.optimizer_bytes_per_device * layers < full if leaf.in_layers \
            else leaf.optimizer_bytes_per_device < full
        if sharded_for_optimizer:
            add("gradients", "reduce_scatter", replicated, full * F32 / leaf.itemsize, per_microbatch)
            if not leaf.gather_axes:  # ZeRO-1: the updated parameters come back whole
                add("gradients", "all_gather", replicated, full)
        else:
            add("gradients", "all_reduce", replicated, full * F32 / leaf.itemsize, per_microbatch)

    for kind in profile.kinds:
        layers_here = kind.count * stage_layers * microbatches
        leaves = [leaf for leaf in state.leaves if leaf.in_layers and tuple(leaf.path[:len(kind.kind)]) == kind.kind]
        row_parallel = sum(1 for leaf in leaves if leaf.names[-1] in ("embed", "expert_embed")
                           and "tensor" in leaf.compute_axes)
        activation = tokens * profile.embed * compute_bytes
        if kind.top_k:
            routed = activation * kind.top_k
            expert_axes = next((leaf_axes(leaf) for leaf in leaves if "experts" in leaf.names), ())
            add("experts", "all_to_all", expert_axes, routed, 2 * passes * layers_here)
            if row_parallel:  # partial outputs of expert tensor parallelism, per routed copy
                add("tensor", "all_reduce", ("tensor",), routed, passes * layers_here)
                row_parallel -= sum(1 for leaf in leaves if leaf.names[-1] == "expert_embed")
        add("tensor", "all_reduce", ("tensor",), activation * row_parallel, passes * layers_here)
        kv = exchanged_width(leaves, profile.embed, kv_exchange) * tokens * compute_bytes
        ring = sizes["context"] - 1
        add("context", "permute", ("context",), kv * ring, (passes - 1 + 2) * layers_here)

    if sizes["pipeline"] > 1:
        activation = rows * seq_len / sizes["context"] * profile.embed * compute_bytes
        add("pipeline", "permute", ("pipeline",), activation, 2 * pipeline_ticks)

    if host_bytes:
        by_kind["host"] = 2 * host_bytes / (host_gbps * 1e9)
    hidden = sum(by_kind.get(k, 0.0) for k in ("fsdp", "gradients", "context"))
    exposed = sum(by_kind.get(k, 0.0) for k in ("tensor", "experts", "pipeline", "host"))
    bubble = 0.0
    if sizes["pipeline"] > 1 and pipeline_ticks:
        busy = microbatches * pipeline_passes
        bubble = compute * (pipeline_ticks - busy) / busy
    return StepTime(compute, hidden, exposed, bubble, by_kind, bytes_by_kind)


def leaf_axes(leaf) -> tuple:
    """The axes a routed-expert weight's experts are split over (expert parallelism)."""
    return tuple(a for a in leaf.compute_axes if a in TOKEN_AXES + ("expert",))
