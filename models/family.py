"""Model families as records: what every model config provides, and one registry.

A family is one file in models/ holding its config dataclass (and its blocks), decorated with
`@model_family(...)`. That writes the family's one record, a `FamilySpec`:

  config_class   the config dataclass, registered with gin (`@LlamaConfig()` in a gin file)
  parts          the other configurables its gin files name (RouterConfig, SSMConfig, the rope
                 scalings, the attention strategies), registered with gin here, so no central
                 list has to know them (a part two families share is registered once)
  hf_adapter     the module of jaxtrain/hf/families/ that maps it to and from HF checkpoints,
                 by name: models/ does not import jaxtrain; jaxtrain/hf/registry.py is a view
                 over these records
  runtime_knobs  which of `remat`, `attention`, `kernels` the config has (below)
  adapter_targets  the projections adapters may target (models/lora.py): {name users write in
                 LoraConfig.targets: module path pattern in the built model}; a family adds rows

`families()` finds every family by importing the modules of models/, so adding a family touches
no central list.

What the rest of the system asks of a model config (`ModelConfig`):

  vocab_size                       the embedding rows (checked against the tokenizer)
  validate(mesh_sizes)             the config's own consistency (heads vs kv_heads, a pattern's
                                   kinds, ...); whether its dimensions fit the mesh is checked
                                   once for every family by the rule tables (meshes/rules.py)
  build(rngs) -> CausalLM          the model (embed -> layer stacks -> norm -> head)
  param_count(include_embeddings=True, active_only=False)
                                   parameters (active_only: those one token passes through)
  flops_per_token(seq_len)         training FLOPs per token, for MFU and the planner
  runtime() / with_runtime(...)    how the model runs, not what it computes (`FamilyConfig`):
                                   the remat policy, the attention strategy, the kernels. A
                                   layout, the bench and the planner turn these through the two
                                   methods, never by reading or replacing fields by name.

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
from typing import Any, Mapping, Protocol, runtime_checkable

import gin

REQUIRED = ("validate", "build", "param_count", "flops_per_token", "runtime", "with_runtime")
PARAM_COUNT_ARGS = ("include_embeddings", "active_only")
# Settings that change how a model runs and never its numbers; `remat` every family has.
RUNTIME_KNOBS = ("remat", "attention", "kernels")


@dataclasses.dataclass(frozen=True)
class Runtime:
    """A config's runtime settings; None where the family has no such choice (no attention
    layers in Mamba-2, no kernel choice in Llama)."""
    remat: str
    attention: Any = None  # a strategy of models/layers/attention_impl.py
    kernels: str | None = None  # auto | pallas | xla


class FamilyConfig:
    """Base of every family's config dataclass: its runtime settings behind two methods."""

    def runtime(self) -> Runtime:
        return Runtime(**{knob: getattr(self, knob) for knob in runtime_knobs(type(self))})

    def with_runtime(self, *, remat: str | None = None, attention: Any = None, kernels: str | None = None):
        """This config with the given runtime settings (None: keep its own). A setting the
        family does not have is an error naming the ones it has."""
        changes = {k: v for k, v in (("remat", remat), ("attention", attention), ("kernels", kernels))
                   if v is not None}
        knobs = runtime_knobs(type(self))
        missing = [k for k in changes if k not in knobs]
        if missing:
            raise ValueError(f"{type(self).__name__} has no {' or '.join(missing)} setting "
                             f"(its runtime settings: {', '.join(knobs)})")
        return dataclasses.replace(self, **changes) if changes else self


def runtime_knobs(config_class: type) -> tuple[str, ...]:
    fields = {f.name for f in dataclasses.fields(config_class)}
    return tuple(k for k in RUNTIME_KNOBS if k in fields)


