"""Typed layer outputs: the generic loss, metrics and post-update walk find them by type, and
the MoE statistics' metrics equal a direct numpy computation."""
import pytest
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxtrain.models.layers.aux_outputs import AuxOutput, apply_after_update, aux_metrics, has_after_update, total_aux_loss
from jaxtrain.models.layers.moe import RoutingStats

pytestmark = [pytest.mark.fast]


@struct.dataclass
class _Penalty(AuxOutput):
    value: jax.Array

    def loss(self):
        return 2.0 * self.value


def _routing(rng, layers, experts):
    load = rng.integers(0, 9, (layers, experts)).astype(np.float32)
    return RoutingStats(expert_load=jnp.asarray(load), score_sum=jnp.ones((layers, experts)),
                        z_sum=jnp.ones(layers), entropy_sum=jnp.asarray(rng.uniform(1, 2, layers), jnp.float32),
                        tokens=jnp.full((layers,), 4.0), dropped=jnp.asarray(rng.integers(0, 3, layers), jnp.float32),
                        aux_loss=jnp.asarray(rng.uniform(0, 1, layers), jnp.float32))


def test_loss_sums_every_typed_output_whatever_its_place_and_ignores_plain_leaves():
    rng = np.random.default_rng(0)
    moe = _routing(rng, 3, 4)
    aux = {"dense": {}, "moe_blocks": {"moe": moe, "note": jnp.ones(3)}, "other": {"x": _Penalty(jnp.ones(2))}}
    np.testing.assert_allclose(total_aux_loss(aux), float(moe.aux_loss.sum()) + 2.0 * 2, rtol=1e-6)
    assert has_after_update(aux) and not has_after_update({"other": {"x": _Penalty(jnp.ones(2))}})


def test_routing_metrics_equal_numpy():
    rng = np.random.default_rng(1)
    a, b = _routing(rng, 2, 4), _routing(rng, 1, 4)
    m = aux_metrics({"moe_blocks": {"moe": a}, "blocks": {"moe": {"moe": b}}}, microbatches=2)
    load = np.asarray(a.expert_load)
    np.testing.assert_allclose(m["moe/moe_blocks1/load_max_over_mean"], load[1].max() / load[1].mean(), rtol=1e-6)
    np.testing.assert_allclose(m["moe/moe_blocks0/router_entropy"], float(a.entropy_sum[0]) / 4.0, rtol=1e-6)
    np.testing.assert_allclose(m["moe/blocks/aux_loss"], float(b.aux_loss.sum()) / 2, rtol=1e-6)
    dropped = float(a.dropped.sum() + b.dropped.sum())
    slots = float(a.expert_load.sum() + b.expert_load.sum())
    np.testing.assert_allclose(m["moe/dropped_fraction"], dropped / slots, rtol=1e-6)
    assert aux_metrics({"blocks": {"mlp": {}}}) == {}  # no MoE layer: no MoE metrics


class _Leaf(nnx.Module):
    def __init__(self):
        self.seen = nnx.Param(jnp.zeros(()))

    def after_update(self, out):
        self.seen[...] = self.seen[...] + out.value.sum()


class _Tree(nnx.Module):
    def __init__(self):
        self.left, self.right = _Leaf(), _Leaf()


def test_after_update_reaches_the_module_that_produced_each_output():
    tree = _Tree()
    apply_after_update(tree, {"left": _Penalty(jnp.full(2, 3.0)), "missing": _Penalty(jnp.ones(1)), "right": {}})
    assert float(tree.left.seen[...]) == 6.0 and float(tree.right.seen[...]) == 0.0
