"""bf16 compute with float32 master weights and optimizer state."""
import pytest
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from helpers import TINY_LLAMA, train_losses
from jaxtrain.meshes.mesh import MeshConfig

pytestmark = [pytest.mark.slow]


def test_bfloat16_compute_tracks_float32_and_keeps_float32_state():
    f32_losses, _ = train_losses(MeshConfig(data=4, tensor=4))
    bf16_losses, bf16_params = train_losses(MeshConfig(data=4, tensor=4),
                                            model=dataclasses.replace(TINY_LLAMA, dtype="bfloat16"))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(bf16_params))
    assert np.all(np.isfinite(bf16_losses))
    np.testing.assert_allclose(bf16_losses, f32_losses, rtol=2e-2)
