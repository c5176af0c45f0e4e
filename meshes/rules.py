"""Logical-axis rule tables: which mesh axes each logical dimension name is split over.

Models name every parameter and activation dimension logically (`embed`, `heads`, `mlp`,
`batch`, `length`, ...). A RuleSet maps those names to mesh axes, separately for
parameters, activations and optimizer state, so data parallel, FSDP/ZeRO, tensor parallel
and sequence parallel are different tables over the same model code.

Every logical name is declared once in `LOGICAL_NAMES` with its meaning; a name that is not
declared there is an error (`ShardingRuleError`), so a typo cannot silently replicate a weight.

Resolution of one tensor walks its dimensions in order; each takes the mesh axes its rule
names, skipping axes an earlier dimension of the same tensor already took and axes of size 1.
A dimension that the product of its axes does not divide is an error naming the dimension and
the axes, unless its name is declared to replicate instead (`Indivisible.REPLICATE`: an odd
vocabulary; `Indivisible.REPLICATE_SINGLE`: a dimension of size 1, e.g. multi-query attention's
one key/value head or Mamba-2's one B/C group): then it keeps the longest prefix of its axes
that divides (often none).
`jaxtrain/training/state.py` runs this for every parameter when the state's shardings are built,
before anything is compiled, and names the parameter path in the error; activations are
checked the same way when a step is traced (`constrain`).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import math
from typing import Mapping, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

Table = Mapping[str, tuple[str, ...]]
DATA_PARALLEL_AXES = ("data", "expert")  # expert acts as data parallel for dense parts


class ShardingRuleError(ValueError):
    """A logical name no one declared, or a dimension its mesh axes do not divide.

    `reason` is the short cause ("heads=6 is not divisible by tensor=4"); the message adds the
    tensor's shape, its logical names and the rule table's name where known."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason or message


# ---- the logical names ----------------------------------------------------------------------

class Indivisible(enum.Enum):
    ERROR = "error"  # a dimension its axes do not divide is an error
    REPLICATE = "replicate"  # keep the longest prefix of the axes that divides (often none)
    REPLICATE_SINGLE = "replicate_single"  # a size-1 dimension stays whole; any other size must divide


@dataclasses.dataclass(frozen=True)
class LogicalName:
    meaning: str
    indivisible: Indivisible = Indivisible.ERROR
    # A yielding name takes only the axes its tensor's other names leave free, wherever it stands:
    # a split kept for memory alone must not take an axis from the split the compute relies on.
    yields: bool = False


def _n(meaning: str, indivisible: Indivisible = Indivisible.ERROR, yields: bool = False) -> LogicalName:
    return LogicalName(meaning, indivisible, yields)


