"""The train step's gradient and parameter norms: one collective each, over each tree's own layouts.

meshes/leaf_sums.py reduces every leaf's sum of squares with one psum inside a shard_map whose
in_specs are the leaves' layouts. Gradients reach the update in the optimizer moments' layout
(under ZeRO-1 XLA reduce-scatters them there); a shard_map over the parameters' layouts made XLA
hold every gradient unreduced (make_update.gradient_layouts). Here: the update sums gradients
where they are (no more temp than per-leaf reductions), and a pipelined ZeRO-1 step, whose
gradients are in the stage layout, takes one psum per norm and the unpipelined model's norms."""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from helpers import TINY_LLAMA, assert_finite, random_packed_batch, with_train
from jaxtrain.pipeline.config import PipelineConfig
from jaxtrain.training.config import TrainConfig
from jaxtrain.training.optim import OptimizerConfig
from jaxtrain.training.parallel_plan import ParallelPlan
from jaxtrain.training.step import gradient_layouts, make_update
from jaxtrain.training.train_setup import build_train_setup
from jaxtrain.meshes.mesh import MeshConfig
from jaxtrain.meshes.rules import use_rules
from jaxtrain.models.llama import LlamaConfig
from pipeline_helpers import PIPELINE_OPT, initial_params

pytestmark = [pytest.mark.fast]


def _vector_all_reduces(hlo: str, length: int) -> int:
    """Compiled float32 all-reduces whose result is one [length] vector (leaf_sums' psum)."""
    return len(re.findall(rf"=\s*f32\[{length}\]\S*\s+all-reduce(?:-start)?\(", hlo))


# ---- the update alone: gradients arriving in the moments' layout (ZeRO-1) ----

UPDATE_MODEL = LlamaConfig(vocab_size=512, embed=128, layers=2, heads=4, kv_heads=4, mlp=512)


@functools.lru_cache(maxsize=1)
def _zero1_setup():
    return build_train_setup(UPDATE_MODEL, ParallelPlan.parse("data=8,rules=zero1"),
                             TrainConfig(global_batch=16, seq_len=16), OptimizerConfig(), jax.devices()[:8])


def _update_temp(params_layouts: str) -> int:
    """Temp bytes of the guarded update on data=8,rules=zero1 with the gradients given in the
    moments' layout (as the step's backward leaves them) and the norms' shard_map over
    `params_layouts`: "moments" (the step's choice), "params", or "per_leaf" (no shard_map)."""
    setup = _zero1_setup()
    shardings = setup.state.shardings
    moments = gradient_layouts(shardings.params, shardings.opt_state)
    update = make_update(setup.state.graphdef, setup.tx, setup.lr_schedule, rules=setup.rules,
                         opt_state_shardings=shardings.opt_state,
                         params_shardings=None if params_layouts == "per_leaf" else shardings.params,
                         # "params": the layouts the norms took before (the gradients gathered back)
                         grads_shardings=shardings.params if params_layouts == "params" else None)
    replicated = NamedSharding(setup.mesh, PartitionSpec())
    scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated)
    grads = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, jnp.float32, sharding=s),
                         setup.state.abstract.params, moments)

    def run(state, grads, nll, tokens):
        with use_rules(setup.mesh, setup.rules):
            return update(state, grads, (nll, nll, nll), {}, tokens, {})

    compiled = jax.jit(run, out_shardings=(shardings, replicated), donate_argnums=(0,)).lower(
        setup.state.abstract, grads, scalar, scalar).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_the_gradient_norm_sums_zero1_gradients_where_they_are():
    """ZeRO-1 (data=8): the moments, and so the gradients, are split 8 ways where the parameters
    are whole. The norms' one psum costs no more temp than per-leaf reductions; over the
    parameters' layouts it gathers the gradients first (the +1.25 GiB of the full-size draw)."""
    ours, per_leaf, over_params = (_update_temp(k) for k in ("moments", "per_leaf", "params"))
    params_bytes = sum(int(np.prod(p.shape)) * 4 for p in jax.tree.leaves(_zero1_setup().state.abstract.params))
    print(f"update temp (MiB): moments' layouts {ours / 2**20:.3f}, per leaf {per_leaf / 2**20:.3f}, "
          f"parameters' layouts {over_params / 2**20:.3f}; parameters {params_bytes / 2**20:.3f}")
    assert ours <= 1.02 * per_leaf, (ours, per_leaf)
    assert over_params - ours >= params_bytes / 2, (over_params, ours, params_bytes)


