"""Low-rank adapters (LoRA, Hu et al. 2021) as a transform of a built model, for every family.

    y = base(x) + scale * B(A(x)),   scale = alpha / rank   (rsLoRA: alpha / sqrt(rank))

A [in..., rank] and B [rank, out...] are added to the `Dense` projections a run targets, after
the family has built its model, so no family code knows about adapters. B starts at zero: the
adapted model computes exactly what the base does until B is trained. A starts as Hugging Face
peft's does (`init_lora_weights=True`: kaiming-uniform with a=sqrt(5), i.e. uniform in
±1/sqrt(fan_in); "gaussian": std 1/rank).

Where targets are: each family declares {target name: module path pattern} next to its config
(`@model_family(..., adapter_targets=...)`, models/family.py), so a family that gains targets adds
rows, not code. A pattern's "/"-separated parts match the end of a Dense module's path in the
built model ("*" matches any one part); a stacked layer's Dense holds every layer's kernel with a
leading `layers` axis, and its adapter gets the same leading axes (one adapter per layer).

How adapters are laid out: A takes the kernel's leading and input logical names, B the kernel's
leading and output names, and the rank between them is `lora_rank` (meshes/rules.py): each
factor splits like the side of the weight it shares, under any layout, and is whole along the rank
when it computes; FSDP also stores the rank split over the data axes those names leave free.

How the base stays fixed: the transform re-declares every base parameter's optimizer role as
"untrained" (models/layers/params.py); the training system then differentiates with respect to
the adapters only and keeps optimizer state for them only (jaxtrain/training/trained_params.py).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import gin
import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.meshes.weight_gather import contract
from jaxtrain.models.family import family_of
from jaxtrain.models.layers.dense import Dense
from jaxtrain.models.layers.expert_ffn import Experts
from jaxtrain.models.layers.params import OPTIMIZER, logical_axes, param, zeros

RANK_AXIS = "lora_rank"


def _kaiming_uniform(fan_in: int) -> Callable:
    # torch's kaiming_uniform_(a=sqrt(5)) on a [rank, fan_in] weight: gain sqrt(2 / (1 + 5)),
    # bound = sqrt(3) * gain / sqrt(fan_in) = 1 / sqrt(fan_in)
    bound = 1.0 / math.sqrt(fan_in)
    return lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)


def _gaussian(rank: int) -> Callable:
    return lambda key, shape, dtype: jax.random.normal(key, shape, dtype) / rank


INITS: Mapping[str, Callable[["LoraConfig", int], Callable]] = {
    "kaiming": lambda cfg, fan_in: _kaiming_uniform(fan_in),
    "gaussian": lambda cfg, fan_in: _gaussian(cfg.rank),
}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Which projections get adapters and how: `targets` are names of the model family's table
    (models/family.py adapter_targets), e.g. Llama's q, k, v, o, gate, up, down."""
    rank: int = 8  # inner width of each adapter's two factors
    alpha: float = 16.0  # the adapter term is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapter's input (only 0.0 is supported)
    targets: tuple[str, ...] = ("q", "v")  # projections to adapt, by the family's target names
    init: str = "kaiming"  # kaiming | gaussian (A's initialization; B starts at zero)
    use_rslora: bool = False  # scale alpha / sqrt(rank) instead of alpha / rank

    def __post_init__(self):
        if isinstance(self.targets, str):  # a gin string for one target
            object.__setattr__(self, "targets", (self.targets,))
        object.__setattr__(self, "targets", tuple(self.targets))
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank <= 0:
            raise ValueError(f"LoraConfig.rank must be a positive integer, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoraConfig.alpha must be positive, got {self.alpha!r}")
        if self.dropout != 0.0:
            raise ValueError(f"LoraConfig.dropout={self.dropout!r}: adapter dropout is not supported yet (use 0.0)")
        if self.init not in INITS:
            raise ValueError(f"LoraConfig.init={self.init!r}: choose one of {', '.join(INITS)}")
        if not self.targets:
            raise ValueError("LoraConfig.targets is empty: name at least one projection")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def _low_rank(x, a, b, n_in: int, dtype, scale: float):
    """scale * (x @ A) @ B through the same weight-gather strategy as the base kernel
    (meshes/weight_gather.py); `a`, `b` are the factors' variables (their names say how they split)."""
    av, bv = a[...], b[...]
    h = contract(x, av, n_in, dtype, logical_axes(a)[-av.ndim:])
    return contract(h, bv, 1, dtype, logical_axes(b)[-bv.ndim:]) * scale


