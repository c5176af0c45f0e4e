"""One model, any mesh: the same seed and batches give the same losses and parameters on one
device and on several 16-device layouts (float32)."""
import jax
import numpy as np
import pytest

from helpers import assert_trees_close, train_losses, with_train
from meshes.mesh import MeshConfig

# Adam normalizes each update to about lr (1e-2 here), so for a weight whose gradient is near
# zero a last-ulp difference in the gradient (another reduction order) can move it by up to
# ~3e-5. The tolerance is 1% of one step's update: a real sharding bug moves weights by ~lr.
PARAM_RTOL, PARAM_ATOL = 1e-4, 1e-4


@pytest.fixture(scope="module")
def single_device():
    return train_losses(MeshConfig(data=1), devices=jax.devices()[:1])


LAYOUTS = {
    "data16": (MeshConfig(data=16), "dp"),
    "data4_tensor4": (MeshConfig(data=4, tensor=4), "dp"),
    "fsdp_data8_tensor2": (MeshConfig(data=8, tensor=2), "fsdp"),
    "data2_expert2_tensor4": (MeshConfig(data=2, expert=2, tensor=4), "dp"),
    "zero1_sequence_parallel_context2": (MeshConfig(data=4, context=2, tensor=2), "dp_sp"),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_matches_single_device(single_device, layout):
    mesh_cfg, rules = LAYOUTS[layout]
    ref_losses, ref_params = single_device
    losses, params = train_losses(mesh_cfg, rules=rules)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(params, ref_params, rtol=PARAM_RTOL, atol=PARAM_ATOL)
    assert losses[-1] < losses[0] or not np.allclose(losses, losses[0])  # it actually trained


def test_gradient_accumulation_equals_one_batch():
    """4 microbatches of 2 rows give the same step as one batch of 8."""
    one, p_one = train_losses(MeshConfig(data=1), train=with_train(global_batch=8), devices=jax.devices()[:1])
    four, p_four = train_losses(MeshConfig(data=1), train=with_train(global_batch=8, microbatches=4),
                                devices=jax.devices()[:1])
    np.testing.assert_allclose(four, one, rtol=1e-5)
    assert_trees_close(p_four, p_one, rtol=PARAM_RTOL, atol=PARAM_ATOL)
