"""A live NNX model -> an HF directory transformers loads."""
from __future__ import annotations

import collections
import os

import jax
import numpy as np
from flax import nnx

from jaxtrain.hf.errors import HFConfigError
from jaxtrain.hf.exporter import DEFAULT_MAX_SHARD_BYTES, ExportPlan, write_hf_dir
from jaxtrain.hf.registry import family_for_config
from jaxtrain.hf.trees import flatten


class ParamsSource:
    """Regions of a params tree of (possibly sharded) jax arrays; keeps the few parameters last
    fetched to host, so exporting holds about one parameter on the host, not the model."""

    def __init__(self, params: dict, keep: int = 2):
        self.params = flatten(params)
        self.keep, self.cache = keep, collections.OrderedDict()

    def region(self, path: str, index: tuple[int, ...], slices: tuple[slice, ...]) -> np.ndarray:
        if path not in self.cache:
            self.cache[path] = np.asarray(jax.device_get(self.params[path]))
            while len(self.cache) > self.keep:
                self.cache.popitem(last=False)
        return self.cache[path][tuple(index) + tuple(slices)]


def save(model, path: str | os.PathLike, config=None, *, dtype: str | None = None,
         max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Writes `model` as an HF directory (config.json + safetensors, sharded past
    `max_shard_bytes`). `config` defaults to `model.config` (set by hf.load); `dtype`
    ("bfloat16", ...) casts the weights on disk, default: as they are."""
    config = config if config is not None else getattr(model, "config", None)
    if config is None:
        raise HFConfigError("hf.save needs the model's config: pass config=..., or load the model with hf.load")
    plan = ExportPlan(family_for_config(config), config, dtype)
    write_hf_dir(plan, ParamsSource(nnx.to_pure_dict(nnx.state(model, nnx.Param))), os.fspath(path), max_shard_bytes)
