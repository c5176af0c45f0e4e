"""Llama pipelined over 2 and 4 stages (GPipe and interleaved, microbatches = and > stages,
with data, tensor, context (sequence parallel) and FSDP) trains exactly like the unpipelined
model on one device."""
import dataclasses

import jax
import numpy as np
import pytest

from helpers import TINY_LLAMA, assert_trees_close, with_train
from jaxtrain.pipeline.config import PipelineConfig
from jaxtrain.meshes.mesh import MeshConfig
from jaxtrain.meshes.pipeline_schedules import GPipe, Interleaved
from pipeline_helpers import initial_params, run_steps

pytestmark = [pytest.mark.slow]

LLAMA8 = dataclasses.replace(TINY_LLAMA, layers=8)
PARAM_RTOL, PARAM_ATOL = 1e-4, 1e-4  # as tests/test_parallel_equivalence.py


@pytest.fixture(scope="module")
def reference():
    params0 = initial_params(LLAMA8)
    losses, params, _, _, _ = run_steps(MeshConfig(data=1), LLAMA8, with_train(microbatches=2), params0,
                                        devices=jax.devices()[:1])
    return params0, losses, params


CASES = {
    # 8 layers as 4 uneven chunks (3, 2, 2, 1) over 2 stages x 2 passes; microbatches = stages
    "pipeline2_interleaved_data4_tensor2_m2": (MeshConfig(pipeline=2, data=4, tensor=2), "dp",
                                               PipelineConfig(schedule=Interleaved(2), stages_layers=(3, 2, 2, 1)), 2),
    # uneven 4-stage split (3, 2, 2, 1) with padding; FSDP; microbatches > stages
    "pipeline4_gpipe_fsdp_data2_tensor2_m8": (MeshConfig(pipeline=4, data=2, tensor=2), "fsdp",
                                              PipelineConfig(schedule=GPipe(), stages_layers=(3, 2, 2, 1),
                                                             remat="stage"), 8),
    # residual stream split over context x tensor (sequence parallel), parameters over data x
    # context (FSDP): the layout whose head gradient XLA got wrong (pipeline_step.py); m > stages
    "pipeline2_gpipe_fsdp_sp_context2_data2_tensor2_m4": (MeshConfig(pipeline=2, data=2, context=2, tensor=2),
                                                          "fsdp_sp", PipelineConfig(), 4),
    # 8 chunks of one layer over 4 stages x 2 passes; microbatches = stages
    "pipeline4_interleaved_fsdp_context2_data2_m4": (MeshConfig(pipeline=4, data=2, context=2), "fsdp",
                                                     PipelineConfig(schedule=Interleaved(2)), 4),
}


# the context-parallel case runs in `make test-extended` (the suite's budget; tests/test_context_parallel.py
# keeps context parallelism in the suite)
@pytest.mark.parametrize("case", [pytest.param(name, marks=[pytest.mark.extended] if name == "pipeline2_gpipe_fsdp_sp_context2_data2_tensor2_m4" else [])
                                  for name in sorted(CASES)])
def test_pipelined_llama_matches_one_device(reference, case):
    mesh_cfg, rules, pipeline, microbatches = CASES[case]
    params0, ref_losses, ref_params = reference
    losses, params, metrics, _, setup = run_steps(mesh_cfg, LLAMA8, with_train(microbatches=microbatches), params0,
                                                  pipeline=pipeline, rules=rules)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(params, ref_params, rtol=PARAM_RTOL, atol=PARAM_ATOL)
    stages = mesh_cfg.pipeline
    assert metrics["pipeline_bubble"] == pytest.approx(pipeline.schedule.bubble_fraction(stages, microbatches))
