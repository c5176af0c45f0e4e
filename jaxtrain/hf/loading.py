"""An HF directory -> our config and a ready NNX model, each tensor placed straight into its sharding."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterator

import jax
from flax import nnx

from jaxtrain.hf.errors import HFConfigError
from jaxtrain.hf.importer import ImportPlan, ParamPiece
from jaxtrain.hf.mapping import Family
from jaxtrain.hf.registry import family_for_model_type
from jaxtrain.hf.safetensors_io import SafetensorsDir
from jaxtrain.hf.trees import flatten, unflatten
from jaxtrain.training.state import abstract_model, param_shardings
from jaxtrain.meshes.rules import get_rule_set


def read_config(hf_dir: str | os.PathLike) -> tuple[Family, object]:
    """(family, our config) from `hf_dir/config.json`; raises HFConfigError naming any field
    or value we cannot reproduce faithfully."""
    path = os.path.join(os.fspath(hf_dir), "config.json")
    if not os.path.exists(path):
        raise HFConfigError(f"{path} not found: not an HF model directory")
    with open(path) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as e:
            raise HFConfigError(f"{path}: not valid JSON ({e})") from e
    family = family_for_model_type(raw.get("model_type"), path)
    return family, family.config_from_hf(raw, path)


def import_plan(hf_dir: str | os.PathLike, dtype: str | None = None) -> ImportPlan:
    """The checked plan that reads `hf_dir` into our parameters (nothing is read yet)."""
    family, config = read_config(hf_dir)
    if dtype is not None:
        config = dataclasses.replace(config, dtype=dtype)
    return ImportPlan(family, config, SafetensorsDir(hf_dir))


def iter_params(hf_dir: str | os.PathLike) -> Iterator[ParamPiece]:
    """(our parameter path, stack index, array) for every parameter, one layer at a time."""
    return import_plan(hf_dir).pieces()


def load(hf_dir: str | os.PathLike, mesh=None, dtype: str | None = None, rules: str = "dp"):
    """A ready NNX model from a local HF directory.

    `dtype` is the compute dtype (parameters stay float32, as for training). Without a mesh
    the parameters land on the default device. With one, each device's shard is read from
    the safetensors files by itself, in the layout the rule table gives, so no device and no
    host buffer ever holds more than one parameter. The model's config is `model.config`.
    """
    plan = import_plan(hf_dir, dtype)
    config = plan.config
    graphdef, abstract = abstract_model(config)
    if mesh is None:
        device = jax.devices()[0]
        arrays = {path: jax.device_put(plan.read_region(path, _whole(leaf.shape)), device)
                  for path, leaf in plan.leaves.items()}
    else:
        config.validate(dict(mesh.shape))
        shardings = flatten(param_shardings(abstract, mesh, get_rule_set(rules).params))
        arrays = {path: _sharded_leaf(plan, path, shardings[path]) for path in plan.leaves}
    nnx.replace_by_pure_dict(abstract, unflatten(arrays))
    model = nnx.merge(graphdef, abstract)
    model.config = config  # so hf.save can write config.json without being told
    return model


def _sharded_leaf(plan: ImportPlan, path: str, sharding) -> jax.Array:
    leaf = plan.leaves[path]
    cache: dict = {}  # replicas ask for the same region: read it once

    def shard(index):
        key = tuple((s.start, s.stop) for s in (slice(*i.indices(d)[:2]) for i, d in zip(index, leaf.shape)))
        if key not in cache:
            cache[key] = plan.read_region(path, index)
        return cache[key]

    return jax.make_array_from_callback(leaf.shape, sharding, shard)


def _whole(shape) -> tuple[slice, ...]:
    return tuple(slice(0, d) for d in shape)
