"""Predicted memory per device of one train step: the state (exact) and the step's peak.

    state     parameters + Adam moments + the batch: state_bytes.py, exact
    temp      what the step allocates beyond its arguments, the larger of two phases:

      backward  = saved activations of every layer (layer_profile.py, under the remat policy;
                  without remat a MoE layer with an expert exchange also keeps the rows it
                  received, EP x its own slots: exchange_saved; MLA under a per-head context
                  exchange its per-head keys/values: context_kv.py)
                + the gradient accumulators (float32, laid out like the optimizer state)
                + one more set of them when microbatches are accumulated
                + the larger of
                    one layer's backward: its residuals without remat (recomputed), its weights
                      gathered by FSDP in float32 and their float32 gradient before the
                      reduce-scatter; a MoE layer's [slots, embed] un-sort buffers (platform)
                    the head: embedding / LM head weights gathered, their gradients, and one
                      loss chunk of float32 logits (logits, softmax, their gradient)
      update    = what the guarded update (jaxtrain/training/guarded_update.py) holds: the
                  finite check is reductions only, then AdamW runs under `lax.cond` over the
                  donated state (update_phase below): the new parameters are the conditional's
                  own result, copied over the old ones afterwards, so a parameter laid out like
                  its optimizer state (dp, FSDP) is held twice for a moment; one whose optimizer
                  state is split further (ZeRO-1) leaves the conditional on the optimizer layout
                  and is gathered leaf by leaf: the largest such leaf, gathered and not yet
                  copied, beside its value on the optimizer layout

      pipeline  the stage program keeps every microbatch's saved activations for each tick it
                is in flight (GPipe: M + S - 1 ticks' inputs per stage) instead of one batch's

`Platform` says how the compiler stores things: XLA:CPU computes bf16 in float32 and keeps
the float32 activations, so the CPU prediction (what `--verify` compiles) holds 2-byte
activations at 4 bytes; GPUs keep them in the compute dtype.
"""
from __future__ import annotations

import dataclasses

from jaxtrain.planner.context_kv import per_head_kv_backward, per_head_kv_saved
from jaxtrain.planner.layer_profile import ModelProfile, TokenShape, pipelined_policy
from jaxtrain.planner.state_bytes import StateBytes
from jaxtrain.meshes.context_settings import RingKV

F32 = 4
LOGIT_COPIES = 2  # float32 logits and their gradient, per loss chunk
BATCH_ARRAYS = 5  # inputs, targets, segment_ids, positions, loss_mask: 4 bytes per token each


@dataclasses.dataclass(frozen=True)
class Platform:
    """How a compiler stores what the model counts. The GPU figures are the model's own; the CPU
    ones describe XLA:CPU, which `--verify` and the tests compile on: it computes bf16 in
    float32 and keeps the float32 activations; its grouped matmul (a loop over row tiles,
    pallas_kernels/grouped_matmul_tiled.py) holds about 2.5 more float32 copies of the gathered
    expert weights (transposes for the backward); its padded expert exchange about 3x the
    buffers of the ragged one (masks, ids, float32 copies). The last two are fitted to compiles
    of DeepSeek-V2-Lite (FSDP 16, EP 8) and Nemotron-3-Nano and hold at DeepSeek-V2 236B with EP 32."""
    name: str
    widen_half: bool  # 2-byte float activations held as float32
    expert_weight_copies: float = 0.0  # extra float32 copies of a MoE layer's gathered experts
    exchange_factor: float = 1.0  # the expert exchange's buffers relative to the ragged exchange's


    # Without remat, every MoE layer keeps the activations of the rows its expert exchange
    # received for its backward pass (beyond the layer's own slots, which the traced residuals
    # hold): (embed, expert hidden) elements per received row. A GPU keeps the sorted rows and
    # the experts' gate, up and activation outputs in the compute dtype; XLA:CPU keeps more in
    # float32 (its padded exchange and the tile loop's copies).
    exchange_saved: tuple[float, float] = (1.0, 3.0)
    # ... and then the layer's backward needs only the gradients' buffers, (embed, hidden)
    # elements per received row, times `exchange_factor` (None: the forward's and backward's
    # buffers, as a recomputed layer).
    exchange_backward: tuple[float, float] | None = None
    # A MoE layer's backward differentiates the un-sort of its expert outputs to slot order
    # (meshes/experts.py `per_slot.at[order].set(out)`): [own routed slots, embed] buffers of 4
    # bytes beyond the traced residuals. XLA:CPU holds six at the peak (JAX's scatter JVP: uint32
    # slot ids scattered and gathered back, the tangent scatter's float32 operand, its zeros and
    # their copy, the rows in float32). Not measured on a GPU: none counted there, though the
    # uint32 ids are JAX's, not the platform's.
    slot_backward_copies: float = 0.0

    def held_itemsize(self, itemsize: int) -> int:
        """Bytes per element an activation of `itemsize` bytes takes where this compiler holds it."""
        return 2 * itemsize if self.widen_half and itemsize == 2 else itemsize