LOGICAL_NAMES: dict[str, LogicalName] = {
    # activations
    "batch": _n("rows of a global batch or of one microbatch (data parallel)"),
    "length": _n("sequence positions inside attention / SSM / MLP layers (context parallel)"),
    "residual_length": _n("sequence positions of the residual stream between blocks (+tensor: sequence parallel)"),
    "stages": _n("pipeline stages of a stage-layout stack or of the pipeline's buffers (meshes/pipeline.py)"),
    # layer stacks
    # The canonical (on-disk) layout of a pipelined run splits each stack's layers over `pipeline`
    # only where that divides (jaxtrain/training/state_layouts.py): DeepSeek-V2-Lite's one dense layer and
    # Nemotron-3-Nano's 23 Mamba layers on pipeline=2 stay whole there. Compute uses the stage
    # layout (`stages`), so this only sets where a save's temporary copy lives.
    "layers": _n("layer index of a scanned stack (models/layers/stack.py, pattern_stack.py)",
                 Indivisible.REPLICATE),
    # widths
    "embed": _n("the model width of weights and of the residual stream (FSDP splits weights' embed)"),
    "norm": _n("the width an RMSNorm scale runs over (kept whole: a few KiB per layer)"),
    # Vocabulary sizes are set by tokenizers (GPT-2's 50257, byte vocabularies): an odd one stays
    # replicated over tensor rather than failing; the loss works on either layout.
    "vocab": _n("vocabulary rows of the embedding / columns of the head and of the logits",
                Indivisible.REPLICATE),
    # attention
    "heads": _n("attention query heads (and MLA's per-head up-projections; tensor parallel)"),
    # One key/value head (multi-query attention: Gemma-2B, Falcon-7B) is shared by every query
    # head and stays whole on each tensor rank, as Megatron does; the per-device attention kernels
    # then pair each local query head with it correctly. Two or more that tensor does not divide
    # would pair local query heads with the wrong key/value heads: an error.
    "kv_heads": _n("key/value heads of grouped-query attention (tensor parallel with the heads)",
                   Indivisible.REPLICATE_SINGLE),
    "head_dim": _n("width of one attention head, MLA's rope key width (kept whole)"),
    # FSDP splits MLA's up-projections along their latent rank (their other dimensions are heads,
    # over tensor, and head_dim): a rank the data axes do not divide stays whole.
    "q_lora": _n("MLA's query compression rank (FSDP splits it over the data axes)", Indivisible.REPLICATE),
    "kv_lora": _n("MLA's key/value latent rank (FSDP splits it over the data axes)", Indivisible.REPLICATE),
    # feed-forward
    "mlp": _n("hidden width of dense MLPs and shared experts (tensor parallel)"),
    "experts": _n("routed experts of a MoE layer (expert parallel)"),
    "expert_embed": _n("the model width of a routed expert's weights (FSDP over its expert-data-parallel axes)"),
    "expert_mlp": _n("hidden width of one routed expert (expert tensor parallel, `+expert_tp`)"),
    "router_experts": _n("the router's per-expert scores and correction bias (kept whole: every token scores all)"),
    "moe_latent": _n("the latent width routed experts work in (Nemotron-H moe_latent_size; kept whole)"),
    # Mamba-2
    "ssm_heads": _n("Mamba-2 heads (tensor parallel like attention heads)"),
    "ssm_head_dim": _n("width of one Mamba-2 head (kept whole)"),
    # Heads are split with their B/C groups, so the SSD scan on one device sees its heads' groups.
    # One group (Mamba-2's n_groups=1) is shared by every head and stays whole on each device; two
    # or more groups that the heads' axes do not divide would pair heads with the wrong groups.
    "ssm_groups": _n("Mamba-2 B/C groups, split with their heads", Indivisible.REPLICATE_SINGLE),
    "ssm_state": _n("Mamba-2 state size (kept whole)"),
    "conv_kernel": _n("taps of the Mamba-2 short causal conv (kept whole)"),
    # Adapters (models/lora.py) take the rest of their names from the weight they adapt, so they
    # split like it. Their rank is kept whole for compute; FSDP stores it split over whichever of
    # the data, context and tensor axes the factor's other names leave free (B of a query
    # projection has no model width; A of an expert split over tensor by ETP has its hidden
    # dimension elsewhere), so no adapter factor is held whole on devices that hold its weight's parts.
    "lora_rank": _n("the rank of a low-rank adapter's two factors (FSDP stores it split over the axes "
                    "the factor's other names leave free)", Indivisible.REPLICATE, yields=True),
}


def check_names(names: Sequence[str | None], shape: Sequence[int] | None = None, what: str = "tensor") -> None:
    """Every name registered in LOGICAL_NAMES (None entries: never sharded)."""
    unknown = [n for n in names if n is not None and n not in LOGICAL_NAMES]
    if unknown:
        shape_text = f" of shape {tuple(shape)}" if shape is not None else ""
        reason = (f"unknown logical axis name {unknown[0]!r} (known: {', '.join(sorted(LOGICAL_NAMES))}; "
                  f"declare new ones in meshes/rules.py LOGICAL_NAMES)")
        raise ShardingRuleError(f"{reason} in a {what}{shape_text} named {tuple(names)}", reason)


def table_name(table: Table) -> str | None:
    return getattr(table, "name", None)


class RuleTable(dict):
    """A rule table that knows its name ("fsdp+experts_folded params"), for error messages."""

    def __init__(self, entries: Table, name: str | None = None):
        super().__init__(entries)
        self.name = name
        check_names(tuple(self), what=f"rule table {name!r}")

    def __reduce__(self):
        return (RuleTable, (dict(self), self.name))


