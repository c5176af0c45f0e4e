"""One model, any mesh: the same seed and batches give the same losses and parameters on one
device and on several 16-device layouts (float32)."""
import jax
import numpy as np
import pytest

from helpers import TINY_LLAMA, assert_finite, assert_trees_close, random_packed_batch, train_losses, with_train
from jaxtrain.meshes.mesh import MeshConfig

pytestmark = [pytest.mark.slow]

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
    assert_finite([losses, ref_losses], "losses")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(params, ref_params, rtol=PARAM_RTOL, atol=PARAM_ATOL)
    assert losses[-1] < losses[0] or not np.allclose(losses, losses[0])  # it actually trained


def test_gradient_accumulation_equals_one_batch():
    """4 microbatches of 2 rows give the same step as one batch of 8."""
    one, p_one = train_losses(MeshConfig(data=1), train=with_train(global_batch=8), devices=jax.devices()[:1])
    four, p_four = train_losses(MeshConfig(data=1), train=with_train(global_batch=8, microbatches=4),
                                devices=jax.devices()[:1])
    assert_finite([one, four], "losses")
    np.testing.assert_allclose(four, one, rtol=1e-5)
    assert_trees_close(p_four, p_one, rtol=PARAM_RTOL, atol=PARAM_ATOL)


# Loss tokens per row by row % 4. Microbatch i of m takes rows i, i+m, ... (split_microbatches):
# with m=2 the microbatches hold 46 and 4 loss tokens, with m=4 30, 4, 16 and 0 (an empty one).
UNEQUAL_TOKENS = (15, 2, 8, 0)


def unequal_batch(step: int, batch: int = 8, length: int = 16) -> dict:
    host = random_packed_batch(200 + step, batch, length, TINY_LLAMA.vocab_size)
    for r in range(batch):
        host["loss_mask"][r, UNEQUAL_TOKENS[r % 4]:] = 0.0
    return host


@pytest.fixture(scope="module")
def unequal_one_batch():
    return train_losses(MeshConfig(data=1), train=with_train(global_batch=8), devices=jax.devices()[:1],
                        batch_fn=unequal_batch)


@pytest.mark.parametrize("microbatches", [2, 4])
def test_gradient_accumulation_weights_microbatches_by_their_tokens(unequal_one_batch, microbatches):
    """Microbatches with very different loss-token counts still give the one-batch step: each
    adds its token sum over the whole batch's tokens (a mean of microbatch means would not)."""
    sizes = [unequal_batch(0)["loss_mask"][i::microbatches].sum() for i in range(microbatches)]
    assert max(sizes) >= 4 * max(min(sizes), 1), sizes
    one, p_one = unequal_one_batch
    acc, p_acc = train_losses(MeshConfig(data=1), train=with_train(global_batch=8, microbatches=microbatches),
                              devices=jax.devices()[:1], batch_fn=unequal_batch)
    assert_finite([one, acc], "losses")
    np.testing.assert_allclose(acc, one, rtol=1e-5)
    assert_trees_close(p_acc, p_one, rtol=PARAM_RTOL, atol=PARAM_ATOL)
