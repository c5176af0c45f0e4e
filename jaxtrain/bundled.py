"""The files jaxtrain ships beside its code: the gin configs (`configs/`) and the small corpus the
default config trains on (`data/tiny_corpus/`).

Configs name these files by relative paths (`include 'configs/llama_tiny.gin'`,
`data/tiny_corpus/train.txt`). A relative path not found under the working directory is looked up
under ROOT: the repository in a checkout, the copy inside the package in an installed wheel
(setup.py places it there), so the same configs run from any folder either way. A gin file may
also be named by a bundled config's name alone (`--gin_file=deepseek_v2_lite.gin` or
`--gin_file=deepseek_v2_lite`).
"""
from __future__ import annotations

import os
import pathlib

_PACKAGE = pathlib.Path(__file__).resolve().parent
# A wheel holds the files in jaxtrain/bundled/; a checkout keeps them at the repository root.
ROOT = _PACKAGE / "bundled" if (_PACKAGE / "bundled" / "configs").is_dir() else _PACKAGE.parent
CONFIGS = ROOT / "configs"


def gin_file(path: str) -> str:
    """`path` if it exists; else the bundled file it names (a path under ROOT, or a config's name
    in configs/, with or without `.gin`); else `path` unchanged, for the caller's not-found error."""
    if os.path.exists(path):
        return path
    candidates = [ROOT / path]
    if os.sep not in path and "/" not in path:
        candidates += [CONFIGS / path, CONFIGS / f"{path}.gin"]
    return str(next((c for c in candidates if c.is_file()), path))


def bundled_configs() -> list[str]:
    """The names of the configs that ship with jaxtrain."""
    return sorted(p.name for p in CONFIGS.glob("*.gin"))