@runtime_checkable
class ModelConfig(Protocol):
    vocab_size: int

    def validate(self, mesh_sizes: Mapping[str, int]) -> None: ...

    def build(self, rngs): ...

    def param_count(self, include_embeddings: bool = True, active_only: bool = False) -> int: ...

    def flops_per_token(self, seq_len: int) -> float: ...

    def runtime(self) -> Runtime: ...

    def with_runtime(self, *, remat=None, attention=None, kernels=None): ...


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """Everything the system knows about one model family, in one place."""
    name: str
    config_class: type
    summary: str
    parts: tuple[type, ...] = ()  # other configurables its gin files name (RouterConfig, SSMConfig)
    hf_adapter: str | None = None  # module defining FAMILY (jaxtrain.hf.mapping.Family), or None
    # ((target name, module path pattern), ...): models/lora.py matches each pattern's "/"-separated
    # parts against the end of a Dense module's path ("*" matches any one part)
    adapter_targets: tuple[tuple[str, str], ...] = ()

    @property
    def runtime_knobs(self) -> tuple[str, ...]:
        return runtime_knobs(self.config_class)

    def hf(self):
        """The HF adapter (jaxtrain.hf.mapping.Family) or None; its module is imported on first use."""
        if self.hf_adapter is None:
            return None
        adapter = getattr(importlib.import_module(self.hf_adapter), "FAMILY", None)
        if adapter is None or adapter.config_class is not self.config_class:
            raise TypeError(f"model family {self.name!r}: {self.hf_adapter}.FAMILY must be the HF adapter of "
                            f"{self.config_class.__name__}")
        return adapter


_FAMILIES: dict[str, FamilySpec] = {}


def model_family(name: str, summary: str, parts: tuple[type, ...] = (), hf_adapter: str | None = None,
                 adapter_targets: Mapping[str, str] | None = None):
    """Class decorator for a model config: checks it provides the ModelConfig methods (with
    param_count's common signature) and a `remat` field, registers it and its `parts` with gin
    (module `models`) and records the family. Returns the class itself, so it stays a plain
    dataclass."""
    def register(cls):
        missing = [m for m in REQUIRED if not callable(getattr(cls, m, None))]
        if missing:
            raise TypeError(f"model family {name!r}: {cls.__name__} lacks {missing} (see models/family.py; "
                            f"runtime/with_runtime come from subclassing FamilyConfig)")
        params = inspect.signature(cls.param_count).parameters
        if not all(a in params for a in PARAM_COUNT_ARGS):
            raise TypeError(f"model family {name!r}: {cls.__name__}.param_count must take {PARAM_COUNT_ARGS}")
        fields = {f.name for f in dataclasses.fields(cls)}
        for field in ("vocab_size", "remat"):
            if field not in fields:
                raise TypeError(f"model family {name!r}: {cls.__name__} has no {field} field")
        if name in _FAMILIES and _FAMILIES[name].config_class is not cls:
            raise TypeError(f"two model families are named {name!r}")
        for configurable in (cls, *parts):
            _register_with_gin(configurable)
        _FAMILIES[name] = FamilySpec(name, cls, summary, tuple(parts), hf_adapter,
                                     tuple((adapter_targets or {}).items()))
        return cls
    return register


_REGISTERED_WITH_GIN: set[type] = set()


def _register_with_gin(cls) -> None:
    if cls not in _REGISTERED_WITH_GIN:  # a part two families share is registered once
        gin.external_configurable(cls, module="models")
        _REGISTERED_WITH_GIN.add(cls)


def families() -> dict[str, FamilySpec]:
    """name -> FamilySpec, over every module of the models package."""
    _import_family_modules()
    return dict(sorted(_FAMILIES.items()))


@functools.cache
def _import_family_modules() -> None:
    package = importlib.import_module(__package__)
    for info in pkgutil.iter_modules(package.__path__):
        if not info.ispkg and info.name != "family":
            importlib.import_module(f"{__package__}.{info.name}")


def family_of(config) -> FamilySpec:
    """The record of `config`'s class, or of the nearest registered class it derives from (gin
    builds configs as subclasses of the registered class)."""
    by_class = {family.config_class: family for family in families().values()}
    for cls in type(config).__mro__:
        if cls in by_class:
            return by_class[cls]
    raise ValueError(f"{type(config).__name__} is not a registered model family "
                     f"(known: {', '.join(f.config_class.__name__ for f in families().values())})")
