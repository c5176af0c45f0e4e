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

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.meshes.rules import constrain
from jaxtrain.meshes.context_attention import gather_sequence
from jaxtrain.meshes.context_layout import active_context_parallel, context_size
from jaxtrain.meshes.weight_gather import cast_for_use
from jaxtrain.models.layers.attention_impl import AutoAttention
from jaxtrain.models.layers.decode_attention import decode_block, latent_decode
from jaxtrain.models.layers.decode_cache import LayerCache
from jaxtrain.models.layers.dense import Dense
from jaxtrain.models.layers.norm import RMSNorm
from jaxtrain.models.layers.params import logical_axes
from jaxtrain.models.layers.rope import YarnScaling, apply_rope_interleaved

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
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, qk_rope_head_dim  # the cache's widths, static
        self.inv_freq = tuple(float(f) for f in inv_freq)  # static: part of the graph, not state
        self.softmax_scale, self.rope_attention_factor = float(softmax_scale), float(rope_attention_factor)
        self.attention = attention  # static: an implementation strategy (models/layers/attention_impl.py)

    def _rope(self, x, positions):
        return apply_rope_interleaved(x, positions, self.inv_freq, self.rope_attention_factor)

    def _queries(self, x, positions):
        """[b, l, h, nope + rope], the rotary part rotated."""
        q = self.q(x) if self.q_lora_rank is None else self.q_up(self.q_norm(self.q_down(x)))
        q = constrain(q, PER_HEAD)
        return jnp.concatenate([q[..., :self.nope], self._rope(q[..., self.nope:], positions)], axis=-1)

    def _latent_and_rope_key(self, x, positions):
        """What the cache keeps per token: the normalized latent [b, l, kv_lora] and the rotated
        key part shared by all heads [b, l, rope]."""
        latent = constrain(self.kv_norm(self.kv_down(x)), ("batch", "length", "kv_lora"))
        k_rope = self._rope(self.k_rope(x)[:, :, None, :], positions)[:, :, 0, :]
        return latent, constrain(k_rope, ("batch", "length", None))

    def __call__(self, x, positions, segment_ids):
        return self._forward(x, positions, segment_ids)[0]

    def _forward(self, x, positions, segment_ids):
        """The training forward; also returns the latent and rotary key it computed (prefill caches them)."""
        q = self._queries(x, positions)
        local_latent, local_k_rope = self._latent_and_rope_key(x, positions)
        up = self.kv_up
        if self.attention.takes_latent and (context_size() == 1 or active_context_parallel().kv_exchange.moves_latent):
            # Per-device strategies up-project the latent a chunk at a time inside the attention,
            # so the sequence's per-head keys never exist at once. Under context parallelism with
            # LatentKV the latent and rotary key cross `context` (kv_lora + rope values a token)
            # and every rank up-projects the whole sequence (no-op gathers with one rank).
            latent = gather_sequence(local_latent.astype(up.dtype), ("batch", "length", "kv_lora"))
            k_rope = gather_sequence(local_k_rope, ("batch", "length", None))
            w_up = cast_for_use(up.weight(), logical_axes(up.kernel)[-3:], up.dtype)  # bf16 before any gather
            out = self.attention.latent(q, latent, k_rope, w_up,
                                        segment_ids, nope=self.nope, scale=self.softmax_scale)
            return self.o(out), local_latent, local_k_rope
        if self.attention.takes_latent:
            # Under context parallelism each rank up-projects its own tokens only and the context
            # exchange (RingKV by default, or AllGatherKV) moves per-head keys/values. Gathering
            # the latent instead makes every rank up-project the whole sequence: (C - 1) / C of
            # the up-projection's work replicated, which would be the largest cost of a
            # context-parallel step.
            k, v = self._keys_values(up(local_latent), local_k_rope)
            out = self.attention(q, k, v, segment_ids, scale=self.softmax_scale, kv_head_name="heads")
            return self.o(out), local_latent, local_k_rope
        # The materialized reference: the whole sequence's keys for every query of this rank.
        latent = gather_sequence(local_latent, ("batch", "length", "kv_lora"))
        k_rope = gather_sequence(local_k_rope, ("batch", "length", None))
        k, v = self._keys_values(up(latent), k_rope, ("batch", None, "heads", None))
        out = self.attention(q, k, v, segment_ids, scale=self.softmax_scale, kv_whole=True, kv_head_name="heads")
        return self.o(out), local_latent, local_k_rope

    def _keys_values(self, kv, k_rope, names=PER_HEAD):
        """Per-head keys [.., nope | rope] and values from the up-projected latent kv [b, l, h,
        nope + v] and the rotary key [b, l, rope] every head shares."""
        kv = constrain(kv, names)
        k_nope, v = kv[..., :self.nope], kv[..., self.nope:]
        k_rope = jnp.broadcast_to(k_rope[:, :, None, :], k_nope.shape[:-1] + k_rope.shape[-1:])
        return constrain(jnp.concatenate([k_nope, k_rope.astype(k_nope.dtype)], axis=-1), names), v

    # -- generation (models/layers/decode_cache.py) ---------------------------------------------
    def init_cache(self, batch: int, max_len: int, dtype) -> dict:
        """Per token only the latent and the rotary key: kv_lora + rope values, whatever the heads."""
        return {"latent": constrain(jnp.zeros((batch, max_len, self.kv_lora_rank), dtype), CACHE_LATENT),
                "k_rope": constrain(jnp.zeros((batch, max_len, self.rope_dim), dtype), CACHE_ROPE_KEY)}

    def prefill(self, x, positions, segment_ids, cache):
        """The training forward over the prompt x [b, P, embed], writing cache entries [0, P)."""
        out, latent, k_rope = self._forward(x, positions, segment_ids)
        return out, _write_cache(cache, latent, k_rope, 0)

    def decode(self, x, positions, cache, index, valid_from):
        """One token x [b, 1, embed] at cache entry `index`, attending to entries [valid_from[b], index].

        The key/value up-projection is absorbed (DeepSeek-V2): the query's position-free part is
        taken into latent space (q_nope . W_uk), scored against the cached latents directly, and
        the softmax-weighted latent is expanded by W_uv once per query. Per-head keys and values
        of the context are never formed: the work per cached token is kv_lora + rope per head.
        """
        q = self._queries(x, positions)
        latent, k_rope = self._latent_and_rope_key(x, positions)
        view = LayerCache.of(cache).write("latent", latent, index, CACHE_LATENT).write("k_rope", k_rope, index,
                                                                                        CACHE_ROPE_KEY)
        dtype = self.kv_up.dtype
        w_up = self.kv_up.weight().astype(dtype)  # [kv_lora, h, nope + v]
        w_uk, w_uv = w_up[..., :self.nope], w_up[..., self.nope:]
        q_latent = jnp.einsum("bhn,chn->bhc", q[:, 0, :, :self.nope].astype(dtype), w_uk)
        q_rope = q[:, 0, :, self.nope:].astype(dtype)
        out_latent, _ = latent_decode(q_latent, q_rope, view, index=index, valid_from=valid_from,
                                      scale=self.softmax_scale, block=decode_block(self.attention))
        out = constrain(jnp.einsum("bhc,chv->bhv", out_latent.astype(dtype), w_uv)[:, None], PER_HEAD)
        return self.o(out), view.like(cache)


CACHE_LATENT = ("batch", None, "kv_lora")  # the cache's length stays whole: decode writes one entry anywhere
CACHE_ROPE_KEY = ("batch", None, None)


def _write_cache(cache: dict, latent, k_rope, index) -> dict:
    """Entries [index, index + l) of both caches, in the cache's dtype."""
    def write(entries, new, names):
        return constrain(jax.lax.dynamic_update_slice(entries, new.astype(entries.dtype), (0, index, 0)), names)
    return {"latent": write(cache["latent"], latent, CACHE_LATENT),
            "k_rope": write(cache["k_rope"], k_rope, CACHE_ROPE_KEY)}