def test_gradient_layouts_are_the_moments_layouts():
    shardings = _zero1_setup().state.shardings
    got = gradient_layouts(shardings.params, shardings.opt_state)
    mu = next(s.mu for s in jax.tree.leaves(shardings.opt_state, is_leaf=lambda x: hasattr(x, "mu"))
              if hasattr(s, "mu"))
    assert jax.tree.structure(got) == jax.tree.structure(shardings.params)
    assert jax.tree.leaves(got) == jax.tree.leaves(mu)
    assert jax.tree.leaves(got) != jax.tree.leaves(shardings.params)  # zero1: split further
    assert gradient_layouts(shardings.params, None) is shardings.params


# ---- a pipelined ZeRO-1 step against the unpipelined model ----

LLAMA4 = dataclasses.replace(TINY_LLAMA, layers=4)
TRAIN = with_train(microbatches=2)


def _one_step(mesh_cfg, pipeline, rules, devices):
    plan = ParallelPlan(mesh=mesh_cfg, rules=rules, microbatches=TRAIN.microbatches).with_pipeline(pipeline)
    setup = build_train_setup(LLAMA4, plan, TRAIN, PIPELINE_OPT, devices)
    state = setup.state_from_params(initial_params(LLAMA4))
    batch = setup.device_batch(random_packed_batch(100, TRAIN.global_batch, TRAIN.seq_len, LLAMA4.vocab_size))
    compiled = setup.train_step.lower(state, batch).compile()
    _, metrics = compiled(state, batch)
    return jax.device_get(metrics), compiled.as_text(), len(jax.tree.leaves(state.params))


@pytest.fixture(scope="module")
def pipelined_and_reference():
    pipelined = _one_step(MeshConfig(pipeline=2, data=4), PipelineConfig(), "zero1", jax.devices()[:8])
    reference = _one_step(MeshConfig(data=1), None, "dp", jax.devices()[:1])
    return pipelined, reference


@pytest.mark.slow  # a multi-axis step compile: out of the edit-test lane
def test_a_pipelined_step_takes_one_psum_per_norm(pipelined_and_reference):
    (_, hlo, leaves), _ = pipelined_and_reference
    assert _vector_all_reduces(hlo, leaves) == 2, leaves  # the gradient norm and the parameter norm


@pytest.mark.slow  # a multi-axis step compile: out of the edit-test lane
def test_a_pipelined_steps_norms_equal_the_unpipelined_models(pipelined_and_reference):
    (metrics, _, _), (ref, _, _) = pipelined_and_reference
    assert_finite((metrics, ref), "metrics")
    assert float(metrics["nonfinite"]) == 0.0
    for key in ("loss", "grad_norm", "param_norm"):
        np.testing.assert_allclose(float(metrics[key]), float(ref[key]), rtol=1e-5, err_msg=key)


# ---- the update of a run over device groups ----

@pytest.mark.slow  # a multi-axis step compile: out of the edit-test lane
def test_a_grouped_steps_update_takes_one_psum_per_norm():
    """Two groups of 4 devices (12 and 4 rows, FSDP x tensor within each): the program that sums
    the groups' gradients and updates reduces each norm with one psum over all 8 devices, and
    its norms are those of the gradients it summed (float64)."""
    from jaxtrain.training.device_groups import DeviceGroups

    plan = ParallelPlan.parse("data=2,tensor=2,rules=fsdp,microbatches=4")
    setup = build_train_setup(TINY_LLAMA, plan, TRAIN, PIPELINE_OPT, jax.devices()[:8], groups=DeviceGroups(rows=(12, 4)))
    state = setup.state_from_params(initial_params(TINY_LLAMA))
    batches = setup.device_batch(random_packed_batch(100, TRAIN.global_batch, TRAIN.seq_len, TINY_LLAMA.vocab_size))
    inputs = setup.train_step.update_inputs(state, batches)  # the groups' stacked gradients, ...
    g64 = np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64).sum(0))) for g in jax.tree.leaves(inputs[0])))
    compiled = setup.train_step.lower_update(state, *inputs).compile()
    assert _vector_all_reduces(compiled.as_text(), len(jax.tree.leaves(state.params))) == 2
    _, metrics = compiled(state, *inputs)
    assert_finite(jax.device_get(metrics), "metrics")
    np.testing.assert_allclose(float(metrics["grad_norm"]), g64, rtol=1e-5)
