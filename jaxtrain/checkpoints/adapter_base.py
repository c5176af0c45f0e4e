"""Adapter checkpoints: a LoRA run's steps hold what it trains (the adapters, their optimizer
state, the step and the data position), not the frozen base, and record the base they adapt.

The base is a parameter checkpoint (one `python -m jaxtrain.convert --hf_dir` wrote, or any step
without a base of its own), named in each adapter step's manifest by its checkpoint directory,
step and fingerprint: one hash over the per-array fingerprints of the base's own manifest, so it
is computed without reading an array, and the restore of the base then checks every array
against that manifest as any restore does. Restoring an adapter step reads the base's parameters
from there and the adapters from the step, each into the run's shardings (any layout), and
returns the whole tree: a caller (training, eval, generation, export) never sees the split.

What a checkpointer saves is one strategy per kind of run, chosen when it is made:

  FullCheckpoints      every item as given (the default)
  AdapterCheckpoints   the trained part of the parameters, and the base's record in each manifest
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os

BASE_KEY = "base"  # manifest key of an adapter step's base record


@dataclasses.dataclass(frozen=True)
class BaseRecord:
    directory: str  # the base's checkpoint directory (a workdir's checkpoints/)
    step: int
    fingerprint: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, record: dict) -> "BaseRecord":
        return cls(record["directory"], int(record["step"]), record["fingerprint"])

    def describe(self) -> str:
        return f"{self.directory}/{self.step} (fingerprint {self.fingerprint})"


def params_fingerprint(manifest: dict) -> str:
    """One hash of a step's parameter fingerprints (the manifest's per-array values)."""
    fingerprints = sorted((p, fp) for p, fp in manifest.get("fingerprints", {}).items() if p.startswith("params/"))
    return hashlib.sha256(json.dumps(fingerprints).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class FullCheckpoints:
    def select(self, state: dict) -> dict:
        return state

    def manifest(self) -> dict:
        return {}

    def keep_steps(self, directory: str) -> tuple[int, ...]:
        return ()

    def check_base(self, recorded: BaseRecord) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class AdapterCheckpoints:
    base: BaseRecord
    part: object  # the trained parameters' strategy (jaxtrain/training/trained_params.py SomeParams)

    def select(self, state: dict) -> dict:
        return {k: self.part.select(v) if k == "params" else v for k, v in state.items()}

    def manifest(self) -> dict:
        return {BASE_KEY: self.base.to_json()}

    def keep_steps(self, directory: str) -> tuple[int, ...]:
        # a base in the run's own checkpoint directory outlives the rotation of the adapter steps
        same = os.path.abspath(directory) == os.path.abspath(self.base.directory)
        return (self.base.step,) if same else ()

    def check_base(self, recorded: BaseRecord) -> None:
        """A resume on another base than the one the adapters were trained on is refused."""
        if recorded.fingerprint != self.base.fingerprint or os.path.abspath(recorded.directory) != os.path.abspath(
                self.base.directory):
            from jaxtrain.checkpoints.errors import IncompatibleCheckpoint
            raise IncompatibleCheckpoint(f"the adapters in this workdir were trained on base {recorded.describe()}, "
                                         f"but this run's base is {self.base.describe()}: resume with the recorded "
                                         f"base (Experiment.lora_base) or train into a fresh workdir")


def split_tree(tree: dict, keep, prefix: str = "") -> tuple[dict, dict]:
    """(the leaves whose path is in `keep`, the rest), each a nested dict like `tree`."""
    inside, outside = {}, {}
    for key, sub in tree.items():
        path = f"{prefix}{key}"
        if isinstance(sub, dict):
            a, b = split_tree(sub, keep, path + "/")
            if a:
                inside[key] = a
            if b:
                outside[key] = b
        elif path in keep:
            inside[key] = sub
        else:
            outside[key] = sub
    return inside, outside


def merge_trees(a: dict, b: dict) -> dict:
    """Two nested dicts with disjoint leaves as one."""
    out = dict(a)
    for key, sub in b.items():
        out[key] = merge_trees(out[key], sub) if isinstance(sub, dict) and key in out else sub
    return out