GPU = Platform("gpu", widen_half=False)
# XLA:CPU's exchange constants are fitted to DeepSeek-style MoE compiles (embed 2048, expert width
# 1024 and 2048, EP 8 and 16, 3 and 6 MoE layers, with and without a pipeline): per received
# row, without remat, 1.2 x embed + 5.56 x hidden float32 values kept per layer and 6.9 x
# embed + 0.54 x hidden in the layer's backward (/ exchange_factor here).
CPU = Platform("cpu", widen_half=True, expert_weight_copies=2.5, exchange_factor=3.0,
               exchange_saved=(1.2, 5.56), exchange_backward=(2.3, 0.18), slot_backward_copies=6.0)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    params: float
    optimizer: float  # device memory (host-offloaded moments are in optimizer_host)
    optimizer_host: float
    batch: float
    saved_activations: float  # every layer's residuals kept for the backward pass
    gradients: float
    layer_backward: float  # the largest layer's backward working set
    head: float  # LM head / embedding phase
    update: float  # the optimizer phase
    temp: float
    host_activations: float = 0.0  # offloaded activations (remat offload_dots)

    @property
    def arguments(self) -> float:
        return self.params + self.optimizer + self.batch

    @property
    def peak(self) -> float:
        return self.arguments + self.temp


def saved_activations(profile: ModelProfile, policy: str, shape: TokenShape, pipelined: bool = False,
                      extra: dict | None = None) -> tuple[float, float]:
    """(device, host) bytes of the residuals every layer keeps for the backward pass, plus
    `extra` bytes per layer of a kind. A switch over kinds (models/layers/layer_scan.py) keeps
    what every kind in it would save, per layer, unless only the layer input is kept (`full`):
    a pattern stack switches over its kinds; a pipeline stage (`pipelined`) keeps each kind's own
    residuals whatever its loop (models/stage_program.stage_loop: run by run; under `full` with
    alternating kinds the switch with its own VJP, models/layers/kind_residuals.py; a plain switch
    only when chosen).
    (A tied switched stage's XLA temp measured within 11% of run by run under `full`:
    tests/test_layer_scan.py.)"""
    extra = extra or {}
    device_policy = "full" if policy == "offload_dots" else policy
    per_kind = {k.kind: k.bytes(device_policy, shape) for k in profile.kinds}
    host_kind = {k.kind: k.bytes("dots_no_batch", shape) if policy == "offload_dots" else 0.0
                 for k in profile.kinds}
    switched = [] if pipelined else [k.kind for k in profile.kinds if k.in_pattern]
    switched = switched if len(switched) > 1 else []
    device = host = 0.0
    for path in profile.sequence:
        if path in switched and device_policy != "full":
            device += sum(per_kind[p] + extra.get(p, 0.0) for p in switched)
        else:
            device += per_kind[path] + extra.get(path, 0.0)
        host += host_kind[path]
    return device, host


