"""The ragged expert exchange (GPU only: XLA:CPU has no ragged_all_to_all): its offsets are
checked by simulating the collective's semantics in numpy, and the whole expert-parallel MoE
is cross-lowered for CUDA to check it emits ragged collectives."""
import pytest
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from jaxtrain.meshes.expert_exchange import make_exchange, ragged_back_plan, ragged_send_plan, PaddedExchange
from jaxtrain.meshes.experts import moe_forward
from jaxtrain.meshes.mesh import AXES
from jaxtrain.meshes.rules import get_rule_set, use_rules
from jaxtrain.models.layers.expert_ffn import WEIGHT_AXES, GatedExperts
from jaxtrain.models.layers.moe import make_route_fn
from jaxtrain.models.layers.router import RouterConfig

pytestmark = [pytest.mark.fast]


def simulate_ragged_all_to_all(operands, outputs, plans):
    """numpy semantics of jax.lax.ragged_all_to_all over devices 0..P-1: device i sends
    operand[in_off[j]: in_off[j] + size[j]] to device j, landing at out_off[j] there."""
    outputs = [o.copy() for o in outputs]
    for i, (in_off, sizes, out_off, _) in enumerate(plans):
        for j in range(len(outputs)):
            n = int(sizes[j])
            outputs[j][int(out_off[j]): int(out_off[j]) + n] = operands[i][int(in_off[j]): int(in_off[j]) + n]
    return outputs


def test_ragged_offsets_route_every_row_there_and_back():
    rng = np.random.default_rng(11)
    devices, slots = 4, 10
    dests = [np.sort(rng.integers(0, devices + 1, slots)) for _ in range(devices)]  # `devices` = dropped
    matrix = np.stack([np.bincount(d, minlength=devices + 1)[:devices] for d in dests])
    rows = [np.stack([np.full(3, 100 * i + s) for s in range(slots)]) for i in range(devices)]
    send = [ragged_send_plan(jnp.asarray(matrix), i) for i in range(devices)]
    for i, plan in enumerate(send):  # receive sizes agree with what the senders send
        np.testing.assert_array_equal(np.asarray(plan[3]), matrix[:, i])
    recv = simulate_ragged_all_to_all(rows, [np.full((devices * slots, 3), -1)] * devices, send)
    for j in range(devices):  # device j holds exactly the rows addressed to it, sender by sender
        expected = [rows[i][dests[i] == j] for i in range(devices)]
        filled = sum(len(e) for e in expected)
        np.testing.assert_array_equal(recv[j][:filled], np.concatenate(expected))
        assert np.all(recv[j][filled:] == -1)
    back = simulate_ragged_all_to_all(recv, [np.zeros((slots, 3), int)] * devices,
                                      [ragged_back_plan(jnp.asarray(matrix), j) for j in range(devices)])
    for i in range(devices):
        sent = dests[i] < devices
        np.testing.assert_array_equal(back[i][sent], rows[i][sent])


def test_expert_parallel_moe_lowers_to_ragged_collectives_for_cuda():
    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1, 2, 1, 4, 1), AXES, axis_types=(AxisType.Auto,) * 5, abstract_device=device)
    experts, embed, hidden = 8, 16, 32
    module = GatedExperts(experts, embed, hidden, rngs=nnx.Rngs(0))
    weights = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in module.weights().items()}
    rules = get_rule_set("dp")

    def forward(x, logits, w):
        with use_rules(mesh, rules):
            return moe_forward(x, logits, None, w, WEIGHT_AXES, route=make_route_fn(RouterConfig(experts, 2), "xla"),
                               ffn=lambda t, s, ws: module.compute(t, s, ws, "xla"), num_experts=experts,
                               hidden=hidden, mesh=mesh, rules=rules)

    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(forward).trace(jax.ShapeDtypeStruct((8, 16, embed), jnp.float32),
                                      jax.ShapeDtypeStruct((8, 16, experts), jnp.float32),
                                      weights).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("ragged_all_to_all") == 3  # tokens and ids out, results back


def test_auto_exchange_is_padded_on_cpu():
    assert isinstance(make_exchange("auto", ("expert",), 4, jax.devices()[0].platform), PaddedExchange)
