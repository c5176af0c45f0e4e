"""One-line errors for config values of the wrong type (a gin binding `steps='10'` or `steps=1.5`),
checked against each config dataclass's annotations before anything uses them."""
from __future__ import annotations

import dataclasses
import types
import typing


def check_config_types(config, name: str | None = None) -> None:
    """Raises ValueError naming `Class.field` for the first field whose value does not match its
    annotation (int, float, bool, str, tuples of those, `X | None`); nested config dataclasses
    are checked too. Fields annotated with anything else are left to the config's own checks."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        return
    name = name or type(config).__name__
    try:
        hints = typing.get_type_hints(type(config))
    except Exception:  # an annotation that cannot be resolved: nothing to check against
        hints = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        hint = hints.get(field.name)
        if hint is not None and not _matches(value, hint):
            raise ValueError(f"{name}.{field.name} must be {_describe(hint)}, got {value!r} "
                             f"({type(value).__name__})")
        check_config_types(value, type(value).__name__)


def _matches(value, hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any or isinstance(hint, typing.TypeVar):
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is tuple:
        if not isinstance(value, (tuple, list)):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_matches(v, args[0]) for v in value)
        return len(args) == len(value) and all(_matches(v, a) for v, a in zip(value, args))
    return True  # classes, callables, protocols: the config's own validation decides


def _describe(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if hint is type(None):
        return "None"
    if origin is tuple:
        inner = _describe(args[0]) if args else "values"
        return f"a tuple of {inner}"
    return getattr(hint, "__name__", str(hint))
