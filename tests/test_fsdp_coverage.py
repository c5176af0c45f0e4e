"""FSDP leaves nothing big whole: under `fsdp` on 16 devices every weight matrix of every family
is split (only norm scales stay replicated), checked with the sharding audit; MLA's up-projections
(no embed dimension) are split along their latent rank."""
import dataclasses

import numpy as np
import pytest

from helpers import TINY_LLAMA
from jaxtrain.training.state import abstract_model, param_shardings
from jaxtrain.meshes.mesh import MeshConfig, build_mesh
from jaxtrain.meshes.rules import get_rule_set
from jaxtrain.meshes.sharding_audit import audit_sharding, check_sufficiently_sharded
from jaxtrain.models.deepseek import DeepSeekConfig
from jaxtrain.models.layers.router import RouterConfig
from jaxtrain.models.nemotron_h import NemotronHConfig

pytestmark = [pytest.mark.fast]

DEEPSEEK = DeepSeekConfig(vocab_size=96, embed=32, layers=3, first_k_dense=1, heads=4, q_lora_rank=16,
                          kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, mlp=64,
                          expert_mlp=16, shared_experts=1, router=RouterConfig(num_experts=16, top_k=2))
MODELS = {"llama": dataclasses.replace(TINY_LLAMA, embed=64, mlp=128), "deepseek": DEEPSEEK,
          "nemotron_h": NemotronHConfig(embed=64)}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fsdp_splits_every_weight_matrix(name):
    _, abstract = abstract_model(MODELS[name])
    from flax import nnx
    params = nnx.to_pure_dict(abstract)
    shardings = param_shardings(abstract, build_mesh(MeshConfig(data=16)), get_rule_set("fsdp").params)
    report = audit_sharding(params, shardings, name=name)
    whole = [leaf.path for leaf in report.leaves if leaf.copies == 16 and not leaf.path.endswith(("scale", "bias"))
             and np.prod(leaf.shape) > 1024]
    assert not whole, whole
    # What stays whole is per-channel vectors (norm scales, biases, Mamba's 4-tap conv filters):
    # a few KiB, which is 11% of these tiny models and well under 1% at full size.
    check_sufficiently_sharded(report, tolerance=0.15)


def test_mla_up_projections_split_along_the_latent_rank():
    _, abstract = abstract_model(DEEPSEEK)
    from flax import nnx
    params = nnx.to_pure_dict(abstract)
    shardings = param_shardings(abstract, build_mesh(MeshConfig(data=16)), get_rule_set("fsdp").params)
    for proj in ("q_up", "kv_up"):
        spec = shardings["stacks"]["moe_blocks"]["layers"]["attn"][proj]["kernel"].spec
        assert spec[1] == ("data",) or spec[1] == "data", (proj, spec)  # [layers, rank, heads, head_dim]
