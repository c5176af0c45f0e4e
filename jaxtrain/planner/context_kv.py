"""What attention moves over `context` and what it keeps for it, per layer kind, read off the
layer's parameters (planner/state_bytes.py leaves) and the plan's K/V exchange strategy
(meshes/context_settings.py: RingKV | AllGatherKV | LatentKV, each saying its own width).

    GQA   keys and values of the kv heads a device holds (embed -> kv_heads x head_dim weights)
    MLA   what the exchange says: per-head keys [nope | rope] and values of the device's heads
          (RingKV, AllGatherKV: each rank up-projects its own tokens, models/layers/mla.py), or
          the latent and rotary key, kv_lora + rope, which every rank up-projects (LatentKV)

Under a per-head exchange MLA's layer also keeps its tokens' per-head keys and values for the
backward (the ring attention's residuals) where the single-device layer the profile traces
(layer_profile.py) keeps the latent: per_head_kv_values.
"""
from __future__ import annotations

import dataclasses

from jaxtrain.meshes.context_settings import RingKV


@dataclasses.dataclass(frozen=True)
class LatentShape:
    """One device's MLA widths: its heads (split over tensor), per-head key and value widths,
    the latent + rotary key width (never split)."""
    heads: int
    qk_head_dim: int
    v_head_dim: int
    latent_width: int

    @property
    def per_head_width(self) -> int:
        return self.heads * (self.qk_head_dim + self.v_head_dim)


def _layer_names(leaf) -> tuple:
    return leaf.names[leaf.names.index("layers") + 1:] if "layers" in leaf.names else leaf.names


def latent_shape(leaves) -> LatentShape | None:
    """MLA's widths on one device from a kind's leaves (kv_up: kv_lora -> heads x (nope + v);
    the query: -> heads x (nope + rope); k_rope: embed -> rope), None without a latent."""
    by_names = {_layer_names(leaf): leaf for leaf in leaves}
    kv_up = by_names.get(("kv_lora", "heads", "head_dim"))
    query = by_names.get(("embed", "heads", "head_dim")) or by_names.get(("q_lora", "heads", "head_dim"))
    kv_down, k_rope = by_names.get(("embed", "kv_lora")), by_names.get(("embed", "head_dim"))
    if not (kv_up and query and kv_down and k_rope):
        return None
    kv_lora, nope_v = kv_up.shape[-3], kv_up.shape[-1]
    heads = kv_up.gathered_bytes // kv_up.itemsize // (kv_lora * nope_v)  # this device's heads
    qk, rope = query.shape[-1], k_rope.shape[-1]
    return LatentShape(heads=heads, qk_head_dim=qk, v_head_dim=nope_v - (qk - rope), latent_width=kv_lora + rope)


def exchanged_width(leaves, embed: int, kv_exchange=RingKV()) -> int:
    """Values per token of one layer that reach a device over `context` in its forward."""
    mla = latent_shape(leaves)
    if mla is not None:
        return kv_exchange.exchanged_width(kv_heads=mla.heads, qk_head_dim=mla.qk_head_dim,
                                           v_head_dim=mla.v_head_dim, latent_width=mla.latent_width)
    return sum(_projected_kv_width(leaf, embed) for leaf in leaves)


def per_head_kv_values(leaves, kv_exchange, context: int) -> int:
    """Values per token one MLA layer keeps for its backward beyond what the traced
    single-device layer keeps: its per-head keys and values when context > 1 and the exchange
    moves them (not the latent); 0 otherwise."""
    mla = latent_shape(leaves)
    if mla is None or context == 1 or kv_exchange.moves_latent:
        return 0
    return mla.per_head_width


def _projected_kv_width(leaf, embed: int) -> int:
    """Values per token a key/value projection produces: weights from the model width to kv
    heads, a key shared by every head, or a latent (per device: kv heads split over tensor)."""
    names = _layer_names(leaf)
    if len(names) < 2 or names[0] != "embed":
        return 0
    if "kv_heads" in names or names[1:] in (("head_dim",), ("kv_lora",)):  # a latent not read as MLA
        return leaf.gathered_bytes // leaf.itemsize // embed
    return 0


def per_head_kv_saved(leaves, kv_exchange, context: int, tokens: float, itemsize: int, policy: str) -> float:
    """Bytes one MLA layer keeps for its backward beyond the traced layer's residuals under a
    per-head exchange (per_head_kv_values): its tokens' keys and values in the compute dtype
    (`itemsize`, as the platform stores it), unless remat `full` recomputes the layer."""
    if policy == "full":
        return 0.0
    return tokens * per_head_kv_values(leaves, kv_exchange, context) * itemsize


def per_head_kv_backward(leaves, kv_exchange, context: int, tokens: float, itemsize: int) -> float:
    """Bytes of one MLA layer's backward under a per-head exchange: the ring's travelling block
    of keys/values (compute dtype) and its float32 dK/dV (meshes/ring_attention.py), whatever
    the remat policy."""
    return tokens * per_head_kv_values(leaves, kv_exchange, context) * (itemsize + 4)