@dataclasses.dataclass(frozen=True)
class RuleSet:
    name: str
    params: Table
    activations: Table
    optimizer: Table | None = None  # None: optimizer state follows params
    # Where the optimizer state lives between steps: "device", or "pinned_host" (overlay
    # `+opt_host`): the step brings it to the device for the update and writes it back.
    optimizer_memory: str = "device"
    # How FSDP-sharded weights are cast and gathered for compute (meshes/weight_gather.py):
    # "cast_then_gather" (the FSDP tables' default, overlay `+gather_bf16`: bf16 gathers, float32
    # gradient reductions, re-gathered in the backward; the default because it holds about what
    # casting where used holds, never gathers a weight in float32 where XLA would (experts, MLA's
    # up-projections, the embedding table) and reduces gradients closer to a float32 run),
    # "cast_then_gather_held" (`+gather_bf16_held`) or "cast_where_used" (the tables
    # that gather no weights, overlay `+cast_where_used`: XLA places the cast, bf16 gradients).
    weight_gather: str = "cast_where_used"

    def __post_init__(self):  # each table carries the set's name (also after an overlay's replace)
        for part in ("params", "activations", "optimizer"):
            table = getattr(self, part)
            if table is not None:
                object.__setattr__(self, part, RuleTable(table, f"{self.name} {part}"))

    @property
    def optimizer_table(self) -> Table:
        return self.optimizer if self.optimizer is not None else self.params


def _axes_text(axes: Sequence[str], mesh) -> str:
    text = " x ".join(f"{a}={mesh.shape[a]}" for a in axes)
    return text if len(axes) == 1 else f"{text} = {math.prod(mesh.shape[a] for a in axes)}"


def spec_for(names: Sequence[str | None], shape: Sequence[int], table: Table, mesh) -> PartitionSpec:
    """The PartitionSpec of a tensor of `shape` whose dimensions are named `names` (module docstring)."""
    if len(names) != len(shape):
        raise ShardingRuleError(f"logical axes {tuple(names)} do not match shape {tuple(shape)}")
    check_names(names, shape)
    used: set[str] = set()
    entries: list = [None] * len(names)
    # yielding names last: they take what the others leave
    order = sorted(range(len(names)), key=lambda i: bool(names[i]) and LOGICAL_NAMES[names[i]].yields)
    for i in order:
        name, dim = names[i], shape[i]
        axes = [a for a in table.get(name, ()) if a not in used and mesh.shape[a] > 1] if name else []
        if axes and dim % math.prod(mesh.shape[a] for a in axes):
            policy = LOGICAL_NAMES[name].indivisible
            if policy is Indivisible.ERROR or (policy is Indivisible.REPLICATE_SINGLE and dim != 1):
                reason = f"{name}={dim} is not divisible by {_axes_text(axes, mesh)}"
                where = f", rule table {table_name(table)!r}" if table_name(table) else ""
                raise ShardingRuleError(f"{reason} (a tensor of shape {tuple(shape)} named {tuple(names)}{where})",
                                        reason)
            while axes and dim % math.prod(mesh.shape[a] for a in axes):
                axes.pop()
        used.update(axes)
        entries[i] = None if not axes else axes[0] if len(axes) == 1 else tuple(axes)
    return PartitionSpec(*entries)


# ---- the tables ---------------------------------------------------------------------------

_ACTIVATIONS: Table = {
    "stages": ("pipeline",),  # pipeline stages (meshes/pipeline.py)
    "batch": DATA_PARALLEL_AXES,
    "length": ("context",),
    "residual_length": ("context",),  # the residual stream between blocks
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "ssm_heads": ("tensor",),  # Mamba-2 heads split like attention heads,
    "ssm_groups": ("tensor",),  # and their B/C groups with them
}
_TENSOR_PARALLEL_PARAMS: Table = {
    "stages": ("pipeline",),  # each stage's layers live on its pipeline group only
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "ssm_heads": ("tensor",),
    "ssm_groups": ("tensor",),
    "experts": ("expert",),  # expert parallel over the expert axis
}
# FSDP / ZeRO-3: the embed dimension of every weight is also split over the data-parallel axes.
# Expert weights' embed dimension takes `tensor` as well: the axes an expert is not split over
# (EP, ETP) are its expert-data-parallel axes, so it is kept 1/(EP x EDP) per device and
# gathered for compute like any FSDP weight.
_FSDP_PARAMS: Table = {**_TENSOR_PARALLEL_PARAMS, "embed": DATA_PARALLEL_AXES + ("context",),
                       "expert_embed": DATA_PARALLEL_AXES + ("context", "tensor"),
                       # MLA's q_up / kv_up [rank, heads, head_dim] have no embed dimension: without
                       # this they stay whole under FSDP (V2-Lite: 0.2 GiB of params per device).
                       "q_lora": DATA_PARALLEL_AXES + ("context",), "kv_lora": DATA_PARALLEL_AXES + ("context",),
                       # an adapter factor's rank, over the axes its other dimensions leave free
                       "lora_rank": DATA_PARALLEL_AXES + ("context", "tensor")}
