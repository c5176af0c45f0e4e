"""A decoder-only language model: embed -> layer stacks -> final norm -> LM head.

Families differ only in the layer stacks they build (one homogeneous stack for Llama; a
dense prefix plus an MoE stack for DeepSeek; ...), so this module stays family-agnostic.
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from meshes.rules import constrain
from models.layers.embed import Embed, LMHead
from models.layers.norm import RMSNorm
from models.layers.stack import LayerStack

RESIDUAL = ("batch", "residual_length", "embed")


class CausalLM(nnx.Module):
    def __init__(self, *, vocab: int, embed: int, stacks: dict[str, LayerStack], norm_eps: float,
                 tie_embeddings: bool, rngs: nnx.Rngs, init_std: float, dtype):
        self.embed = Embed(vocab, embed, rngs=rngs, init_std=init_std, dtype=dtype)
        self.stacks = nnx.Dict(stacks)
        self.stack_order = tuple(stacks)
        self.final_norm = RMSNorm(embed, rngs=rngs, eps=norm_eps)
        self.head = None if tie_embeddings else LMHead(embed, vocab, rngs=rngs, init_std=init_std, dtype=dtype)

    def hidden(self, tokens, positions=None, segment_ids=None):
        """Final normalized hidden states [b, l, embed] and per-stack auxiliary outputs."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        if segment_ids is None:
            segment_ids = jnp.ones(tokens.shape, jnp.int32)
        x = constrain(self.embed(tokens), RESIDUAL)
        aux = {}
        for name in self.stack_order:
            x, aux[name] = self.stacks[name](x, positions, segment_ids)
        return self.final_norm(x), aux

    def update_router_biases(self, aux) -> None:
        """Applies each MoE block's post-step bias update from its routing statistics."""
        for name in self.stack_order:
            self.stacks[name].update_router_biases(aux.get(name, {}))

    def logits(self, hidden):
        out = self.embed.attend(hidden) if self.head is None else self.head(hidden)
        return constrain(out, ("batch", "length", "vocab"))

    def __call__(self, tokens, positions=None, segment_ids=None):
        return self.logits(self.hidden(tokens, positions, segment_ids)[0])


def add_residual(x, update):
    """x + update, kept in the residual dtype and re-constrained to the residual layout."""
    return constrain(x + update.astype(x.dtype), RESIDUAL)
