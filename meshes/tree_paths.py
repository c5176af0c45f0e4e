"""Leaf paths of pytrees as plain keys: dict keys, attribute names, sequence indices."""
from __future__ import annotations


def path_keys(path) -> tuple:
    """A jax key path -> a tuple of plain keys (e.g. ("stacks", "blocks", "layers", "attn"))."""
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(getattr(k, attr))
                break
        else:
            out.append(str(k))
    return tuple(out)


def path_text(path) -> str:
    """A jax key path as "stacks/blocks/layers/attn/q/kernel"."""
    return "/".join(map(str, path_keys(path)))
