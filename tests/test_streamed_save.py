"""Saves of a pipelined run without a second copy of the state on the device (issue 26.2,
jaxtrain/pipeline/streamed_save.py): the canonical tree built layer by layer into host memory
equals the whole-tree regroup bit for bit, with the same fingerprints; a checkpoint saved under
pipeline=2 (3 layers: the stack does not divide the stages) restores exactly onto one device and
back onto pipeline=2; and the per-layer program holds one layer's slice, not the stack."""
import dataclasses
import math

import jax
import numpy as np
import pytest

from helpers import TINY_LLAMA, TINY_TRAIN
from jaxtrain.checkpoints.checkpointer import Checkpointer
from jaxtrain.checkpoints.fingerprint import tree_fingerprints
from jaxtrain.pipeline.config import PipelineConfig
from jaxtrain.training.parallel_plan import ParallelPlan
from jaxtrain.training.train_setup import build_train_setup
from jaxtrain.meshes.mesh import MeshConfig
from jaxtrain.meshes.pipeline_schedules import GPipe
from pipeline_helpers import PIPELINE_OPT, initial_params

pytestmark = [pytest.mark.fast]

MODEL = dataclasses.replace(TINY_LLAMA, layers=3)  # 3 layers over 2 stages: the canonical stack replicates
TRAIN = dataclasses.replace(TINY_TRAIN, microbatches=2)


def _setup(mesh_cfg, pipeline=None, devices=None):
    plan = ParallelPlan(mesh=mesh_cfg, rules="dp", microbatches=TRAIN.microbatches).with_pipeline(pipeline)
    return build_train_setup(MODEL, plan, TRAIN, PIPELINE_OPT, devices if devices is not None else jax.devices())


@pytest.fixture(scope="module")
def pipelined():
    setup = _setup(MeshConfig(pipeline=2, data=2), PipelineConfig(schedule=GPipe()), jax.devices()[:4])
    state = setup.state_from_params(initial_params(MODEL, seed=3))
    # non-trivial moments, distinct per leaf and layer (canonical, regrouped: padding slots zero)
    rng = np.random.default_rng(4)
    disk = setup.state.disk_abstract["opt_state"]
    canonical_opt = jax.tree.map(lambda x: jax.device_put(rng.standard_normal(x.shape).astype(x.dtype), x.sharding)
                                 if x.ndim else jax.device_put(np.zeros(x.shape, x.dtype), x.sharding), disk)
    opt = setup.state.from_disk({"opt_state": canonical_opt})["opt_state"]
    return setup, state.replace(opt_state=opt)


def test_the_streamed_canonical_tree_equals_the_whole_regroup(pipelined):
    setup, state = pipelined
    items = state.checkpoint_items()
    streamed = setup.state.to_disk(items)
    whole = setup.state._regroup(items, "to_canonical")
    for k in ("params", "opt_state"):
        got, want = jax.tree.leaves(streamed[k]), jax.tree.leaves(whole[k])
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    stacked = [x for x in jax.tree.leaves(streamed["params"]) if x.shape[:1] == (MODEL.layers,)]
    assert stacked and all(x.sharding.memory_kind == "pinned_host" for x in stacked)
    assert streamed.fingerprints  # precomputed for the stacks, equal to hashing the canonical arrays
    expected = tree_fingerprints({k: whole[k] for k in ("params", "opt_state")})
    assert {p: expected[p] for p in streamed.fingerprints} == streamed.fingerprints


def test_a_pipeline2_save_restores_exactly_on_one_device_and_on_pipeline2(pipelined, tmp_path):
    setup, state = pipelined
    canonical = jax.device_get(setup.state._regroup(state.checkpoint_items(), "to_canonical"))
    ckpt = Checkpointer(str(tmp_path / "ckpt"))  # async, as training saves
    ckpt.save(3, setup.state.to_disk(state.checkpoint_items()))
    ckpt.wait()

    one = _setup(MeshConfig(data=1), devices=jax.devices()[:1])
    abstract = one.state.abstract.checkpoint_items()
    restored = ckpt.restore(3, {k: abstract[k] for k in ("params", "opt_state")})  # verifies fingerprints
    for k in ("params", "opt_state"):
        for a, b in zip(jax.tree.leaves(restored[k]), jax.tree.leaves(canonical[k])):
            assert np.isfinite(np.asarray(a)).all()
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    disk = setup.state.disk_abstract
    back = setup.state.from_disk(ckpt.restore(3, {k: disk[k] for k in ("params", "opt_state")}))
    for k in ("params", "opt_state"):
        for a, b in zip(jax.tree.leaves(back[k]), jax.tree.leaves(state.checkpoint_items()[k])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ckpt.close()


def _save_program_bytes(setup):
    """(the largest per-layer program's outputs + temp, the whole regroup's outputs + temp), per
    device, compile only, on the abstract stage-layout state."""
    abstract = setup.state.abstract.checkpoint_items()
    items = {k: abstract[k] for k in ("params", "opt_state")}
    streamed = setup.state._streamed
    largest = 0
    for kind, _, leaves, shardings in streamed.groups(items):
        for leaf, sharding in zip(leaves, shardings):
            mem = streamed.layer_program(kind, [leaf], [sharding]).lower([leaf], *[np.int32(0)] * 4).compile()
            mem = mem.memory_analysis()
            largest = max(largest, mem.output_size_in_bytes + mem.temp_size_in_bytes)
    whole = jax.jit(setup.state.layout.to_canonical, out_shardings={k: setup.state.disk_shardings[k] for k in items})
    mem = whole.lower(items).compile().memory_analysis()
    return largest, mem.output_size_in_bytes + mem.temp_size_in_bytes


def test_the_save_program_holds_one_layer_not_the_stack(pipelined):
    """Compile-only: the per-layer programs' outputs and temp do not grow with the stack (3 and
    9 layers alike: one leaf's layer, its gather across stages and its hashing), while the
    whole regroup's (the old save) grows with it."""
    setup, _ = pipelined
    deeper = build_train_setup(dataclasses.replace(MODEL, layers=9), setup.plan, TRAIN, PIPELINE_OPT, jax.devices()[:4])
    (layer3, whole3), (layer9, whole9) = _save_program_bytes(setup), _save_program_bytes(deeper)
    assert layer3 == layer9 > 0, (layer3, layer9)
    assert whole9 > 2 * whole3 > 0 and whole3 > 3 * layer3, (whole3, whole9, layer3)
