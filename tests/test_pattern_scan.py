"""The scanned hybrid pattern (models/layers/pattern_stack.py: one `lax.scan` over the layers,
a `lax.switch` on each layer's kind) equals a plain Python loop over the same layers: gradients
at the initial parameters, and three train steps' losses, MoE statistics (which feed the router
bias updates) and final parameters — on one device and on data=4 x tensor=2."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import TINY_OPT, TINY_TRAIN, assert_trees_close, initial_params, random_packed_batch, train_losses
from jaxtrain.training.optim import make_optimizer
from jaxtrain.training.run_configs import LossConfig
from jaxtrain.training.state import state_shardings
from jaxtrain.training.step import AccumulatedGradients, batch_shardings
from jaxtrain.meshes.mesh import MeshConfig, build_mesh
from jaxtrain.meshes.rules import get_rule_set, use_rules
from jaxtrain.models.layers.pattern_stack import PatternStack
from jaxtrain.models.layers.stack import REMAT_POLICIES
from test_nemotron_h import TINY_NEMOTRON_H

# The model-level twin of tests/test_layer_scan.py (which checks the one scan helper against a Python
# loop under every remat policy, gradients included): `make test-extended`, for the suite's budget.
pytestmark = [pytest.mark.slow, pytest.mark.extended]

# Kinds repeat out of order, three MoE layers apart from each other: a wrong layer index or a
# misplaced aux row changes the numbers.
PATTERN = ("mamba", "moe", "mamba", "attention", "moe", "mlp", "mamba", "moe")


def unrolled_call(self, x, positions, segment_ids):
    """The reference: each layer statically sliced out of its kind's stack, in pattern order."""
    per_kind = {kind: [] for kind in self.kinds}
    for kind, index in self.slots:
        graphdef, state = nnx.split(self.stack(kind).layers)

        def layer(carry, weights, graphdef=graphdef):
            return nnx.merge(graphdef, weights)(carry, positions, segment_ids)

        if self.remat != "none":
            layer = jax.checkpoint(layer, policy=REMAT_POLICIES[self.remat])
        x, aux = layer(x, jax.tree.map(lambda a: a[index], state))
        per_kind[kind].append(aux)
    return x, {kind: jax.tree.map(lambda *a: jnp.stack(a), *auxes) for kind, auxes in per_kind.items()}


def gradients(model, mesh_cfg, devices, params):
    """The loss gradient and the MoE aux at `params` for one random packed batch."""
    mesh, rules = build_mesh(mesh_cfg, devices), get_rule_set("dp")
    tx, _ = make_optimizer(TINY_OPT, TINY_TRAIN.steps)
    graphdef, _, shardings = state_shardings(model, tx, mesh, rules)
    bsh = batch_shardings(mesh, rules, TINY_TRAIN.global_batch, TINY_TRAIN.seq_len)
    grad_fn = AccumulatedGradients(graphdef, microbatches=1, loss_chunk=LossConfig().loss_chunk, z_loss=0.0)

    def run(params, batch):
        with use_rules(mesh, rules):
            grads, _, aux = grad_fn(params, batch, jnp.maximum(batch["loss_mask"].sum(), 1.0))
        return grads, aux

    host = random_packed_batch(7, TINY_TRAIN.global_batch, TINY_TRAIN.seq_len, model.vocab_size)
    batch = {k: jax.device_put(v, bsh[k]) for k, v in host.items()}
    return jax.device_get(jax.jit(run)(jax.device_put(params, shardings.params), batch))


# The two layouts; remat "full" (the checkpointed scan step) is covered on the mesh, so
# one device runs without remat (~40 s of the suite saved by not also running it with "full").
CASES = {  # name: (mesh, devices used, remat)
    "one_device_remat_none": (MeshConfig(data=1), 1, "none"),
    "data4_tensor2_remat_full": (MeshConfig(data=4, tensor=2), 8, "full"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_scanned_pattern_equals_unrolled_loop(case, monkeypatch):
    mesh_cfg, n, remat = CASES[case]
    model = dataclasses.replace(TINY_NEMOTRON_H, pattern=PATTERN, remat=remat)
    devices, params0 = jax.devices()[:n], initial_params(model)

    def both(fn):
        scanned = fn()
        with monkeypatch.context() as patch:
            patch.setattr(PatternStack, "__call__", unrolled_call)
            unrolled = fn()
        return scanned, unrolled

    (grads, aux), (ref_grads, ref_aux) = both(lambda: gradients(model, mesh_cfg, devices, params0))
    assert np.abs(grads["stacks"]["blocks"]["moe"]["layers"]["moe"]["experts"]["up"]).max() > 0
    assert_trees_close(grads, ref_grads, rtol=1e-4, atol=1e-7)
    assert_trees_close(aux, ref_aux, rtol=1e-5, atol=1e-6)  # per kind, rows in pattern order

    run = lambda: train_losses(mesh_cfg, model=model, devices=devices, init_params=params0, with_metrics=True)
    (losses, params, history), (ref_losses, ref_params, ref_history) = both(run)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    moe = sorted(k for k in history[-1] if k.startswith("moe/"))
    assert len([k for k in moe if k.endswith("load_max_over_mean")]) == 3
    assert_trees_close([{k: h[k] for k in moe} for h in history], [{k: h[k] for k in moe} for h in ref_history],
                       rtol=1e-5, atol=1e-6)
    assert_trees_close(params, ref_params, rtol=1e-4, atol=1e-5)  # router correction biases included
