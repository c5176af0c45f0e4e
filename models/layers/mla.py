"""Multi-head latent attention (DeepSeek-V2): every head's key and value come from one small
per-token latent, so the part of attention that grows with context is the latent, not the heads.

Keys/values: a down-projection compresses the input to a `kv_lora_rank` latent (RMS-normalized),
and an up-projection expands it to each head's position-free key part (`qk_nope_head_dim`) and
value (`v_head_dim`). Position enters through a separate rotary key part (`qk_rope_head_dim`)
projected from the input and shared by all heads. Queries come from the input directly or
through their own compressed latent (`q_lora_rank`). A head's query and key are [nope | rope].
"""
from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from meshes.rules import constrain
from meshes.context_attention import gather_sequence
from models.layers.attention_impl import AutoAttention
from models.layers.dense import Dense
from models.layers.norm import RMSNorm
from models.layers.rope import YarnScaling, apply_rope_interleaved

PER_HEAD = ("batch", "length", "heads", None)


def mla_softmax_scale(qk_head_dim: int, rope_scaling) -> float:
    """1/sqrt(qk_head_dim), times YaRN's all-dimension temperature correction when the rotary
    scaling is YaRN (the nope dims see no cos/sin, so the correction goes on the softmax)."""
    factor = rope_scaling.softmax_scale_factor() if isinstance(rope_scaling, YarnScaling) else 1.0
    return factor / math.sqrt(qk_head_dim)


class MultiHeadLatentAttention(nnx.Module):
    """(x[b, l, embed], positions[b, l], segment_ids[b, l]) -> [b, l, embed].

    `inv_freq` has qk_rope_head_dim // 2 entries; `rope_attention_factor` multiplies cos/sin
    (YaRN's attention factor, see rope.rope_attention_factor). `norm_eps` is the latents' RMSNorm
    epsilon. `use_bias` puts biases on the projections that read the input or write the output
    (HF `attention_bias`); the up-projections never have one.
    """

    def __init__(self, embed: int, heads: int, *, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, inv_freq,
                 softmax_scale: float, rope_attention_factor: float = 1.0, norm_eps: float = 1e-6,
                 rngs: nnx.Rngs, use_bias: bool = False, init_std: float = 0.02, dtype=None,
                 attention=AutoAttention()):
        if qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={qk_rope_head_dim} must be even (rotary dims come in pairs)")
        if len(inv_freq) != qk_rope_head_dim // 2:
            raise ValueError(f"{len(inv_freq)} inverse frequencies for qk_rope_head_dim={qk_rope_head_dim}")
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        kw = dict(rngs=rngs, init_std=init_std, dtype=dtype)
        per_head = dict(out_axes=("heads", "head_dim"), **kw)
        if q_lora_rank is None:
            self.q = Dense((embed,), (heads, qk_head_dim), in_axes=("embed",), **per_head)
        else:
            self.q_down = Dense((embed,), (q_lora_rank,), in_axes=("embed",), out_axes=("q_lora",),
                                use_bias=use_bias, **kw)
            self.q_norm = RMSNorm(q_lora_rank, rngs=rngs, eps=norm_eps, axis_name="q_lora")
            self.q_up = Dense((q_lora_rank,), (heads, qk_head_dim), in_axes=("q_lora",), **per_head)
        # HF fuses kv_down and k_rope into one projection (kv_a_proj_with_mqa); two keep the
        # latent's dimension a clean `kv_lora` axis that a rule table can shard.
        self.kv_down = Dense((embed,), (kv_lora_rank,), in_axes=("embed",), out_axes=("kv_lora",),
                             use_bias=use_bias, **kw)
        self.k_rope = Dense((embed,), (qk_rope_head_dim,), in_axes=("embed",), out_axes=("head_dim",),
                            use_bias=use_bias, **kw)
        self.kv_norm = RMSNorm(kv_lora_rank, rngs=rngs, eps=norm_eps, axis_name="kv_lora")
        self.kv_up = Dense((kv_lora_rank,), (heads, qk_nope_head_dim + v_head_dim), in_axes=("kv_lora",), **per_head)
        self.o = Dense((heads, v_head_dim), (embed,), in_axes=("heads", "head_dim"), out_axes=("embed",),
                       use_bias=use_bias, **kw)
        self.q_lora_rank, self.nope = q_lora_rank, qk_nope_head_dim
        self.inv_freq = tuple(float(f) for f in inv_freq)  # static: part of the graph, not state
        self.softmax_scale, self.rope_attention_factor = float(softmax_scale), float(rope_attention_factor)
        self.attention = attention  # static: an implementation strategy (models/layers/attention_impl.py)

    def _rope(self, x, positions):
        return apply_rope_interleaved(x, positions, self.inv_freq, self.rope_attention_factor)

    def __call__(self, x, positions, segment_ids):
        q = self.q(x) if self.q_lora_rank is None else self.q_up(self.q_norm(self.q_down(x)))
        q = constrain(q, PER_HEAD)
        q = jnp.concatenate([q[..., :self.nope], self._rope(q[..., self.nope:], positions)], axis=-1)

        # Under context parallelism only the compressed latent and the shared rotary key cross
        # the network (kv_lora + rope values per token); every rank up-projects the whole
        # sequence's keys and values locally instead of receiving per-head ones. Per-device
        # strategies do it a chunk of keys at a time inside the attention, so the whole
        # sequence's per-head keys never exist; the materialized reference up-projects here.
        latent = constrain(self.kv_norm(self.kv_down(x)), ("batch", "length", "kv_lora"))
        latent = gather_sequence(latent, ("batch", "length", "kv_lora"))
        k_rope = self._rope(self.k_rope(x)[:, :, None, :], positions)  # one rotary key for all heads
        k_rope = gather_sequence(constrain(k_rope, ("batch", "length", None, None)), ("batch", "length", None, None))
        up = self.kv_up
        if self.attention.takes_latent:  # up-projected a chunk at a time inside the attention
            out = self.attention.latent(q, latent.astype(up.dtype), k_rope[:, :, 0, :], up.kernel[...].astype(up.dtype),
                                        segment_ids, nope=self.nope, scale=self.softmax_scale)
            return self.o(out)
        whole = ("batch", None, "heads", None)  # the sequence whole: keys for every query of this rank
        kv = constrain(up(latent), whole)
        k_nope, v = kv[..., :self.nope], kv[..., self.nope:]
        k_rope = jnp.broadcast_to(k_rope, k_nope.shape[:-1] + k_rope.shape[-1:])
        k = constrain(jnp.concatenate([k_nope, k_rope.astype(k_nope.dtype)], axis=-1), whole)
        return self.o(self.attention(q, k, v, segment_ids, scale=self.softmax_scale, kv_whole=True,
                                     kv_head_name="heads"))
