"""A model ready to generate with, from an HF directory or a training workdir, with its tokenizer
and the mesh/rules its weights are sharded by."""
from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.generate.engine import Engine
from jaxtrain.models.dtypes import dtype_from_name


@dataclasses.dataclass
class Loaded:
    model: object
    mesh: object
    rules: object
    tokenizer: object | None      # None: the checkpoint has none (token ids only)
    max_positions: int | None     # the model's trained positions where known

    def engine(self) -> Engine:
        return Engine(self.model, mesh=self.mesh, rules=self.rules, cache_dtype=cache_dtype(self.model))


def cache_dtype(model):
    """The compute dtype the keys/values are produced in (float32 where the config has none)."""
    name = getattr(getattr(model, "config", None), "dtype", None)
    return dtype_from_name(name) if isinstance(name, str) else jnp.float32


def canonical_model(model_cfg, params):
    """An NNX model of `model_cfg` holding canonical (layer-stacked, on-disk layout) `params`."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: model_cfg.build(nnx.Rngs(0))))
    model = nnx.merge(graphdef, params)
    model.config = model_cfg
    return model


def layout_mesh(spec: str | None):
    """(mesh, rule table name) of a `--layout` spec taking the first devices it needs; (None, "dp"):
    one device."""
    if not spec:
        return None, "dp"
    from jaxtrain.training.parallel_plan import ParallelPlan
    from jaxtrain.meshes.mesh import build_mesh

    plan = ParallelPlan.parse(spec)
    n = plan.mesh.fixed_device_count()
    if n > len(jax.devices()):
        raise ValueError(f"layout {spec!r} needs {n} devices; {len(jax.devices())} are present")
    return build_mesh(plan.mesh, jax.devices()[:n]), plan.rules


def load_hf_dir(hf_dir: str, layout: str | None = None) -> Loaded:
    from jaxtrain import hf

    from jaxtrain.meshes.rules import get_rule_set

    tokenizer = hf_tokenizer_or_none(hf_dir)  # before the weights: a bad one fails fast
    mesh, rules = layout_mesh(layout)
    model = hf.load(hf_dir, mesh=mesh, rules=rules)
    with open(os.path.join(hf_dir, "config.json")) as f:
        max_positions = json.load(f).get("max_position_embeddings")
    return Loaded(model, mesh, get_rule_set(rules), tokenizer, max_positions)


def hf_tokenizer_or_none(directory: str):
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.exists(os.path.join(directory, n)) for n in names):
        return None
    from jaxtrain.data.tokenizer import HFTokenizer

    return HFTokenizer(directory)


def load_workdir(workdir: str) -> Loaded:
    """The newest intact checkpoint of a training workdir (gin already parsed from its config.gin),
    restored as the eval CLI restores it, onto the run's layout (`Experiment.layout` included);
    raises RestoreFailed (with its exit code) when there is none to restore."""
    from jaxtrain.data.tokenizer import load_tokenizer
    from jaxtrain.training.config import load_experiment
    from jaxtrain.training.device_groups import one_mesh_program
    from jaxtrain.training.restore_latest import restore_latest_params
    from jaxtrain.training.train_setup import build_train_setup
    from jaxtrain.meshes.mesh import build_mesh
    from jaxtrain.meshes.rules import DATA_PARALLEL_AXES

    exp = load_experiment()
    plan, devices = one_mesh_program(exp.plan)  # device groups: one group's program
    # Only the state is restored: the batch is sized to this mesh, whatever the run trained with
    # (a run of 8 rows restores onto 16 devices to generate or score).
    mesh_shape = dict(build_mesh(plan.mesh, devices).shape)
    rows = math.prod(mesh_shape[a] for a in DATA_PARALLEL_AXES) * plan.microbatches
    setup = build_train_setup(exp.model, plan, dataclasses.replace(exp.train, global_batch=rows), exp.optimizer,
                              devices, loss=exp.loss)
    _, params = restore_latest_params(setup, workdir, exp.checkpoint.allow_unverified_restore)
    tokenizer = load_tokenizer(exp.data.tokenizer) if exp.data.tokenizer else None
    return Loaded(canonical_model(exp.model, params), setup.mesh, setup.rules, tokenizer, None)