def _delta(a, b, n_in: int, scale: float):
    """scale * A @ B as a kernel-shaped weight [lead..., in..., out...]."""
    av, bv = a[...], b[...]
    lead = av.ndim - n_in - 1
    return jnp.tensordot(av, bv, axes=1) * scale if lead == 0 else jax.vmap(
        lambda x, y: jnp.tensordot(x, y, axes=1))(av, bv) * scale


def _factor_a(rngs, cfg: LoraConfig, kernel, n_in: int, n_out: int, fan_in: int):
    """A [lead..., in..., rank] named like the kernel's leading and input axes."""
    shape, names = tuple(kernel.shape), logical_axes(kernel)
    lead = kernel.ndim - n_in - n_out
    return param(rngs, INITS[cfg.init](cfg, fan_in), shape[:lead + n_in] + (cfg.rank,),
                 names[:lead + n_in] + (RANK_AXIS,))


def _factor_b(rngs, cfg: LoraConfig, kernel, n_in: int, n_out: int):
    """B [lead..., rank, out...] named like the kernel's leading and output axes (zero: the
    adapted model starts as the base)."""
    shape, names = tuple(kernel.shape), logical_axes(kernel)
    lead = kernel.ndim - n_in - n_out
    return param(rngs, zeros, shape[:lead] + (cfg.rank,) + shape[lead + n_in:],
                 names[:lead] + (RANK_AXIS,) + names[lead + n_in:])


class LoraAdapter(nnx.Module):
    """The low-rank term of one Dense: `scale * B(A(x))`, contracted in the Dense's compute dtype
    through the same weight-gather strategy as the base kernel (meshes/weight_gather.py)."""

    def __init__(self, dense: Dense, cfg: LoraConfig, rngs: nnx.Rngs):
        n_in, n_out = len(dense.in_shape), len(dense.out_shape)
        self.a = _factor_a(rngs, cfg, dense.kernel, n_in, n_out, math.prod(dense.in_shape))
        self.b = _factor_b(rngs, cfg, dense.kernel, n_in, n_out)
        self.scale = cfg.scale

    def __call__(self, x, n_in: int, dtype):
        return _low_rank(x, self.a, self.b, n_in, dtype, self.scale)

    def delta(self, n_in: int):
        return _delta(self.a, self.b, n_in, self.scale)


class _Factors(nnx.Module):
    """B factors by projection name (attributes set by the owner)."""


class SharedInputAdapter(nnx.Module):
    """One adapter over several projections of the same input, as if they were one fused
    projection (Hugging Face's kv_a_proj_with_mqa is DeepSeek's kv_down and k_rope; Mamba-2's
    in_proj is in_z, in_x, in_b, in_c, in_dt): one A, and B split by output into one part per
    projection, `b/<projection>`. Its owner is the projections' parent module; each projection's
    Dense gets a `SharedInputPart` that computes its part of the term."""

    def __init__(self, denses: Mapping[str, Dense], cfg: LoraConfig, rngs: nnx.Rngs):
        first = next(iter(denses.values()))
        n_in = len(first.in_shape)
        self.a = _factor_a(rngs, cfg, first.kernel, n_in, len(first.out_shape), math.prod(first.in_shape))
        self.b = _Factors()
        for name, dense in denses.items():
            setattr(self.b, name, _factor_b(rngs, cfg, dense.kernel, n_in, len(dense.out_shape)))
        self.scale = cfg.scale

    def term(self, name: str, x, n_in: int, dtype):
        return _low_rank(x, self.a, getattr(self.b, name), n_in, dtype, self.scale)

    def delta(self, name: str, n_in: int):
        return _delta(self.a, getattr(self.b, name), n_in, self.scale)


