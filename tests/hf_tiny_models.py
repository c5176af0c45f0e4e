"""Tiny transformers checkpoints with random weights, saved locally (never the hub)."""
from __future__ import annotations

import sys

import numpy as np
import pytest


def _torch():
    """torch for the transformers references. The CPU build the test extra pins exists for Python
    3.11 alone: there a missing torch is an error; the Python 3.12 lane runs without it and skips."""
    if sys.version_info < (3, 12):
        import torch
        return torch
    return pytest.importorskip("torch", reason="the transformers references need torch (not installed)")


def save_tiny_llama(directory, *, seed: int = 0, max_shard_size=None, **config) -> str:
    """A LlamaForCausalLM from `config` (transformers names) with every weight random, norms
    and biases included (HF initializes those to ones / zeros, which would hide mistakes)."""
    torch = _torch()
    import transformers

    torch.manual_seed(seed)
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=4)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**base, **config}))
    return save_randomized(model, directory, max_shard_size=max_shard_size)


def save_randomized(model, directory, *, max_shard_size=None) -> str:
    """Every parameter and saved float buffer of a transformers model random (norm scales near one),
    then saved with save_pretrained; seed torch before building the model."""
    torch = _torch()

    saved = set(model.state_dict())  # persistent buffers only (not e.g. rotary caches)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name not in saved or not p.dtype.is_floating_point:
                continue
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(directory), **kwargs)
    return str(directory)


def random_tokens(vocab: int, batch: int = 4, length: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (batch, length)).astype(np.int32)


def relative_error(ours, theirs) -> float:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def save_tiny_nemotron_h(directory, *, seed: int = 0, **config) -> str:
    """A NemotronHForCausalLM with all four block kinds, 2 B/C groups and a chunk (6) that does not
    divide the test sequences; `config` overrides (transformers names)."""
    torch = _torch()
    import transformers

    torch.manual_seed(seed)
    base = dict(vocab_size=96, hidden_size=32, layers_block_type=["linear_attention", "moe", "full_attention",
                                                                  "mlp", "linear_attention", "moe"],
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=8, n_groups=2, chunk_size=6,
                n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                moe_shared_expert_intermediate_size=24)
    model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**{**base, **config}))
    return save_randomized(model, directory)


def save_tiny_mamba2(directory, *, seed: int = 0, **config) -> str:
    torch = _torch()
    import transformers

    torch.manual_seed(seed)
    base = dict(vocab_size=96, hidden_size=32, num_heads=8, head_dim=8, expand=2, state_size=8, n_groups=2,
                num_hidden_layers=2, chunk_size=6)
    model = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(**{**base, **config}))
    return save_randomized(model, directory)


def forward(model, tokens, mesh=None):
    """Our logits for `tokens`, jitted, under the `dp` rule table when a mesh is given."""
    import jax
    from flax import nnx

    from jaxtrain.meshes.rules import get_rule_set, use_rules

    graphdef, state = nnx.split(model)
    run = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    if mesh is None:
        return np.asarray(run(state, tokens))
    with use_rules(mesh, get_rule_set("dp")):
        return np.asarray(run(state, tokens))


def save_tiny_deepseek_v2(directory, *, seed: int = 0, **config) -> str:
    """A DeepseekV2ForCausalLM (MLA, one dense layer then DeepSeekMoE) with every weight random."""
    torch = _torch()
    import transformers

    torch.manual_seed(seed)
    base = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3, first_k_dense_replace=1,
                num_attention_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                v_head_dim=8, moe_intermediate_size=12, n_routed_experts=8, num_experts_per_tok=2,
                n_shared_experts=1, max_position_embeddings=128)
    model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**{**base, **config}))
    return save_randomized(model, directory)
