"""The model families the HF bridge knows: a view over the family records (models/family.py),
each of which names its HF adapter module in jaxtrain/hf/families/."""
from __future__ import annotations

import functools

from jaxtrain.hf.errors import HFConfigError
from jaxtrain.hf.mapping import Family
from jaxtrain.models.family import families as model_families
from jaxtrain.models.family import family_of


@functools.lru_cache(maxsize=1)
def families() -> dict[str, Family]:
    """model_type -> HF adapter, over every model family whose record names one."""
    found: dict[str, Family] = {}
    for spec in model_families().values():
        adapter = spec.hf()
        if adapter is None:
            continue
        if adapter.model_type in found:
            raise RuntimeError(f"two model families claim HF model_type {adapter.model_type!r}")
        found[adapter.model_type] = adapter
    return found


def family_for_model_type(model_type: str | None, where: str = "config.json") -> Family:
    known = families()
    if model_type not in known:
        raise HFConfigError(f"{where}: model_type={model_type!r} is not supported "
                            f"(supported: {', '.join(repr(t) for t in sorted(known))})")
    return known[model_type]


def family_for_config(config) -> Family:
    """The HF adapter of `config`'s model family."""
    try:
        spec = family_of(config)
    except ValueError as e:
        raise HFConfigError(str(e)) from None
    adapter = spec.hf()
    if adapter is None:
        raise HFConfigError(f"model family {spec.name!r} ({type(config).__name__}) has no HF adapter "
                            f"(known: {', '.join(f.config_class.__name__ for f in families().values())})")
    return adapter