EXCHANGE_COPIES = 4  # routed tokens received, expert outputs sent back, and both gradients
EXPERT_HIDDEN_COPIES = 3  # gate, up and activation outputs of the received rows
GATED_EXPERT_MATRICES = 3  # gate, up, down: the expert the hidden copies are counted for


def received_rows(kind, leaves, sizes: dict[str, int], shape: TokenShape) -> tuple[float, int, int]:
    """(rows a device's expert exchange receives into, EP size, ETP size) for one MoE layer.
    With a capacity factor every expert takes at most cf x its share of the slots from each
    peer, so a device receives cf x its own slots' worth. Dropless expert parallelism sizes the
    receive buffer for every slot of every peer
    (meshes/expert_exchange.py: static shapes; ragged on GPU, padded on CPU, the same size):
    EP x the layer's own routed slots. Each device routes its share of the tokens: 1 / EDP of
    them (EDP: the axes its experts are replicated over)."""
    expert_leaves = [leaf for leaf in leaves if "experts" in leaf.names]
    if not kind.top_k or not expert_leaves:
        return 0.0, 1, 1
    leaf = expert_leaves[0]
    ep_axes = [a for a in leaf.compute_axes if a in ("data", "context", "expert")]
    ep = 1
    for a in ep_axes:
        ep *= sizes[a]
    etp = sizes["tensor"] if "tensor" in leaf.compute_axes else 1
    edp = sizes["tensor"] if etp == 1 else 1
    slots = shape.rows * shape.length / edp * kind.top_k
    if kind.capacity_factor is not None:  # fixed [peers, local experts, capacity] buffers: cf x the slots
        return slots * kind.capacity_factor, ep, etp
    return ep * slots, ep, etp


def exchange_buffers(kind, leaves, sizes: dict[str, int], shape: TokenShape, profile: ModelProfile,
                     platform: Platform, policy: str = "full") -> float:
    """Bytes of the received rows beyond the layer's own slots (the traced residuals hold
    those) in one layer's backward: tokens in, outputs back and both gradients, and the
    experts' hidden activations; without remat (`policy` none) the forward's part is kept per
    layer instead (exchange_saved) and the backward holds the platform's exchange_backward."""
    copies = (EXCHANGE_COPIES, EXPERT_HIDDEN_COPIES)
    if policy == "none" and platform.exchange_backward is not None:
        copies = platform.exchange_backward
    return _received_row_bytes(kind, leaves, sizes, shape, profile, platform, copies) * platform.exchange_factor


def slot_backward_buffers(kind, leaves, sizes: dict[str, int], shape: TokenShape, profile: ModelProfile,
                          platform: Platform) -> float:
    """Bytes of the platform's [own routed slots, embed] 4-byte buffers in one MoE layer's
    backward (Platform.slot_backward_copies). The slots are the tokens this device routes
    (1 / EDP of its rows) times top-k; with expert tensor parallelism no axis splits them, so
    they grow with the tensor size relative to a plain MoE layer."""
    rows, ep, _ = received_rows(kind, leaves, sizes, shape)
    if not rows or kind.capacity_factor is not None:
        return 0.0
    own_slots = rows / ep
    return own_slots * profile.embed * F32 * platform.slot_backward_copies


def exchange_saved(kind, leaves, sizes: dict[str, int], shape: TokenShape, profile: ModelProfile,
                   platform: Platform, policy: str) -> float:
    """Bytes one MoE layer keeps for its backward pass of the rows its exchange received beyond
    its own slots: only without remat (under `full` and `dots_no_batch` the layer recomputes
    them; `dots` is not measured and is counted as none of them)."""
    if policy != "none":
        return 0.0
    return _received_row_bytes(kind, leaves, sizes, shape, profile, platform, platform.exchange_saved)


