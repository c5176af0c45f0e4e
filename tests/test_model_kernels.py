"""Models give the same logits and gradients with the Pallas kernels (interpreted on CPU) as
with the XLA references."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import random_packed_batch
from models.deepseek import DeepSeekConfig
from models.layers.mamba2 import SSMConfig
from models.layers.router import RouterConfig
from models.nemotron_h import NemotronHConfig

TINY = DeepSeekConfig(vocab_size=64, embed=32, layers=2, first_k_dense=1, heads=2, kv_lora_rank=16,
                      qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, mlp=64, expert_mlp=16,
                      router=RouterConfig(num_experts=8, top_k=2, n_group=2, topk_group=1, aux_loss_weight=0.01))


TINY_HYBRID = NemotronHConfig(vocab_size=64, embed=32, pattern=("mamba", "moe", "attention", "mamba"), heads=2,
                              kv_heads=1, head_dim=16, mlp=64, expert_mlp=16, shared_expert_mlp=32, moe_latent=16,
                              ssm=SSMConfig(heads=4, head_dim=8, state=16, groups=2, chunk_size=16))


def _aux_loss(aux):
    return sum(leaf.sum() for path, leaf in jax.tree_util.tree_leaves_with_path(aux)
               if getattr(path[-1], "key", None) == "aux_loss")


def logits_and_grads(cfg, batch):
    model = cfg.build(nnx.Rngs(params=jax.random.key(0)))
    graphdef, params = nnx.split(model)

    def loss(params):
        m = nnx.merge(graphdef, params)
        hidden, aux = m.hidden(batch["inputs"], batch["positions"], batch["segment_ids"])
        logits = m.logits(hidden)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None], -1).mean()
        return nll + _aux_loss(aux), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return logits, grads


@pytest.mark.parametrize("cfg", [TINY, TINY_HYBRID], ids=["deepseek", "nemotron_h"])
def test_pallas_kernels_match_xla(cfg):
    """DeepSeek: routing + grouped matmul; Nemotron-H: also the SSD scan and causal conv (a
    packed batch with segment resets, length 24 not a multiple of the chunk)."""
    batch = {k: jnp.asarray(v) for k, v in random_packed_batch(0, 2, 24, cfg.vocab_size).items()}
    ref_logits, ref_grads = logits_and_grads(cfg, batch)
    logits, grads = logits_and_grads(dataclasses.replace(cfg, kernels="pallas"), batch)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), rtol=1e-4, atol=1e-5)
    for (path, g), ref in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(ref), rtol=1e-3, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))


def test_pallas_kernels_under_a_mesh_match_xla():
    """Under a mesh the kernels run per shard (meshes/per_shard.py, the MoE's shard_map): three
    training steps on data=8 x tensor=2 give the same losses and parameters either way."""
    from helpers import assert_trees_close, train_losses, with_train
    from meshes.mesh import MeshConfig

    train = with_train(global_batch=8, seq_len=24)
    ref_losses, ref_params = train_losses(MeshConfig(data=8, tensor=2), model=TINY_HYBRID, train=train)
    losses, params = train_losses(MeshConfig(data=8, tensor=2), model=dataclasses.replace(TINY_HYBRID, kernels="pallas"),
                                  train=train)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(params, ref_params, rtol=1e-4, atol=1e-4)