# Sequence parallel: between blocks the residual stream is split over tensor as well, turning
# the tensor-parallel all-reduces into reduce-scatter + all-gather pairs.
_SEQUENCE_PARALLEL_ACTIVATIONS: Table = {**_ACTIVATIONS, "residual_length": ("context", "tensor")}

RULE_SETS: dict[str, RuleSet] = {
    r.name: r for r in (
        RuleSet("dp", _TENSOR_PARALLEL_PARAMS, _ACTIVATIONS),
        RuleSet("zero1", _TENSOR_PARALLEL_PARAMS, _ACTIVATIONS, optimizer=_FSDP_PARAMS),
        RuleSet("fsdp", _FSDP_PARAMS, _ACTIVATIONS, weight_gather="cast_then_gather"),
        RuleSet("dp_sp", _TENSOR_PARALLEL_PARAMS, _SEQUENCE_PARALLEL_ACTIVATIONS),
        RuleSet("fsdp_sp", _FSDP_PARAMS, _SEQUENCE_PARALLEL_ACTIVATIONS, weight_gather="cast_then_gather"),
    )
}


# Overlays change one component's layout on top of a base table (`"fsdp+experts_folded"`): each
# maps the base's parameter table (and optimizer table) to the changed one.
def _fold_experts(table: Table) -> Table:
    # Experts folded over every axis the tokens are split over (e.g. EP 4 = data x context while
    # attention runs tensor x context x data); the remaining axes act as expert data parallel.
    return {**table, "experts": ("data", "context", "expert")}


def _expert_tensor_parallel(table: Table) -> Table:
    # Each expert's hidden dimension split over tensor; FSDP then no longer splits the expert's
    # embed dimension over tensor (the hidden dimension holds it).
    return {**table, "expert_mlp": ("tensor",),
            "expert_embed": tuple(a for a in table.get("expert_embed", ()) if a != "tensor")}


OVERLAYS = {"experts_folded": _fold_experts, "expert_tp": _expert_tensor_parallel}
# Overlays of the whole rule set rather than of a table.
SET_OVERLAYS = {"opt_host": lambda rules: dataclasses.replace(rules, optimizer_memory="pinned_host"),
                "gather_bf16": lambda rules: dataclasses.replace(rules, weight_gather="cast_then_gather"),
                "gather_bf16_held": lambda rules: dataclasses.replace(rules, weight_gather="cast_then_gather_held"),
                "cast_where_used": lambda rules: dataclasses.replace(rules, weight_gather="cast_where_used")}


def get_rule_set(name: str) -> RuleSet:
    base, *overlays = name.split("+")
    if base not in RULE_SETS:
        raise ValueError(f"unknown rule table {base!r}; choose one of {sorted(RULE_SETS)}")
    rules = RULE_SETS[base]
    for overlay in overlays:
        if overlay in SET_OVERLAYS:
            rules = SET_OVERLAYS[overlay](rules)
            continue
        if overlay not in OVERLAYS:
            raise ValueError(f"unknown rule overlay {overlay!r} in {name!r}; choose from "
                             f"{sorted(OVERLAYS) + sorted(SET_OVERLAYS)}")
        change = OVERLAYS[overlay]
        optimizer = None if rules.optimizer is None else change(rules.optimizer)
        rules = dataclasses.replace(rules, params=change(rules.params), optimizer=optimizer)
    return dataclasses.replace(rules, name=name)


# ---- the active (mesh, rules) while a model is traced -------------------------------------

_ACTIVE: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("jaxtrain_rules", default=None)


@contextlib.contextmanager
def use_rules(mesh, rules: RuleSet):
    """Activation constraints inside this block resolve against `mesh` and `rules`.

    Jitted functions must be traced inside it; build one jitted function per (mesh, rules).
    """
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_mesh():
    active = _ACTIVE.get()
    return active[0] if active else None


def active_rules() -> RuleSet | None:
    active = _ACTIVE.get()
    return active[1] if active else None


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Sharding constraint on an activation by logical names; a no-op outside `use_rules`."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    spec = spec_for(names, x.shape, rules.activations, mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def constrain_param(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Sharding constraint on a weight by logical names (the parameter table), e.g. on one layer
    sliced out of a stack at run time; a no-op outside `use_rules`."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec_for(names, x.shape, rules.params, mesh)))


def named_sharding(mesh, names: Sequence[str | None], shape: Sequence[int], table: Table) -> NamedSharding:
    return NamedSharding(mesh, spec_for(names, shape, table, mesh))
