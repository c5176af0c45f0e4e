"""Per-device bytes of the train state of a layout, exactly, without devices.

The state layout the run itself would build (CanonicalState, or the pipeline's StagedState) is
built once per model and pipeline split on a `jax.sharding.AbstractMesh`: its parameter shapes,
logical names and which parameters have Adam moments come from the model's own code (the same
path as a real run) at the cost of a trace. Each layout the planner considers then only resolves
those names with its rule tables (meshes/rules.spec_for) and divides: thousands of layouts per
second. Each parameter is also described for the memory and time models: its bytes per device,
what one layer of it weighs once FSDP has gathered it for compute, and over which axes.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType

from jaxtrain.meshes.mesh_config import AXES
from jaxtrain.meshes.rules import DATA_PARALLEL_AXES, RuleSet, spec_for
from jaxtrain.meshes.weight_gather import FSDP_GATHERED_NAMES

# The axes the tokens are split over (data parallel and context parallel).
TOKEN_AXES = DATA_PARALLEL_AXES + ("context",)


@dataclasses.dataclass(frozen=True)
class ParamShape:
    path: tuple
    shape: tuple
    names: tuple
    itemsize: int
    moments: int  # optimizer-state arrays mirroring it (Adam: 2; frozen parameters: 0)


@dataclasses.dataclass(frozen=True)
class StateShapes:
    """A model's in-memory train-state tree (for a pipeline split), without any mesh."""
    params: tuple[ParamShape, ...]
    other_optimizer_bytes: int  # optimizer leaves that mirror no parameter (step counts)
    num_params: int


@dataclasses.dataclass(frozen=True)
class ParamLeaf:
    path: tuple
    names: tuple
    shape: tuple  # global
    itemsize: int
    bytes_per_device: int
    layer_count: int  # layers stacked in this leaf on one device (1 for the embedding, head, norms)
    gather_axes: tuple  # axes FSDP splits it over, gathered for compute
    gathered_bytes: int  # one layer of it on one device once gathered (still split over tensor / experts)
    optimizer_bytes_per_device: int  # one optimizer moment of it, laid out by the optimizer table
    compute_axes: tuple  # axes it stays split over while computing (tensor, experts, pipeline)

    @property
    def in_layers(self) -> bool:
        return "layers" in self.names


@dataclasses.dataclass(frozen=True)
class StateBytes:
    params: int  # bytes per device
    optimizer: int  # Adam moments and counts per device, in device memory
    optimizer_host: int  # the same, where the optimizer state lives in host memory (`+opt_host`)
    leaves: tuple[ParamLeaf, ...]
    num_params: int

    @property
    def device(self) -> int:
        return self.params + self.optimizer


def abstract_mesh(sizes: dict[str, int]):
    return AbstractMesh(tuple(sizes[a] for a in AXES), AXES, axis_types=(AxisType.Auto,) * len(AXES))


def state_shapes(model_cfg, tx, pipeline=None, stages: int = 1) -> StateShapes:
    """The shapes of the state a run of `model_cfg` holds in memory: canonical, or regrouped
    into `stages` pipeline stages by `pipeline` (a PipelineConfig)."""
    from jaxtrain.pipeline import StagedState
    from jaxtrain.training.state import map_param_leaves
    from jaxtrain.training.state_layouts import CanonicalState
    from jaxtrain.meshes.rules import get_rule_set

    sizes = {a: 1 for a in AXES} | {"pipeline": stages}
    mesh, rules = abstract_mesh(sizes), get_rule_set("dp")
    if stages > 1:
        layout = StagedState(model_cfg, tx, mesh, rules, pipeline.plan(model_cfg, stages))
        names, shapes = layout.layout.stage_names, layout.layout.stage_shapes
    else:
        layout = CanonicalState(model_cfg, tx, mesh, rules)
        names = _canonical_names(model_cfg)
        shapes = {p: tuple(a.shape) for p, a in _flat(layout.abstract.params)}
    moments = {path: 0 for path in shapes}
    other = []

    def count(path, leaf):
        moments[path] += 1
        return leaf

    map_param_leaves(count, layout.abstract.opt_state, shapes, other=lambda leaf: other.append(leaf) or leaf)
    params = tuple(ParamShape(path, tuple(a.shape), tuple(names[path]), np.dtype(a.dtype).itemsize, moments[path])
                   for path, a in _flat(layout.abstract.params))
    other_bytes = sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in other)
    return StateShapes(params, other_bytes, int(layout.num_params))


def _flat(tree):
    from jaxtrain.meshes.tree_paths import path_keys
    return [(path_keys(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _canonical_names(model_cfg) -> dict:
    from flax import nnx

    from jaxtrain.training.state import abstract_model
    from jaxtrain.models.layers.params import logical_axes
    _, abstract_state = abstract_model(model_cfg)
    return {path: logical_axes(var) for path, var in nnx.to_flat_state(abstract_state)}


class _MeshShape:
    """What spec_for reads of a mesh: its axis sizes."""

    def __init__(self, sizes: dict[str, int]):
        self.shape = dict(sizes)


def _axes(spec, ndim: int) -> tuple:
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)


def _shard_bytes(shape, spec_axes, sizes, itemsize) -> int:
    return itemsize * math.prod(-(-d // math.prod(sizes[a] for a in axes)) for d, axes in zip(shape, spec_axes))


def state_bytes(shapes: StateShapes, sizes: dict[str, int], rules: RuleSet) -> StateBytes:
    """Per-device bytes of `shapes` laid out by `rules` on a mesh of `sizes` (axis -> size).
    Raises meshes.rules.ShardingRuleError where a dimension does not divide its axes."""
    mesh = _MeshShape(sizes)
    leaves = []
    optimizer = 0
    for p in shapes.params:
        spec = _axes(spec_for(p.names, p.shape, rules.params, mesh), len(p.shape))
        per_device = _shard_bytes(p.shape, spec, sizes, p.itemsize)
        depth = p.names.index("layers") + 1 if "layers" in p.names else 0
        local_layers = math.prod(-(-d // math.prod(sizes[a] for a in axes))
                                 for d, axes in zip(p.shape[:depth], spec[:depth]))
        # splits along FSDP's names are gathered for compute; any other split divides the work
        gather = tuple(a for name, axes in zip(p.names, spec) if name in FSDP_GATHERED_NAMES for a in axes)
        compute = tuple(a for axes in spec for a in axes if a not in gather)
        gathered = per_device * math.prod(sizes[a] for a in gather) // local_layers
        opt_spec = _axes(spec_for(p.names, p.shape, rules.optimizer_table, mesh), len(p.shape))
        moment = _shard_bytes(p.shape, opt_spec, sizes, p.itemsize)
        optimizer += moment * p.moments
        leaves.append(ParamLeaf(p.path, p.names, p.shape, p.itemsize, per_device, local_layers, gather, gathered,
                                moment, compute))
    optimizer += shapes.other_optimizer_bytes
    on_host = rules.optimizer_memory != "device"
    return StateBytes(params=sum(leaf.bytes_per_device for leaf in leaves),
                      optimizer=0 if on_host else optimizer, optimizer_host=optimizer if on_host else 0,
                      leaves=tuple(leaves), num_params=shapes.num_params)
