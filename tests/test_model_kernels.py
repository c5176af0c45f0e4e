"""Models give the same logits and gradients with the Pallas kernels (interpreted on CPU) as
with the XLA references, and kernels="pallas" really runs the kernels (their pallas_calls are in
the traced step, forward and backward) while kernels="xla" runs none: otherwise a dispatch that
ignored the setting would compare XLA with XLA and pass."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import assert_finite, random_packed_batch
from kernel_checks import pallas_kernel_names
from jaxtrain.models.deepseek import DeepSeekConfig
from jaxtrain.models.layers.aux_outputs import aux_outputs
from jaxtrain.models.layers.mamba2 import SSMConfig
from jaxtrain.models.layers.router import RouterConfig
from jaxtrain.models.nemotron_h import NemotronHConfig

pytestmark = [pytest.mark.slow]

TINY = DeepSeekConfig(vocab_size=64, embed=32, layers=2, first_k_dense=1, heads=2, kv_lora_rank=16,
                      qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, mlp=64, expert_mlp=16,
                      router=RouterConfig(num_experts=8, top_k=2, n_group=2, topk_group=1, aux_loss_weight=0.01))


TINY_HYBRID = NemotronHConfig(vocab_size=64, embed=32, pattern=("mamba", "moe", "attention", "mamba"), heads=2,
                              kv_heads=1, head_dim=16, mlp=64, expert_mlp=16, shared_expert_mlp=32, moe_latent=16,
                              ssm=SSMConfig(heads=4, head_dim=8, state=16, groups=2, chunk_size=16))


def _aux_loss(aux):
    return sum(out.aux_loss.sum() for out in aux_outputs(aux))


# The pallas_calls each model's kernels="pallas" step must contain (forward and backward).
MOE_KERNELS = {"moe_route", "moe_dispatch", "grouped_matmul", "grouped_matmul_t", "grouped_matmul_tgmm"}
SSM_KERNELS = {"ssd_chunk_state", "ssd_state_pass", "ssd_chunk_out", "ssd_chunk_state_bwd", "ssd_state_pass_bwd",
               "ssd_chunk_bwd", "causal_conv1d", "causal_conv1d_bwd"}
EXPECTED_KERNELS = {"DeepSeekConfig": MOE_KERNELS, "NemotronHConfig": MOE_KERNELS | SSM_KERNELS}


def assert_kernels_ran(cfg, jaxpr):
    """The Pallas kernels of `cfg` are in `jaxpr` if it asks for them, and none if it does not."""
    ran = pallas_kernel_names(jaxpr)
    if cfg.kernels == "pallas":
        missing = EXPECTED_KERNELS[type(cfg).__name__] - ran
        assert not missing, f"kernels='pallas' but no pallas_call for {sorted(missing)} (found {sorted(ran)})"
    else:
        assert not ran, f"kernels={cfg.kernels!r} but the step runs Pallas kernels {sorted(ran)}"


def logits_and_grads(cfg, batch):
    """Logits and parameter gradients of one forward/backward, and the jaxpr it ran."""
    model = cfg.build(nnx.Rngs(params=jax.random.key(0)))
    graphdef, params = nnx.split(model)

    def loss(params):
        m = nnx.merge(graphdef, params)
        hidden, aux = m.hidden(batch["inputs"], batch["positions"], batch["segment_ids"])
        logits = m.logits(hidden)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None], -1).mean()
        return nll + _aux_loss(aux), logits

    fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (_, logits), grads = fn(params)
    return logits, grads, fn.trace(params).jaxpr


# the hybrid runs in `make test-extended` (the suite's budget; its scan and conv kernels have their
# own tests, tests/test_kernels_ssd_scan.py and the GPU check)
@pytest.mark.parametrize("cfg", [TINY, pytest.param(TINY_HYBRID, marks=pytest.mark.extended)],
                         ids=["deepseek", "nemotron_h"])
def test_pallas_kernels_match_xla(cfg):
    """DeepSeek: routing + grouped matmul; Nemotron-H: also the SSD scan and causal conv (a
    packed batch with segment resets, length 24 not a multiple of the chunk)."""
    batch = {k: jnp.asarray(v) for k, v in random_packed_batch(0, 2, 24, cfg.vocab_size).items()}
    ref_logits, ref_grads, ref_jaxpr = logits_and_grads(cfg, batch)
    pallas_cfg = dataclasses.replace(cfg, kernels="pallas")
    logits, grads, jaxpr = logits_and_grads(pallas_cfg, batch)
    assert_kernels_ran(cfg, ref_jaxpr)
    assert_kernels_ran(pallas_cfg, jaxpr)
    assert_finite([logits, ref_logits], "logits")
    assert_finite([grads, ref_grads], "grads")
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), rtol=1e-4, atol=1e-5)
    for (path, g), ref in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(ref), rtol=1e-3, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.extended  # ~50 s: `make test-extended`; the one-device kernel comparisons above stay in the suite
def test_pallas_kernels_under_a_mesh_match_xla():
    """Under a mesh the kernels run per shard (meshes/per_shard.py, the MoE's shard_map): three
    training steps on data=8 x tensor=2 give the same losses and parameters either way."""
    from helpers import assert_trees_close, train_losses, with_train
    from jaxtrain.meshes.mesh import MeshConfig

    train = with_train(global_batch=8, seq_len=24)
    pallas_cfg = dataclasses.replace(TINY_HYBRID, kernels="pallas")
    ref_jaxpr, jaxpr = [], []
    ref_losses, ref_params = train_losses(MeshConfig(data=8, tensor=2), model=TINY_HYBRID, train=train,
                                          jaxprs=ref_jaxpr)
    losses, params = train_losses(MeshConfig(data=8, tensor=2), model=pallas_cfg, train=train, jaxprs=jaxpr)
    assert_kernels_ran(TINY_HYBRID, ref_jaxpr[0])
    assert_kernels_ran(pallas_cfg, jaxpr[0])
    assert_finite([losses, ref_losses], "losses")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(params, ref_params, rtol=1e-4, atol=1e-4)