class SharedInputPart(nnx.Module):
    """A Dense's adapter that is one projection's part of a SharedInputAdapter. (Each part
    computes x @ A again: rank-wide work, which keeps every Dense's call self-contained.)"""

    def __init__(self, shared: SharedInputAdapter, name: str):
        self.shared, self.name = shared, name

    def __call__(self, x, n_in: int, dtype):
        return self.shared.term(self.name, x, n_in, dtype)

    def delta(self, n_in: int):
        return self.shared.delta(self.name, n_in)


class _ExpertGroup(nnx.Module):
    """One A per expert [experts, in, rank] shared by `members`, one B per expert and member
    [experts, rank, out] under `b/<member>`."""


class ExpertAdapters(nnx.Module):
    """Adapters on routed experts' projections (models/layers/expert_ffn.py): one A/B pair per
    expert, stored stacked over the expert dimension with the experts' logical names, so the
    factors split over `expert` (and FSDP) like the expert weights. A group of projections of
    the same input (DeepSeek's gate and up: HF's fused gate_up_proj) shares one A per expert.
    The experts call `term` inside their own math, on either dispatch path."""

    def __init__(self, experts, groups: Mapping[str, tuple[str, ...]], cfg: LoraConfig, rngs: nnx.Rngs):
        self.scale = cfg.scale
        self.groups = tuple((g, tuple(m)) for g, m in groups.items())  # static: part of the graph
        for group, members in self.groups:
            first = getattr(experts, members[0])  # [lead..., experts, in, out]
            node = _ExpertGroup()
            node.a = _factor_a(rngs, cfg, first, 1, 1, first.shape[-2])  # experts lead like layers
            node.b = _Factors()
            for member in members:
                setattr(node.b, member, _factor_b(rngs, cfg, getattr(experts, member), 1, 1))
            setattr(self, group, node)

    def _factors(self):
        for group, members in self.groups:
            node = getattr(self, group)
            yield f"lora/{group}/a", node.a
            for member in members:
                yield f"lora/{group}/b/{member}", getattr(node.b, member)

    def weights(self) -> dict:
        return {name: v[...] for name, v in self._factors()}

    def weight_axes(self) -> dict:
        # the last three names: inside a layer scan the leading `layers` is gone from the value
        return {name: logical_axes(v)[-3:] for name, v in self._factors()}

    def adapts(self, projection: str) -> bool:
        return any(projection in members for _, members in self.groups)

    def term(self, projection: str, x, weights: dict, mm):
        group = next(g for g, members in self.groups if projection in members)
        h = mm(x, weights[f"lora/{group}/a"])
        return mm(h, weights[f"lora/{group}/b/{projection}"]) * self.scale


def target_patterns(model_cfg, targets: tuple[str, ...]) -> dict[str, str]:
    """{target: module path pattern} from the family's table; an unknown target is an error
    naming the family's choices."""
    family = family_of(model_cfg)
    table = dict(family.adapter_targets)
    if not table:
        raise ValueError(f"LoraConfig.targets: model family {family.name!r} declares no adapter targets yet")
    unknown = [t for t in targets if t not in table]
    if unknown:
        raise ValueError(f"LoraConfig.targets: unknown target {unknown[0]!r} for model family {family.name!r} "
                         f"(choose from {', '.join(table)})")
    return {t: table[t] for t in targets}


def _matches(path: tuple, pattern: str) -> bool:
    parts = pattern.split("/")
    tail = tuple(str(k) for k in path[-len(parts):])
    return len(path) >= len(parts) and all(p in ("*", k) for p, k in zip(parts, tail))


def _sites(model: nnx.Module) -> dict[tuple, tuple]:
    """{path: (owner, projection name or None)} of every projection an adapter can attach to:
    each Dense (None), and each named projection of a routed-experts module."""
    sites = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Dense):
            sites[tuple(path)] = (node, None)
        elif isinstance(node, Experts):
            for name in node.projections:
                sites[tuple(path) + (name,)] = (node, name)
    return sites


