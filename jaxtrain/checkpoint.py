"""Orbax checkpoints of the train state and the data iterator, layout-independent on disk.

A step directory (named by the number of completed steps) holds the items `params`,
`opt_state` (each a mesh-free tree: plain nested dicts, layers stacked) and `data` (the grain
iterator, one file per process; a run with another number of processes restores from any of
them, since the state is the number of global batches taken).
Restoring onto another mesh only means handing Orbax abstract arrays that carry the new
shardings. A checkpoint written by `python -m jaxtrain.convert` has no `opt_state`: training
then starts from fresh optimizer state. Saves are async and atomic: Orbax finalizes a step
directory only after every file is written, so a crash never leaves a half-written step
that looks complete.
"""
from __future__ import annotations

import json
import os

import grain
import jax
import orbax.checkpoint as ocp

STATE_ITEMS = ("params", "opt_state")


class Checkpointer:
    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def items(self, step: int) -> set[str]:
        return {p for p in os.listdir(os.path.join(self.directory, str(step)))
                if os.path.isdir(os.path.join(self.directory, str(step), p))}

    def save(self, step: int, state: dict, data_iterator=None) -> None:
        """`state` holds any of STATE_ITEMS (params alone is a valid checkpoint)."""
        items = {k: ocp.args.StandardSave(state[k]) for k in STATE_ITEMS if k in state}
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)

    def restore(self, step: int, abstract_state: dict, data_iterator=None) -> dict:
        """Restores the items present on disk into the shardings carried by `abstract_state`
        (ShapeDtypeStructs); the data iterator, if saved and given, is restored in place."""
        present = self.items(step)
        if "params" not in present:
            raise FileNotFoundError(f"checkpoint {self.directory}/{step} has no params item")
        items = {k: ocp.args.StandardRestore(abstract_state[k]) for k in STATE_ITEMS
                 if k in present and k in abstract_state}
        other_layout = None  # a data state written by another number of processes
        if data_iterator is not None and "data" in present:
            data_dir = os.path.join(self.directory, str(step), "data")
            if os.path.exists(os.path.join(data_dir, f"process_{jax.process_index()}-of-{jax.process_count()}.json")):
                items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
            else:
                other_layout = sorted(f for f in os.listdir(data_dir) if f.startswith("process_"))
                if not other_layout:
                    raise FileNotFoundError(f"checkpoint {self.directory}/{step} has a data item without "
                                            f"iterator states")
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        if other_layout:
            # Our iterators' state is the number of global batches taken (jaxtrain/data.py), the same
            # in every process's file, so any process's file positions this process's shard.
            with open(os.path.join(data_dir, other_layout[0])) as f:
                data_iterator.set_state(json.load(f))
        return {k: restored[k] for k in items if k != "data"}

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
