"""A decoder-only language model: embed -> layer stacks -> final norm -> LM head.

Families differ only in the layer stacks they build (one homogeneous stack for Llama; a
dense prefix plus an MoE stack for DeepSeek; ...), so this module stays family-agnostic.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.meshes.rules import active_rules, constrain
from jaxtrain.models.layers.embed import Embed, LMHead
from jaxtrain.models.loss import chunked_cross_entropy
from jaxtrain.models.layers.norm import RMSNorm
from jaxtrain.models.layers.stack import LayerStack

RESIDUAL = ("batch", "residual_length", "embed")


class CausalLM(nnx.Module):
    def __init__(self, *, vocab: int, embed: int, stacks: dict[str, LayerStack], norm_eps: float,
                 tie_embeddings: bool, rngs: nnx.Rngs, init_std: float, dtype):
        self.embed = Embed(vocab, embed, rngs=rngs, init_std=init_std, dtype=dtype)
        self.stacks = nnx.Dict(stacks)
        self.stack_order = tuple(stacks)
        self.final_norm = RMSNorm(embed, rngs=rngs, eps=norm_eps)
        self.head = None if tie_embeddings else LMHead(embed, vocab, rngs=rngs, init_std=init_std, dtype=dtype)

    # The forward pass in pieces, so that the unpipelined step and the pipeline (which runs the
    # stacks in stages between the first and the last piece) compute the same function.
    def embed_inputs(self, tokens):
        """Token ids [b, l] -> the residual stream [b, l, embed] the stacks start from."""
        return constrain(self.embed(tokens), RESIDUAL)

    def run_stacks(self, x, positions, segment_ids):
        """The layer stacks in order: (residual stream, {stack name: its typed aux outputs})."""
        aux = {}
        for name in self.stack_order:
            x, aux[name] = self.stacks[name](x, positions, segment_ids)
        return x, aux

    def head_sums(self, x, targets, loss_mask, *, chunk: int, z_loss: float = 0.0):
        """Final norm, LM head and cross-entropy of the residual stream: token sums (nll, z-loss
        term, correct top-1) over the tokens where loss_mask is set."""
        hidden = layer_input(self.final_norm(x))  # the head weight gradient reads it (see LAYER)
        return chunked_cross_entropy(self.logits, hidden, targets, loss_mask, chunk=chunk, z_loss=z_loss)

    def hidden(self, tokens, positions=None, segment_ids=None):
        """Final normalized hidden states [b, l, embed] and per-stack auxiliary outputs."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        if segment_ids is None:
            segment_ids = jnp.ones(tokens.shape, jnp.int32)
        x, aux = self.run_stacks(self.embed_inputs(tokens), positions, segment_ids)
        return self.final_norm(x), aux

    def after_update(self, aux) -> None:
        """After an optimizer step: each stack's post-step updates from its typed outputs (the
        MoE routers' correction biases; models/layers/aux_outputs.py)."""
        for name in self.stack_order:
            self.stacks[name].after_update(aux.get(name, {}))

    def logits(self, hidden):
        out = self.embed.attend(hidden) if self.head is None else self.head(hidden)
        return constrain(out, ("batch", "length", "vocab"))

    def __call__(self, tokens, positions=None, segment_ids=None):
        return self.logits(self.hidden(tokens, positions, segment_ids)[0])

    # Generation (models/layers/decode_cache.py): the same pieces, each stack threading its cache.
    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
        """{stack name: that stack's cache}, zeros for `batch` rows of up to `max_len` tokens."""
        return {name: self.stacks[name].init_cache(batch, max_len, dtype) for name in self.stack_order}

    def prefill(self, tokens, positions, segment_ids, cache):
        """Left-padded prompts tokens [b, P] (pads: segment id 0) -> (logits of each row's last
        position [b, vocab], the cache with entries [0, P) written)."""
        x = self.embed_inputs(tokens)
        cache = dict(cache)
        for name in self.stack_order:
            x, cache[name] = self.stacks[name].prefill(x, positions, segment_ids, cache[name])
        return self._last_logits(x), cache

    def decode(self, tokens, positions, cache, index, valid_from):
        """One token per row, tokens/positions [b, 1], written at cache entry `index` (the same for
        every row); a row attends to its entries [valid_from, index] -> (logits [b, vocab], cache)."""
        x = self.embed_inputs(tokens)
        cache = dict(cache)
        for name in self.stack_order:
            x, cache[name] = self.stacks[name].decode(x, positions, cache[name], index, valid_from)
        return self._last_logits(x), cache

    def _last_logits(self, x):
        return self.logits(self.final_norm(x[:, -1:]))[:, 0]


# Inside a layer the sequence is split over `length` only: under sequence parallelism (`fsdp_sp`,
# `dp_sp`) the residual's extra `tensor` split is gathered on the way in and scattered on the way
# out. Both crossings are pinned, forward and backward: left to XLA, the weight gradients of the
# layer's first and last matmuls (and of the LM head) ask for the saved input and the incoming
# gradient split over `embed` like their FSDP weight, a layout XLA's partitioner cannot reach from
# the residual's batch/length split without replicating the whole tensor first ("involuntary full
# rematerialization": a whole copy of the residual, and the collectives that build it, per layer).
LAYER = ("batch", "length", "embed")


def layer_input(x):
    """The residual stream (normalized) as a layer's matmuls read it: whole over `tensor`, pinned
    only where FSDP splits the weights' `embed`. Without FSDP, XLA keeps the sequence-parallel
    input split for the backward and gathers it again there (Megatron's way) by itself; pinned,
    the backward would keep it gathered, a larger temp under remat none."""
    rules = active_rules()
    return constrain(x, LAYER) if rules is not None and rules.params.get("embed") else x


@jax.custom_vjp
def _gradient_in_layer_layout(update):
    return update


def _identity_fwd(update):
    return update, None


def _layer_layout_bwd(_, g):
    return (constrain(g, LAYER),)


_gradient_in_layer_layout.defvjp(_identity_fwd, _layer_layout_bwd)


def add_residual(x, update):
    """x + update, kept in the residual dtype and re-constrained to the residual layout; the
    gradient reaching the layer's last matmul is in the layer's layout (LAYER above)."""
    return constrain(x + _gradient_in_layer_layout(update).astype(x.dtype), RESIDUAL)
