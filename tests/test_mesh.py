import itertools
import math

import pytest
from jax.sharding import PartitionSpec as P

from jaxtrain.meshes.mesh import AXES, MeshConfig, build_mesh, split_over_processes
from jaxtrain.meshes.rules import RULE_SETS, get_rule_set, spec_for

pytestmark = [pytest.mark.fast]


def factorizations(n: int, parts: int):
    powers = [2 ** i for i in range(int(math.log2(n)) + 1)]
    return [c for c in itertools.product(powers, repeat=parts) if math.prod(c) == n]


def test_every_factorization_of_16_builds():
    combos = factorizations(16, len(AXES))
    assert len(combos) == 70  # C(4 + 4, 4) ways to spread 2^4 over five axes
    for sizes in combos:
        mesh = build_mesh(MeshConfig(**dict(zip(AXES, sizes))))
        assert mesh.axis_names == AXES
        assert tuple(mesh.shape.values()) == sizes
        assert sorted(d.id for d in mesh.devices.flat) == list(range(16))


def test_fill_axis_takes_remaining_devices():
    mesh = build_mesh(MeshConfig(data=-1, tensor=4))
    assert dict(mesh.shape) == dict(pipeline=1, data=4, context=1, expert=1, tensor=4)


@pytest.mark.parametrize("cfg, message", [
    (MeshConfig(data=4, tensor=2), "needs 8 devices but 16 are available"),
    (MeshConfig(data=-1, tensor=3), "does not divide the 16 available"),
    (MeshConfig(data=-1, tensor=-1), "at most one mesh axis may be -1"),
    (MeshConfig(data=0, tensor=16), "must be positive"),
])
def test_invalid_mesh_names_the_sizes(cfg, message):
    with pytest.raises(ValueError, match=message) as err:
        build_mesh(cfg)
    assert "tensor=" in str(err.value) and "data=" in str(err.value)


def test_dcn_split_spreads_processes_over_outer_axes():
    sizes = dict(pipeline=2, data=4, context=1, expert=1, tensor=2)
    ici, dcn = split_over_processes(sizes, 2, None)
    assert dcn == [2, 1, 1, 1, 1] and ici == [1, 4, 1, 1, 2]
    ici, dcn = split_over_processes(dict(sizes, pipeline=1), 4, None)
    assert dcn == [1, 4, 1, 1, 1]
    with pytest.raises(ValueError, match="product equals the 2 processes"):
        split_over_processes(sizes, 2, (1, 1, 1, 1, 1))


def test_rule_resolution():
    mesh = build_mesh(MeshConfig(data=4, tensor=4))
    fsdp, dp = get_rule_set("fsdp"), get_rule_set("dp")
    assert spec_for(("embed", "heads", "head_dim"), (32, 8, 4), fsdp.params, mesh) == P("data", "tensor", None)
    assert spec_for(("embed", "heads", "head_dim"), (32, 8, 4), dp.params, mesh) == P(None, "tensor", None)
    # An odd vocabulary cannot split over tensor=4: that dimension stays replicated.
    assert spec_for(("vocab", "embed"), (97, 32), dp.params, mesh) == P(None, None)
    # A mesh axis is used once per tensor: batch takes data, FSDP's embed may not take it again.
    assert spec_for(("batch", "length", "embed"), (8, 16, 32), {**fsdp.activations, "embed": ("data",)}, mesh) \
        == P("data", None, None)
    with pytest.raises(ValueError, match="unknown rule table"):
        get_rule_set("nope")
    assert {"dp", "fsdp", "zero1", "dp_sp", "fsdp_sp"} <= set(RULE_SETS)


def test_fsdp_splits_expert_weights_over_their_expert_data_parallel_axes():
    """Folded experts on data=4 x context=2 x tensor=2: EP over data x context, EDP over tensor.
    FSDP keeps each expert weight 1/(EP x EDP) per device; with expert TP the hidden dim holds
    tensor instead; without FSDP the EDP copies stay whole."""
    from jaxtrain.models.layers.expert_ffn import WEIGHT_AXES

    mesh = build_mesh(MeshConfig(data=4, context=2, tensor=2))
    up, down = (64, 32, 16), (64, 16, 32)  # experts, embed, hidden / experts, hidden, embed
    spec = lambda rules, name, shape: spec_for(WEIGHT_AXES[name], shape, get_rule_set(rules).params, mesh)
    assert spec("fsdp+experts_folded", "up", up) == P(("data", "context"), "tensor", None)
    assert spec("fsdp+experts_folded", "down", down) == P(("data", "context"), None, "tensor")
    assert spec("fsdp+experts_folded+expert_tp", "up", up) == P(("data", "context"), None, "tensor")
    assert spec("fsdp+expert_tp+experts_folded", "down", down) == P(("data", "context"), "tensor", None)
    assert spec("dp+experts_folded", "up", up) == P(("data", "context"), None, None)
    # ZeRO-1: the optimizer state of expert weights is split over EDP, the weights are not.
    zero1 = get_rule_set("zero1+experts_folded")
    assert spec_for(WEIGHT_AXES["up"], up, zero1.optimizer_table, mesh) == P(("data", "context"), "tensor", None)
    assert spec_for(WEIGHT_AXES["up"], up, zero1.params, mesh) == P(("data", "context"), None, None)
