"""Model families as records: what every model config provides, and one registry.

A family is one file in models/ holding its config dataclass (and its blocks), decorated with
`@model_family(...)`. That registers the config with gin (`@LlamaConfig()` in a gin file) and
records the family here; `families()` finds every family by importing the modules of models/,
so adding a family touches no central list. The HF side is the same: one module in
jaxtrain/hf/families/ declaring the config translation and tensor table.

What the rest of the system asks of a model config (`ModelConfig`):

  vocab_size                       the embedding rows (checked against the tokenizer)
  validate(mesh_sizes)             the config's own consistency (heads vs kv_heads, a pattern's
                                   kinds, ...); whether its dimensions fit the mesh is checked
                                   once for every family by the rule tables (meshes/rules.py)
  build(rngs) -> CausalLM          the model (embed -> layer stacks -> norm -> head)
  param_count(include_embeddings=True, active_only=False)
                                   parameters (active_only: those one token passes through)
  flops_per_token(seq_len)         training FLOPs per token, for MFU and the planner

The pipeline reads the layer kinds from the built model's stacks (models/stage_program.py),
and layers report auxiliary losses, metrics and post-update actions as typed outputs
(models/layers/aux_outputs.py), so neither needs a per-family hook here.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import pkgutil
from typing import Mapping, Protocol, runtime_checkable

import gin

REQUIRED = ("validate", "build", "param_count", "flops_per_token")
PARAM_COUNT_ARGS = ("include_embeddings", "active_only")


@runtime_checkable
class ModelConfig(Protocol):
    vocab_size: int

    def validate(self, mesh_sizes: Mapping[str, int]) -> None: ...

    def build(self, rngs): ...

    def param_count(self, include_embeddings: bool = True, active_only: bool = False) -> int: ...

    def flops_per_token(self, seq_len: int) -> float: ...


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    config_class: type
    summary: str
    parts: tuple[type, ...] = ()  # other dataclasses its gin files configure (RouterConfig, SSMConfig)


_FAMILIES: dict[str, Family] = {}


def model_family(name: str, summary: str, parts: tuple[type, ...] = ()):
    """Class decorator for a model config: checks it provides the ModelConfig methods (with
    param_count's common signature), registers it and its `parts` with gin (module `models`)
    and records the family. Returns the class itself, so it stays a plain dataclass."""
    def register(cls):
        missing = [m for m in REQUIRED if not callable(getattr(cls, m, None))]
        if missing:
            raise TypeError(f"model family {name!r}: {cls.__name__} lacks {missing} (see models/family.py)")
        params = inspect.signature(cls.param_count).parameters
        if not all(a in params for a in PARAM_COUNT_ARGS):
            raise TypeError(f"model family {name!r}: {cls.__name__}.param_count must take {PARAM_COUNT_ARGS}")
        if not any(f.name == "vocab_size" for f in dataclasses.fields(cls)):
            raise TypeError(f"model family {name!r}: {cls.__name__} has no vocab_size field")
        if name in _FAMILIES and _FAMILIES[name].config_class is not cls:
            raise TypeError(f"two model families are named {name!r}")
        for configurable in (cls, *parts):
            _register_with_gin(configurable)
        _FAMILIES[name] = Family(name, cls, summary, tuple(parts))
        return cls
    return register


_REGISTERED_WITH_GIN: set[type] = set()


def _register_with_gin(cls) -> None:
    if cls not in _REGISTERED_WITH_GIN:  # a part two families share is registered once
        gin.external_configurable(cls, module="models")
        _REGISTERED_WITH_GIN.add(cls)


def families() -> dict[str, Family]:
    """name -> Family, over every module of the models package."""
    _import_family_modules()
    return dict(sorted(_FAMILIES.items()))


@functools.cache
def _import_family_modules() -> None:
    import models
    for info in pkgutil.iter_modules(models.__path__):
        if not info.ispkg and info.name != "family":
            importlib.import_module(f"models.{info.name}")


def family_of(config) -> Family:
    for family in families().values():
        if isinstance(config, family.config_class):
            return family
    raise ValueError(f"{type(config).__name__} is not a registered model family "
                     f"(known: {', '.join(f.config_class.__name__ for f in families().values())})")
