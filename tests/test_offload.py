"""Memory techniques that change where state lives, not what is computed: Adam state in host
memory (rules `+opt_host`) and activation offload as a remat policy (`offload_dots`) train with
the same losses and parameters as without them."""
import dataclasses

import jax
import numpy as np
import pytest

from helpers import TINY_LLAMA, TINY_OPT, assert_trees_close, initial_params, train_losses
from jaxtrain.checkpoints.checkpointer import Checkpointer
from jaxtrain.training.optim import make_optimizer
from jaxtrain.training.state import init_state, state_shardings
from jaxtrain.meshes.mesh import MeshConfig, build_mesh
from jaxtrain.meshes.rules import get_rule_set

pytestmark = [pytest.mark.slow]

MESH = MeshConfig(data=8, tensor=2)


@pytest.fixture(scope="module")
def on_device():
    init = initial_params(TINY_LLAMA)
    return init, train_losses(MESH, rules="zero1", init_params=init)


def test_optimizer_state_in_host_memory_trains_identically(on_device):
    init, (losses, params) = on_device
    host_losses, host_params = train_losses(MESH, rules="zero1+opt_host", init_params=init)
    assert np.isfinite(host_losses).all()
    np.testing.assert_allclose(host_losses, losses, rtol=1e-6)
    assert_trees_close(host_params, params, rtol=1e-6, atol=1e-7)


def test_host_optimizer_state_is_born_there_and_restores_there(tmp_path):
    mesh, rules = build_mesh(MESH), get_rule_set("zero1+opt_host")
    tx, _ = make_optimizer(TINY_OPT, 3)
    _, abstract, shardings = state_shardings(TINY_LLAMA, tx, mesh, rules)
    state = init_state(TINY_LLAMA, tx, shardings, seed=0)
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)}
    assert kinds == {"pinned_host"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.params)} == {"device"}
    checkpointer = Checkpointer(str(tmp_path / "checkpoints"), async_save=False)
    checkpointer.save(1, state.checkpoint_items())
    restored = checkpointer.restore(1, abstract.checkpoint_items())
    checkpointer.close()
    assert {x.sharding.memory_kind for x in jax.tree.leaves(restored["opt_state"])} == {"pinned_host"}
    assert_trees_close(jax.device_get(restored["opt_state"]), jax.device_get(state.opt_state), rtol=0)


def test_activation_offload_remat_trains_identically(on_device):
    init, (losses, params) = on_device
    model = dataclasses.replace(TINY_LLAMA, remat="offload_dots")
    off_losses, off_params = train_losses(MESH, model=model, rules="zero1", init_params=init)
    np.testing.assert_allclose(off_losses, losses, rtol=1e-6)
    # a thousandth of an Adam step (lr 1e-2): Adam amplifies rounding in near-zero gradients
    assert_trees_close(off_params, params, rtol=1e-5, atol=1e-5)


def test_activation_offload_moves_saved_matmuls_to_host_on_gpu():
    """XLA:CPU ignores the host placement; cross-lowered for a GPU the saved matmul outputs are
    annotated for pinned host memory (and `dots_no_batch`, the same without offload, is not)."""
    from flax import nnx

    def lowered(remat):
        model_cfg = dataclasses.replace(TINY_LLAMA, remat=remat)
        graphdef, state = nnx.split(nnx.eval_shape(lambda: model_cfg.build(nnx.Rngs(0))))
        params = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(state))
        tokens = jax.ShapeDtypeStruct((2, 16), np.int32)

        def loss(params, tokens):
            model = nnx.merge(graphdef, params)
            positions = jax.numpy.broadcast_to(jax.numpy.arange(16), (2, 16))
            hidden, _ = model.hidden(tokens, positions, jax.numpy.ones((2, 16), np.int32))
            return (hidden ** 2).sum()

        device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("d",), abstract_device=device)):
            return jax.jit(jax.grad(loss)).trace(params, tokens).lower(lowering_platforms=("cuda",)).as_text()

    assert "pinned_host" in lowered("offload_dots")
    assert "pinned_host" not in lowered("dots_no_batch")