def _received_row_bytes(kind, leaves, sizes, shape, profile, platform, copies: tuple[float, float]) -> float:
    """(embed, hidden) `copies` elements of the compute dtype (widened where the platform
    widens) per received row beyond the layer's own slots; 0 without an exchange or with fixed
    capacity buffers (the traced layer's own size)."""
    rows, ep, etp = received_rows(kind, leaves, sizes, shape)
    if ep == 1 or kind.capacity_factor is not None:
        return 0.0
    expert_leaves = [leaf for leaf in leaves if "experts" in leaf.names]
    hidden = _expert_hidden(expert_leaves, profile.embed)
    # The hidden copies are a gated expert's (gate, up, down: three hidden-wide values per
    # row); an ungated one (up, down) holds two thirds of them.
    matrices = sum("expert_mlp" in leaf.names for leaf in expert_leaves) or GATED_EXPERT_MATRICES
    per_row = (copies[0] * profile.embed + copies[1] * matrices / GATED_EXPERT_MATRICES * hidden / etp
               ) * platform.held_itemsize(profile.compute_itemsize)
    return rows * (ep - 1) / ep * per_row


def _expert_hidden(expert_leaves, embed: int) -> int:
    """One routed expert's hidden width, from its weights' logical names."""
    for leaf in expert_leaves:
        if "expert_mlp" in leaf.names:
            return leaf.shape[leaf.names.index("expert_mlp")]
    return embed


def update_phase(leaves) -> float:
    """Temp bytes of the guarded optimizer update (module docstring), as XLA compiles it:
    `python benchmarks/update_memory.py --gin_file=configs/llama3_8b.gin --layout L` (GiB per
    device): data=16,rules=fsdp 1.87 = the parameters (1.00 moment); data=4,tensor=4,rules=dp
    7.48 = the parameters; data=4,tensor=4,rules=zero1 2.31 = an MLP weight gathered to its
    tensor-only layout (1.75) + its optimizer-layout copy (0.44) + the next leaf's start (0.12);
    data=16,rules=zero1 7.94 = 7.00 + 0.44 + 0.50. Not modelled: ZeRO-1 without gradient
    clipping (`OptimizerConfig.clip_norm=None`) holds every gathered leaf at once (4.00 moments
    for data=4,tensor=4, the parameters' size)."""
    split_further = [leaf for leaf in leaves
                     if leaf.optimizer_bytes_per_device * leaf.itemsize < leaf.bytes_per_device * F32]
    new_params = sum(leaf.bytes_per_device for leaf in leaves if leaf not in split_further)
    gathered = max((leaf.bytes_per_device + leaf.optimizer_bytes_per_device for leaf in split_further), default=0.0)
    return new_params + gathered


