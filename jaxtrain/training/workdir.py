"""The workdir as one run's property: a lock against a second trainer, and a check that the
checkpoints there were written by a model of the shape being resumed — both before anything
in the workdir changes."""
from __future__ import annotations

import ast
import dataclasses
import fcntl
import json
import os
import re
import socket
import time

from jaxtrain.checkpoints.fingerprint import leaf_path

LOCK_FILE = ".jaxtrain.lock"


class WorkdirLock:
    """An exclusive advisory lock (flock) on `<workdir>/.jaxtrain.lock`, held for the run by the
    process that writes the workdir (process 0). The kernel releases it when the process dies,
    even by kill -9, so a crashed run never leaves a stale lock behind."""

    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, LOCK_FILE)
        self._file = None

    def acquire(self) -> "WorkdirLock":
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        f = open(self.path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise ValueError(f"workdir {os.path.dirname(self.path)} is in use by another trainer ({holder}); "
                             f"two trainers on one workdir would overwrite each other's checkpoints") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on host {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()
        self._file = f
        return self

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None


def check_same_model(saved_shapes: dict[str, tuple], abstract_params, model_cfg, workdir: str, step: int) -> None:
    """Raises ValueError when the parameters saved at `step` do not have the shapes of
    `abstract_params`, naming the model config fields that differ from the saved config.gin."""
    import jax

    current = {f"params/{leaf_path(p)}": tuple(x.shape)
               for p, x in jax.tree_util.tree_leaves_with_path(abstract_params)}
    saved = {(k if k.startswith("params/") else f"params/{k}"): v for k, v in saved_shapes.items()}
    differ = sorted(p for p in set(current) | set(saved) if current.get(p) != saved.get(p))
    if not differ:
        return
    first = differ[0]
    detail = f"first {first}: saved {_shape(saved.get(first))}, now {_shape(current.get(first))}"
    fields = changed_fields(os.path.join(workdir, "config.gin"), model_cfg)
    named = (", ".join(f"{k} {a} -> {b}" for k, a, b in fields) if fields
             else "the saved config.gin does not say which fields")
    raise ValueError(f"the checkpoint at {workdir}/checkpoints/{step} was written by a model of another shape "
                     f"({named}); {len(differ)} parameter(s) differ, {detail}. Resume with the saved "
                     f"{workdir}/config.gin or train into a fresh workdir")


def _shape(shape) -> str:
    return "absent" if shape is None else str(list(shape))


_BINDING = re.compile(r"^(?P<name>[A-Za-z_][\w.]*)\.(?P<field>\w+)\s*=\s*(?P<value>.*)$")


def saved_bindings(config_gin: str) -> dict[tuple[str, str], str]:
    """{(configurable, field): value text} of a config.gin written by jaxtrain.cli.train (gin's
    config_str: one binding per line, long values continued on indented lines)."""
    bindings, last = {}, None
    if not os.path.exists(config_gin):
        return bindings
    for line in open(config_gin).read().splitlines():
        if line.startswith((" ", "\t")) and last is not None:
            bindings[last] += " " + line.strip()
            continue
        m = _BINDING.match(line.strip())
        last = None
        if m and not line.startswith("#"):
            last = (m.group("name").split(".")[-1], m.group("field"))
            bindings[last] = m.group("value").strip()
    return bindings


def changed_fields(config_gin: str, model_cfg) -> list[tuple[str, str, str]]:
    """[(Class.field, saved, now)] for the model config's plain fields (numbers, strings,
    tuples) whose value differs from the saved config.gin's (unbound there: the default)."""
    saved = saved_bindings(config_gin)
    if not saved:
        return []
    cls = type(model_cfg).__name__
    out = []
    for field in dataclasses.fields(model_cfg):
        now = getattr(model_cfg, field.name)
        if not isinstance(now, (int, float, str, tuple, bool, type(None))):
            continue
        text = saved.get((cls, field.name))
        if text is None:
            before = field.default if field.default is not dataclasses.MISSING else None
        else:
            try:
                before = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                continue
        if isinstance(before, list):
            before = tuple(before)
        if before != now:
            out.append((f"{cls}.{field.name}", json.dumps(before), json.dumps(now)))
    return out
