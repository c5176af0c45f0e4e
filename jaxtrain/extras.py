"""Optional dependencies, each behind the pip extra that installs it.

The core install trains, checkpoints and generates with the byte tokenizer; Hugging Face
tokenizers and chat templates need transformers (`jaxtrain[hf]`), lm-evaluation-harness tasks
need lm-eval (`jaxtrain[eval]`), the wandb and MLflow trackers their packages (`jaxtrain[wandb]`,
`jaxtrain[mlflow]`). `require` imports a module of an extra or raises MissingExtra,
whose message is the one line a user needs: what needed it and what to install. It is a
ValueError, which every CLI already reports as a one-line error with exit status 2.
"""
from __future__ import annotations

import importlib

# module -> what to pip install for it
INSTALLS = {"transformers": "'jaxtrain[hf]'", "tokenizers": "'jaxtrain[hf]'", "lm_eval": "'jaxtrain[eval]'",
            "torch": "torch", "wandb": "'jaxtrain[wandb]'", "mlflow": "'jaxtrain[mlflow]'"}


class MissingExtra(ValueError):
    pass


def require(module: str, needed_for: str):
    """`module` imported, or MissingExtra naming `needed_for` and the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        if err.name is not None and err.name.split(".")[0] != module.split(".")[0]:
            raise  # the module is there but one of its own imports failed: that is its error
        top = module.split(".")[0]
        raise MissingExtra(f"{needed_for} needs {top}, which is not installed: pip install {INSTALLS[top]}") from None
