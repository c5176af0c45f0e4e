"""Tiny transformers Llama checkpoints with random weights, saved locally (never the hub)."""
from __future__ import annotations

import numpy as np


def save_tiny_llama(directory, *, seed: int = 0, max_shard_size=None, **config) -> str:
    """A LlamaForCausalLM from `config` (transformers names) with every weight random, norms
    and biases included (HF initializes those to ones / zeros, which would hide mistakes)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=4)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**base, **config}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
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
