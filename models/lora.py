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
leading and output names, and the rank between them is `lora_rank`, which no rule table maps
(meshes/rules.py): each factor splits like the side of the weight it shares, under any layout.

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
from flax import nnx

from meshes.weight_gather import contract
from models.family import family_of
from models.layers.dense import Dense
from models.layers.params import OPTIMIZER, logical_axes, param, zeros

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
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "v")
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


class LoraAdapter(nnx.Module):
    """The low-rank term of one Dense: `scale * B(A(x))`, contracted in the Dense's compute dtype
    through the same weight-gather strategy as the base kernel (meshes/weight_gather.py)."""

    def __init__(self, dense: Dense, cfg: LoraConfig, rngs: nnx.Rngs):
        kernel, names = dense.kernel, logical_axes(dense.kernel)
        n_in, n_out = len(dense.in_shape), len(dense.out_shape)
        lead = kernel.ndim - n_in - n_out  # a stack's `layers` (one adapter per layer)
        shape = tuple(kernel.shape)
        init_a = INITS[cfg.init](cfg, math.prod(dense.in_shape))
        self.a = param(rngs, init_a, shape[:lead + n_in] + (cfg.rank,), names[:lead + n_in] + (RANK_AXIS,))
        self.b = param(rngs, zeros, shape[:lead] + (cfg.rank,) + shape[lead + n_in:],
                       names[:lead] + (RANK_AXIS,) + names[lead + n_in:])
        self.scale = cfg.scale

    def __call__(self, x, n_in: int, dtype):
        a, b = self.a[...], self.b[...]
        h = contract(x, a, n_in, dtype, logical_axes(self.a)[-a.ndim:])
        return contract(h, b, 1, dtype, logical_axes(self.b)[-b.ndim:]) * self.scale


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


def add_adapters(model: nnx.Module, cfg: LoraConfig, patterns: Mapping[str, str], rngs: nnx.Rngs) -> nnx.Module:
    """`model` (modified in place and returned) with every base parameter declared untrained and
    an adapter on each Dense a pattern matches. A target that matches no Dense is an error."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param):
            node.set_metadata(OPTIMIZER, "untrained")
    denses = [(path, node) for path, node in nnx.iter_graph(model) if isinstance(node, Dense)]
    for target, pattern in patterns.items():
        hits = [dense for path, dense in denses if _matches(path, pattern)]
        if not hits:
            raise ValueError(f"LoraConfig.targets: the model has no {target!r} projection (pattern {pattern!r})")
        for dense in hits:
            if dense.adapter is None:
                dense.adapter = LoraAdapter(dense, cfg, rngs)
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
        return sum(math.prod(v.shape) for _, node in nnx.iter_graph(model)
                   if isinstance(node, LoraAdapter) for v in (node.a, node.b))

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