def estimate_memory(profile: ModelProfile, state: StateBytes, *, policy: str, sizes: dict[str, int],
                    rules_name: str, global_batch: int, seq_len: int, microbatches: int, loss_chunk: int,
                    platform: Platform = GPU, pipeline_ticks: int = 0, pipeline_passes: int = 1,
                    pipeline_work: float = 1.0, kv_exchange=RingKV()) -> MemoryEstimate:
    """The memory of one train step per device (module docstring), the model's layers under
    remat `policy`. With a pipeline: the ticks and passes of its schedule, and a stage's slots
    per pass relative to an even share of the layers (`pipeline_work`, > 1 with padding).
    `kv_exchange`: the plan's K/V exchange over `context` (MLA's per-head keys/values: context_kv.py)."""
    data_parallel = sizes["data"] * sizes["expert"]
    rows = global_batch / microbatches / data_parallel
    length = seq_len / sizes["context"]
    shape = TokenShape(rows=rows, length=length, full_length=seq_len, tensor=sizes["tensor"],
                       sequence_parallel=rules_name.split("+")[0].endswith("_sp"), widen_half=platform.widen_half)
    # XLA:CPU widens the activations it keeps across the scan of layers, not the transient ones;
    # one layer's backward works on the gathered sequence under sequence parallelism
    working = dataclasses.replace(shape, widen_half=False, sequence_parallel=False)
    if sizes["pipeline"] > 1:
        policy = pipelined_policy(policy, pipeline_passes)
    layer_leaves = [leaf for leaf in state.leaves if leaf.in_layers]
    kind_leaves = {k.kind: [leaf for leaf in layer_leaves if tuple(leaf.path[:len(k.kind)]) == k.kind]
                   for k in profile.kinds}
    kept_exchange = {k.kind: exchange_saved(k, kind_leaves[k.kind], sizes, working, profile, platform, policy)
                     for k in profile.kinds}
    # MLA under a per-head context exchange keeps per-head keys/values, not the traced latent's
    kv_itemsize = platform.held_itemsize(profile.compute_itemsize)
    kv_tokens = working.rows * working.length
    for k in profile.kinds:
        kept_exchange[k.kind] += per_head_kv_saved(kind_leaves[k.kind], kv_exchange, sizes["context"], kv_tokens,
                                                   kv_itemsize, policy)
    saved, host_saved = saved_activations(profile, policy, shape, pipelined=sizes["pipeline"] > 1, extra=kept_exchange)
    if sizes["pipeline"] > 1:
        # A stage keeps its slots' activations for every tick it has a microbatch in flight.
        in_flight = pipeline_work * pipeline_ticks / (sizes["pipeline"] * pipeline_passes)
        saved, host_saved = saved * in_flight, host_saved * in_flight

    # Gradients are laid out like the optimizer state (XLA reduce-scatters them for a sharded
    # optimizer: ZeRO-1 holds ZeRO-3's gradients).
    moment = sum(leaf.optimizer_bytes_per_device for leaf in state.leaves)  # float32, like one Adam moment
    gradients = moment * (2 if microbatches > 1 else 1)

    other_leaves = [leaf for leaf in state.leaves if not leaf.in_layers]
    def unreduced_gradients(leaves) -> float:
        """Float32 gradients at the compute layout, where the optimizer layout is split further
        (FSDP, ZeRO-1): they exist until reduce-scattered."""
        return sum(F32 / leaf.itemsize * leaf.gathered_bytes for leaf in leaves
                   if leaf.optimizer_bytes_per_device < leaf.gathered_bytes * leaf.layer_count)

    def gathered_copies(leaves) -> float:  # FSDP's float32 copy of a weight, gathered for compute
        return sum(leaf.gathered_bytes * (1 + (platform.expert_weight_copies if "experts" in leaf.names else 0))
                   for leaf in leaves if leaf.gather_axes)

    layer_backward = 0.0
    for kind in profile.kinds:
        leaves = kind_leaves[kind.kind]
        layer_backward = max(layer_backward, kind.bytes("none", working) + gathered_copies(leaves)
                             + unreduced_gradients(leaves) + exchange_buffers(kind, leaves, sizes, working,
                                                                               profile, platform, policy)
                             + slot_backward_buffers(kind, leaves, sizes, working, profile, platform)
                             + per_head_kv_backward(leaves, kv_exchange, sizes["context"], kv_tokens, kv_itemsize))
    compute_itemsize = profile.compute_itemsize
    # The LM head (or the tied embedding) cast to the compute dtype for the logits' matmul.
    head_leaves = ([leaf for leaf in other_leaves if leaf.names[-1:] == ("vocab",)]
                   or [leaf for leaf in other_leaves if "vocab" in leaf.names])  # tied: the embedding
    head_weights = sum(leaf.gathered_bytes * compute_itemsize / leaf.itemsize for leaf in head_leaves)
    vocab_local = profile.vocab / sizes["tensor"]
    logits = rows * min(loss_chunk, length) * vocab_local * (F32 * LOGIT_COPIES + compute_itemsize)
    head = head_weights + unreduced_gradients(other_leaves) + logits

    backward = saved + gradients + max(layer_backward, head)
    update = update_phase(state.leaves)
    batch = BATCH_ARRAYS * 4 * global_batch * seq_len / (data_parallel * sizes["context"])
    return MemoryEstimate(params=state.params, optimizer=state.optimizer, optimizer_host=state.optimizer_host,
                          batch=batch, saved_activations=saved, gradients=gradients, layer_backward=layer_backward,
                          head=head, update=update, temp=max(backward, update), host_activations=host_saved)
