"""DeepSeek-V2 (tiny, 27 layers: 1 dense + 26 MoE) pipelined trains like the unpipelined model on
one device: GPipe 14/13 in the reference layout (tensor 2 x data 4, experts folded EP 4 x EDP 2),
7/7/7/6 interleaved (2 stages x 2 passes, both layer kinds padded) with FSDP and an expert axis,
and 7/7/7/6 as 4 GPipe stages (microbatches = stages). Losses, parameters, MoE metrics and router
biases all match; each pipeline group holds only its stage's layers and their optimizer state."""
import dataclasses

import jax
import numpy as np
import pytest

from helpers import assert_trees_close, with_train
from jaxtrain.pipeline.config import PipelineConfig
from jaxtrain.meshes.mesh import MeshConfig
from jaxtrain.meshes.pipeline_schedules import Interleaved
from pipeline_helpers import initial_params, run_steps
from test_deepseek import TINY_DEEPSEEK

pytestmark = [pytest.mark.slow]

DEEPSEEK27 = dataclasses.replace(TINY_DEEPSEEK, layers=27)
TRAIN = with_train(microbatches=4)  # MoE aux losses are per microbatch: the reference uses as many


# Top-k routing is discontinuous: float-level noise, which any change of layout brings (pipelined
# or not), flips the rare near-tie between two experts' scores and moves that expert's weights by
# ~lr. With seed 2, say, data=4 x tensor=2 without a pipeline differs from one device in layer 19's
# expert 5 after 3 steps, while the pipelined run equals it exactly. Seed 1 has no such tie.
SEED = 1


@pytest.fixture(scope="module")
def reference():
    params0 = initial_params(DEEPSEEK27, SEED)
    losses, params, metrics, _, _ = run_steps(MeshConfig(data=1), DEEPSEEK27, TRAIN, params0,
                                              devices=jax.devices()[:1])
    return params0, losses, params, metrics


CASES = {
    "pipeline2_14_13_gpipe_tensor2_data4_folded": (
        MeshConfig(pipeline=2, data=4, tensor=2), "dp+experts_folded", PipelineConfig(stages_layers=(14, 13))),
    "pipeline2_7_7_7_6_interleaved_fsdp_data2_expert2_tensor2": (
        MeshConfig(pipeline=2, data=2, expert=2, tensor=2), "fsdp",
        PipelineConfig(schedule=Interleaved(2), stages_layers=(7, 7, 7, 6), remat="layer")),
    "pipeline4_7_7_7_6_gpipe_tensor2_data2_folded": (
        MeshConfig(pipeline=4, data=2, tensor=2), "dp+experts_folded", PipelineConfig(stages_layers=(7, 7, 7, 6))),
}


# Every case runs in `make test-extended` (the suite's budget; the 14/13 split also in `make
# test-reference` on the reference layout). In the suite, a pipelined DeepSeek trains through every
# stage in tests/test_lora_families.py (pipeline2_data2_expert2_tensor2, against peft), and uneven
# interleaved splits equal their layers one by one in tests/test_layer_scan.py.
EXTENDED = {"pipeline4_7_7_7_6_gpipe_tensor2_data2_folded", "pipeline2_14_13_gpipe_tensor2_data4_folded",
            "pipeline2_7_7_7_6_interleaved_fsdp_data2_expert2_tensor2"}


@pytest.fixture(scope="module", params=[pytest.param(name, marks=[pytest.mark.extended] if name in EXTENDED else [])
                                        for name in sorted(CASES)])
def pipelined(request, reference):
    mesh_cfg, rules, pipeline = CASES[request.param]
    return request.param, run_steps(mesh_cfg, DEEPSEEK27, TRAIN, reference[0], pipeline=pipeline, rules=rules)


def test_pipelined_deepseek_matches_one_device(reference, pipelined):
    _, ref_losses, ref_params, ref_metrics = reference
    _, (losses, params, metrics, _, _) = pipelined
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(params, ref_params, rtol=1e-4, atol=1e-4)
    moe = sorted(k for k in ref_metrics if k.startswith("moe/"))
    assert len(moe) == 2 * 26 + 2 and sorted(k for k in metrics if k.startswith("moe/")) == moe
    np.testing.assert_allclose([metrics[k] for k in moe], [ref_metrics[k] for k in moe], rtol=1e-4, atol=1e-6)


def test_each_stage_holds_only_its_layers(pipelined):
    """Every stacked parameter's shard holds one stage; per device that is 1/stages of the
    stacks plus the stated padding (a padded slot = one layer of that kind)."""
    name, (_, _, _, state, setup) = pipelined
    plan = setup.state.layout.plan
    canonical_bytes = staged_bytes = 0
    for path, shape in setup.state.layout.stage_shapes.items():
        if path not in setup.state.layout.kind_of:
            continue
        leaf = state.params
        for key in path:
            leaf = leaf[key]
        shard = leaf.addressable_shards[0].data
        assert shard.shape[0] == 1 and shard.shape[1:3] == shape[1:3], (path, shard.shape)  # one stage, all its slots
        layer_bytes = shard.nbytes / (shape[1] * shape[2])
        staged_bytes += shard.nbytes
        canonical_bytes += layer_bytes * setup.state.layout.canonical_shapes[path][0]
    for path, leaf in jax.tree_util.tree_leaves_with_path(state.opt_state):  # Adam moments likewise
        keys = tuple(getattr(k, "key", getattr(k, "name", None)) for k in path)
        if any(keys[i:] in setup.state.layout.kind_of for i in range(len(keys))):
            assert leaf.addressable_shards[0].data.shape[0] == 1, keys
    if "14_13" in name:  # the reference split pads one slot: the dense layer, on stage 1
        assert plan.padding() == {("stacks", "dense_blocks"): [0, 1], ("stacks", "moe_blocks"): [0, 0]}
    ratio = staged_bytes / canonical_bytes
    print(f"{name}: per-device stacked parameters {ratio:.3f} of unpipelined; padding {plan.padding()}")
    assert ratio < 1 / plan.stages + 0.1
