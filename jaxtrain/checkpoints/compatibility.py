"""Does a saved item fit this run's state? Read from Orbax's array metadata (no arrays), before
anything is restored, so that a config change is never mistaken for a corrupt step.

Each saved leaf (path, shape, dtype) is compared with the run's abstract state. Equal: the item
restores as it is (the optimizer state into the tree it was saved as, then moved into this run's
by path, since equal leaves may still sit in another tree of empty nodes). Different: either the
difference is one of positions only, or the item does not fit (`IncompatibleCheckpoint`, a
config error the caller reports, never a quarantine).

Positions only: an optax chain's state is a tuple, so adding or removing a stateless transform
(global-norm clipping: `OptimizerConfig.clip_norm=None`) shifts the index of every leaf after
it (`1/0/mu/...` becomes `0/0/mu/...`) while the Adam moments and counts stay what they were.
When the two trees hold the same leaves once the sequence indices are set aside (the same
names — `mu/...`, `nu/...`, `count` — with the same shapes and dtypes, paired in index order),
the saved values are carried over into the new positions on purpose, with one line saying so.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxtrain.checkpoints.errors import IncompatibleCheckpoint
from jaxtrain.checkpoints.fingerprint import leaf_path

Leaves = dict  # {leaf path: (shape tuple, dtype name)}


def saved_item(step_dir: str, item: str):
    """(Orbax's metadata tree of `item`, its Leaves), read without any array. Asked of the item's
    handler: a Checkpointer would also look for step metadata in the item's folder, where a
    CheckpointManager never writes it (the step's is one level up), and log its absence."""
    handler = ocp.StandardCheckpointHandler()
    try:
        meta = handler.metadata(pathlib.Path(step_dir) / item)  # a path object: it joins with /
    finally:
        handler.close()
    tree = getattr(meta, "tree", meta)
    leaves = {leaf_path(p): (tuple(m.shape), np.dtype(m.dtype).name)
              for p, m in jax.tree_util.tree_leaves_with_path(tree) if hasattr(m, "shape")}
    return tree, leaves


def abstract_leaves(abstract) -> Leaves:
    return {leaf_path(p): (tuple(x.shape), np.dtype(x.dtype).name)
            for p, x in jax.tree_util.tree_leaves_with_path(abstract)}


def _named(path: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """A leaf path split into its names and its sequence indices."""
    parts = path.split("/")
    return tuple(p for p in parts if not p.isdigit()), tuple(int(p) for p in parts if p.isdigit())


def _by_name(leaves: Leaves) -> dict[str, list[tuple[tuple[int, ...], str]]]:
    """{leaf name, sequence indices set aside: [(indices, path)] in index order}."""
    out = {}
    for path in leaves:
        names, indices = _named(path)
        out.setdefault("/".join(names), []).append((indices, path))
    return {name: sorted(paths) for name, paths in out.items()}


def _leaf_text(leaf) -> str:
    return "absent" if leaf is None else f"{list(leaf[0])} {leaf[1]}"


def describe_differences(saved: Leaves, now: Leaves) -> str:
    """The differences in a line, by leaf name (sequence indices set aside): names only one side
    has, else the names whose leaves differ in number, shape or dtype."""
    saved_names, now_names = _by_name(saved), _by_name(now)
    parts = []
    for label, mine in (("only now", now_names), ("only saved", saved_names)):
        names = sorted(set(mine) - (set(saved_names) & set(now_names)))
        if names:
            paths = ", ".join(mine[n][0][1] for n in names[:3])
            parts.append(f"{label}: {len(names)} ({paths}{', ...' if len(names) > 3 else ''})")
    if not parts:
        for name in sorted(now_names):
            was = [_leaf_text(saved[p]) for _, p in saved_names[name]]
            is_ = [_leaf_text(now[p]) for _, p in now_names[name]]
            if was != is_:
                parts.append(f"{name}: saved {', '.join(was)}, now {', '.join(is_)}")
        parts = parts[:3] + (["..."] if len(parts) > 3 else [])
    return "leaves " + "; ".join(parts)


def differences(saved: Leaves, now: Leaves) -> list[str]:
    """'path: saved X, now Y' for each leaf that is not the same in both."""
    return [f"{p}: saved {_leaf_text(saved.get(p))}, now {_leaf_text(now.get(p))}"
            for p in sorted(set(saved) | set(now)) if saved.get(p) != now.get(p)]


def moved_leaves(saved: Leaves, now: Leaves) -> dict[str, str] | None:
    """{now path: saved path} when the trees differ in sequence indices only (the same names,
    shapes and dtypes, paired in index order); None when they differ in anything else."""
    saved_groups = {n: [p for _, p in paths] for n, paths in _by_name(saved).items()}
    now_groups = {n: [p for _, p in paths] for n, paths in _by_name(now).items()}
    if saved_groups.keys() != now_groups.keys():
        return None
    pairs = {}
    for names, now_paths in now_groups.items():
        saved_paths = saved_groups[names]
        if len(saved_paths) != len(now_paths):
            return None
        for now_path, saved_path in zip(now_paths, saved_paths):
            if now[now_path] != saved[saved_path]:
                return None
            pairs[now_path] = saved_path
    return pairs


@dataclasses.dataclass
class ItemFit:
    """How to restore one item: into `target` (this run's abstract tree, or the saved structure
    carrying this run's shardings), then `to_now` the result."""
    target: object
    moved: dict[str, str] | None = None  # {now path: saved path}, when restored into the saved tree
    now_abstract: object = None

    @property
    def carried_over(self) -> bool:
        """Whether any leaf moves to another position (what the carry-over line reports)."""
        return self.moved is not None and any(n != s for n, s in self.moved.items())

    def to_now(self, restored):
        if self.moved is None:
            return restored
        by_path = {leaf_path(p): x for p, x in jax.tree_util.tree_leaves_with_path(restored)}
        return jax.tree_util.tree_map_with_path(lambda p, _: by_path[self.moved[leaf_path(p)]], self.now_abstract)


def fit_item(step: int, step_dir: str, item: str, abstract) -> ItemFit:
    """How the saved `item` of `step` restores into `abstract` (ShapeDtypeStructs with
    shardings). Raises IncompatibleCheckpoint when it does not fit; lets an unreadable
    metadata file's error through, or raises ValueError (the caller calls that corrupt)."""
    tree, saved = saved_item(step_dir, item)
    now = abstract_leaves(abstract)
    if not saved and now:  # metadata that parses but names no array: a damaged step
        raise ValueError(f"no readable array metadata in {os.path.join(step_dir, item)}")
    if saved == now and item != "opt_state":
        return ItemFit(abstract)  # plain dicts of arrays: the same leaves are the same tree
    # An optax state is tuples and namedtuples with empty nodes Orbax stores as lists, dicts and
    # None: the same leaves may still sit in another tree (a stateless transform added at the
    # end). So it is always restored into the saved tree, then moved into this run's by path.
    moved = moved_leaves(saved, now) if item == "opt_state" else None
    if moved is None:
        fix = ("bind CheckpointConfig.reset_on_resume=('opt_state',) to start the optimizer state fresh on purpose"
               if item == "opt_state" else "train into a fresh workdir")
        raise IncompatibleCheckpoint(
            f"step {step} in {os.path.dirname(step_dir)}: the saved {item} does not fit this run's "
            f"{'optimizer' if item == 'opt_state' else 'model'} ({describe_differences(saved, now)}). Nothing was "
            f"moved: resume with "
            f"the config that wrote it, or {fix}")
    sharding = {moved[leaf_path(p)]: x.sharding for p, x in jax.tree_util.tree_leaves_with_path(abstract)}
    target = jax.tree_util.tree_map_with_path(
        lambda p, m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding[leaf_path(p)]), tree)
    return ItemFit(target, moved, abstract)


def carried_over_line(step: int, item: str, fit: ItemFit) -> str:
    changed = sorted((s, n) for n, s in fit.moved.items() if s != n)
    first = f"{item}/{changed[0][0]} -> {item}/{changed[0][1]}" if changed else "none"
    return (f"note: step {step}: {item} carried over on purpose into this run's structure: {len(changed)} "
            f"leaves moved position only (first {first}); names, shapes and dtypes (the Adam moments mu, nu "
            f"and the counts) are the same")


def roles_changed_line(step: int, saved: dict | None, now: dict) -> str | None:
    """One line naming the parameters whose optimizer role (decay, no_decay, frozen) differs from
    the one recorded at `step`; None when none does or the step recorded none (older runs)."""
    if not saved:
        return None
    changed = sorted(p for p in set(saved) | set(now) if saved.get(p, "decay") != now.get(p, "decay"))
    if not changed:
        return None
    named = ", ".join(f"{p} {saved.get(p, 'decay')} -> {now.get(p, 'decay')}" for p in changed[:8])
    more = f" and {len(changed) - 8} more" if len(changed) > 8 else ""
    return f"note: optimizer roles changed since step {step} was saved ({len(changed)} parameters): {named}{more}"
