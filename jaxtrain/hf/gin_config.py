"""A model config dataclass -> the gin bindings that rebuild it (`Experiment.model = @LlamaConfig()` ...)."""
from __future__ import annotations

import dataclasses


def config_bindings(config, name: str | None = None) -> list[str]:
    """One binding per field, nested strategy objects (rope scaling) as `@Class()` references."""
    name = name or type(config).__name__
    lines, nested = [], []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            lines.append(f"{name}.{field.name} = @{type(value).__name__}()")
            nested += config_bindings(value)
        else:
            lines.append(f"{name}.{field.name} = {value!r}")
    return lines + nested


def model_gin(config, header: str = "", extra: list[str] = ()) -> str:
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    lines += ["", f"Experiment.model = @{type(config).__name__}()", *config_bindings(config), *extra]
    return "\n".join(lines) + "\n"