def _attach(model, target: str, pattern: str, sites: dict, cfg: LoraConfig, rngs, expert_groups: dict):
    """Adapters for one target. A pattern's last part may join sibling projections with "+":
    they share one A (one adapter over a projection HF fuses)."""
    prefix, _, last = pattern.rpartition("/")
    members = last.split("+")
    by_parent: dict[tuple, dict] = {}
    for member in members:
        for path, site in sites.items():
            if _matches(path, f"{prefix}/{member}" if prefix else member):
                by_parent.setdefault(path[:-1], {})[member] = site
    if not by_parent:
        raise ValueError(f"LoraConfig.targets: the model has no {target!r} projection (pattern {pattern!r})")
    for parent, found in by_parent.items():
        if len(found) != len(members):
            missing = [m for m in members if m not in found]
            raise ValueError(f"LoraConfig.targets: {target!r} (pattern {pattern!r}) finds no {missing[0]!r} "
                             f"beside the others under {'/'.join(map(str, parent))}")
        owners = {id(owner): owner for owner, _ in found.values()}
        if all(name is not None for _, name in found.values()):  # routed experts' projections
            (owner,) = owners.values()
            expert_groups.setdefault(id(owner), (owner, {}))[1]["_".join(members)] = tuple(members)
        elif len(members) == 1:
            (dense, _), = found.values()
            if dense.adapter is None:
                dense.adapter = LoraAdapter(dense, cfg, rngs)
        else:
            denses = {m: found[m][0] for m in members}
            shared = SharedInputAdapter(denses, cfg, rngs)
            # owned by the parent, under a name that sorts before its projections, so the shared
            # factors' state path is `<parent>/adapter_<target>/...` (NNX keeps a shared variable
            # at the first path it meets)
            setattr(_node_at(model, parent), f"adapter_{target}", shared)
            for m, dense in denses.items():
                dense.adapter = SharedInputPart(shared, m)


def _node_at(model, path: tuple):
    node = model
    for key in path:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    return node


def add_adapters(model: nnx.Module, cfg: LoraConfig, patterns: Mapping[str, str], rngs: nnx.Rngs) -> nnx.Module:
    """`model` (modified in place and returned) with every base parameter declared untrained and
    an adapter on each projection a pattern matches. A target that matches none is an error."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param):
            node.set_metadata(OPTIMIZER, "untrained")
    sites = _sites(model)
    expert_groups: dict = {}
    for target, pattern in patterns.items():
        _attach(model, target, pattern, sites, cfg, rngs, expert_groups)
    for experts, groups in expert_groups.values():
        experts.adapter = ExpertAdapters(experts, groups, cfg, rngs)
    return model


@dataclasses.dataclass(frozen=True)
class LoraModelConfig:
    """A model config with adapters: builds `base` and applies the transform. Every other
    question (validation, sizes, runtime settings) is the base's."""
    base: Any
    lora: LoraConfig

    def __post_init__(self):
        target_patterns(self.base, self.lora.targets)  # unknown targets fail when configured

    @property
    def vocab_size(self) -> int:
        return self.base.vocab_size

    def validate(self, mesh_sizes) -> None:
        self.base.validate(mesh_sizes)

    def build(self, rngs: nnx.Rngs):
        model = self.base.build(rngs)
        return add_adapters(model, self.lora, target_patterns(self.base, self.lora.targets), rngs)

    def adapter_count(self) -> int:
        model = nnx.eval_shape(lambda: self.build(nnx.Rngs(0)))
        return sum(math.prod(v.shape) for path, v in nnx.iter_graph(model)
                   if isinstance(v, nnx.Param) and any(str(k).startswith("adapter") for k in path))

    def param_count(self, include_embeddings: bool = True, active_only: bool = False) -> int:
        return self.base.param_count(include_embeddings, active_only) + self.adapter_count()

    def flops_per_token(self, seq_len: int) -> float:
        # The base's: a frozen base skips its weight gradients (about a third fewer FLOPs), and
        # the adapters add little; the planner's LoRA accounting is to come.
        return self.base.flops_per_token(seq_len)

    def runtime(self):
        return self.base.runtime()

    def with_runtime(self, **settings):
        return dataclasses.replace(self, base=self.base.with_runtime(**settings))


def with_lora(model_cfg, lora: LoraConfig | None) -> Any:
    """`model_cfg` with adapters per `lora` (None: unchanged)."""
    return model_cfg if lora is None else LoraModelConfig(model_cfg, lora)


for _configurable in (LoraConfig, LoraModelConfig):
    gin.external_configurable(_configurable, module="models")
