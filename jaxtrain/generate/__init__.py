"""Text generation: prefill + cached decode (engine.py), sampling (sampling.py), loading a model
from an HF directory or a workdir (loading.py); the program is jaxtrain/cli/generate.py.

Names load lazily so that `python -m jaxtrain.generate` can size the CPU devices before jax starts.
"""
import importlib

_NAMES = {"Engine": "engine", "left_pad": "engine", "Sampling": "sampling", "filter_logits": "sampling",
          "sample": "sampling", "count_compiles": "compiles"}
__all__ = sorted(_NAMES)


def __getattr__(name):
    if name not in _NAMES:
        raise AttributeError(f"module 'jaxtrain.generate' has no attribute {name!r}")
    return getattr(importlib.import_module(f"jaxtrain.generate.{_NAMES[name]}"), name)
