"""DeepSeek-V2 (tiny): one model, any mesh — expert parallel, folded experts, expert tensor
parallel and FSDP layouts on 16 devices equal one device; MoE metrics and the aux-loss-free bias
flow through the train step."""
import jax
import numpy as np
import pytest

from helpers import assert_trees_close, train_losses
from jaxtrain.meshes.mesh import MeshConfig
from jaxtrain.models.deepseek import DeepSeekConfig
from jaxtrain.models.layers.router import RouterConfig

pytestmark = [pytest.mark.slow]

TINY_DEEPSEEK = DeepSeekConfig(
    vocab_size=96, embed=32, layers=3, first_k_dense=1, heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=4, v_head_dim=8, mlp=64, expert_mlp=16, shared_experts=2,
    router=RouterConfig(num_experts=16, top_k=3, n_group=4, topk_group=2, routed_scaling_factor=1.5,
                        aux_loss_weight=0.01, z_loss_weight=1e-3, correction_bias=True))


@pytest.fixture(scope="module")
def single_device():
    return train_losses(MeshConfig(data=1), model=TINY_DEEPSEEK, devices=jax.devices()[:1], with_metrics=True)


LAYOUTS = {
    "expert16": (MeshConfig(expert=16), "dp"),
    "expert4_data4": (MeshConfig(expert=4, data=4), "dp"),
    "folded_reference_shape": (MeshConfig(data=4, context=2, tensor=2), "fsdp+experts_folded"),  # EDP-split experts
    "expert_tensor_parallel": (MeshConfig(data=4, expert=2, tensor=2), "dp+expert_tp"),
    "fsdp_expert_tensor_parallel": (MeshConfig(data=4, expert=2, tensor=2), "fsdp+expert_tp"),
}


# All 16 devices on experts, expert-tensor parallelism under plain data parallelism, expert=4
# beside data=4 and the reference shape with folded experts run in `make test-extended` (the suite's
# budget); in the suite, fsdp_expert_tensor_parallel keeps expert parallelism (all-to-all dispatch)
# with the experts' hidden split over tensor, and tests/test_context_parallel.py's
# context4_data4_folded_experts the experts folded over data.
EXTENDED_LAYOUTS = {"expert16", "expert_tensor_parallel", "expert4_data4", "folded_reference_shape"}


@pytest.mark.parametrize("layout", [pytest.param(name, marks=[pytest.mark.extended] if name in EXTENDED_LAYOUTS else [])
                                    for name in sorted(LAYOUTS)])
def test_layout_matches_single_device(single_device, layout):
    mesh_cfg, rules = LAYOUTS[layout]
    ref_losses, ref_params, _ = single_device
    losses, params = train_losses(mesh_cfg, model=TINY_DEEPSEEK, rules=rules)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(params, ref_params, rtol=1e-4, atol=1e-4)


def test_moe_metrics_and_bias_updates(single_device):
    losses, params, history = single_device
    assert np.all(np.isfinite(losses))
    moe = {k: v for k, v in history[-1].items() if k.startswith("moe/")}
    assert len([k for k in moe if k.endswith("load_max_over_mean")]) == TINY_DEEPSEEK.moe_layers
    assert all(1.0 <= float(v) <= 16.0 for k, v in moe.items() if k.endswith("load_max_over_mean"))
    assert float(moe["moe/dropped_fraction"]) == 0.0  # dropless by default
    assert float(moe["moe/moe_blocks/aux_loss"]) > 0
    bias = np.asarray(params["stacks"]["moe_blocks"]["layers"]["moe"]["router"]["correction_bias"])
    rate = TINY_DEEPSEEK.router.bias_update_rate
    # Three sign updates of size `rate`: every entry is an odd multiple of rate up to 3 (or 1) x rate.
    assert np.all(np.isclose(np.abs(bias) / rate, np.round(np.abs(bias) / rate))) and np.abs(bias).max() > 0
