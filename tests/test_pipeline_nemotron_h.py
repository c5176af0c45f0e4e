"""Nemotron-H (tiny, 8 layers of all four kinds: mamba, moe, attention, mlp) pipelined over 4
stages x 2 passes, over 2 GPipe stages with the sequence split over context x tensor, and over
2 GPipe stages split unevenly (5 / 3 layers) with every layer recomputed: each
stage runs one common slot pattern of kinds, padding the slots its own layers do not fill, and
holds only its layers; training equals the unpipelined model on one device."""
import dataclasses

import jax
import numpy as np
import pytest

from helpers import assert_trees_close, with_train
from jaxtrain.pipeline.config import PipelineConfig
from jaxtrain.meshes.mesh import MeshConfig
from jaxtrain.meshes.pipeline_schedules import Interleaved
from pipeline_helpers import initial_params, run_steps
from test_nemotron_h import TINY_NEMOTRON_H

pytestmark = [pytest.mark.slow]

NEMOTRON8 = dataclasses.replace(TINY_NEMOTRON_H, pattern=("mamba", "moe", "attention", "mlp",
                                                          "mamba", "moe", "mamba", "attention"))
TRAIN = with_train(microbatches=4)


@pytest.fixture(scope="module")
def reference():
    params0 = initial_params(NEMOTRON8)
    losses, params, _, _, _ = run_steps(MeshConfig(data=1), NEMOTRON8, TRAIN, params0, devices=jax.devices()[:1])
    return params0, losses, params


CASES = {
    # 8 chunks of one layer, two per stage: every stage pads the kinds its chunks lack
    "pipeline4_interleaved_fsdp_data2_expert2": (MeshConfig(pipeline=4, data=2, expert=2), "fsdp",
                                                 PipelineConfig(schedule=Interleaved(2))),
    # computed split; mamba scans and attention over a sequence split across context x tensor
    "pipeline2_gpipe_dp_sp_context2_data2_tensor2": (MeshConfig(pipeline=2, data=2, context=2, tensor=2), "dp_sp",
                                                     PipelineConfig()),
    # an uneven split: 5 / 3 layers on 6 slots (1 padding slot on stage 0, 3 on stage 1), every
    # layer recomputed
    "pipeline2_uneven_5_3_layer_remat_fsdp_data2_tensor4": (
        MeshConfig(pipeline=2, data=2, tensor=4), "fsdp", PipelineConfig(stages_layers=(5, 3), remat="layer")),
}


# The pipeline=4 case and the context-parallel dp_sp case run in `make test-extended` (the suite's
# budget): the uneven two-stage split with layer remat stays in the suite.
EXTENDED = {"pipeline4_interleaved_fsdp_data2_expert2", "pipeline2_gpipe_dp_sp_context2_data2_tensor2"}


@pytest.mark.parametrize("case", [pytest.param(name, marks=[pytest.mark.extended] if name in EXTENDED else [])
                                  for name in sorted(CASES)])
def test_pipelined_nemotron_h_matches_one_device(reference, case):
    mesh_cfg, rules, pipeline = CASES[case]
    params0, ref_losses, ref_params = reference
    losses, params, _, state, setup = run_steps(mesh_cfg, NEMOTRON8, TRAIN, params0, pipeline=pipeline, rules=rules)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(params, ref_params, rtol=1e-4, atol=1e-4)
    layout = setup.state.layout
    for path in layout.kind_of:  # every stacked parameter: one stage per device
        leaf = state.params
        for key in path:
            leaf = leaf[key]
        assert leaf.addressable_shards[0].data.shape[0] == 1, path
