"""The model families the HF bridge knows, found by scanning jaxtrain/hf/families/."""
from __future__ import annotations

import functools
import importlib
import pkgutil

from jaxtrain.hf import families as _families_pkg
from jaxtrain.hf.errors import HFConfigError
from jaxtrain.hf.mapping import Family


@functools.lru_cache(maxsize=1)
def families() -> dict[str, Family]:
    """model_type -> Family, over every module in jaxtrain.hf.families that defines FAMILY."""
    found: dict[str, Family] = {}
    for info in pkgutil.iter_modules(_families_pkg.__path__):
        module = importlib.import_module(f"{_families_pkg.__name__}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if family is None:
            continue
        if family.model_type in found:
            raise RuntimeError(f"two family modules claim model_type {family.model_type!r}")
        found[family.model_type] = family
    return found


def family_for_model_type(model_type: str | None, where: str = "config.json") -> Family:
    known = families()
    if model_type not in known:
        raise HFConfigError(f"{where}: model_type={model_type!r} is not supported "
                            f"(supported: {', '.join(repr(t) for t in sorted(known))})")
    return known[model_type]


def family_for_config(config) -> Family:
    """The family whose config class `config` is an instance of."""
    for family in families().values():
        if isinstance(config, family.config_class):
            return family
    raise HFConfigError(f"no HF family handles {type(config).__name__} "
                        f"(known: {', '.join(f.config_class.__name__ for f in families().values())})")
