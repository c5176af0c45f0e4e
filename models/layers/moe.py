"""Mixture-of-Experts block: router, routed experts (expert-parallel), optional shared expert
and optional latent projection around the routed experts.

Returns the output and routing statistics summed over all tokens of the batch (whatever the
mesh), from which the block's auxiliary losses are computed, so they too are layout-free.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jaxtrain.meshes.experts import dispatch_for, moe_forward
from jaxtrain.meshes.rules import active_mesh, active_rules
from jaxtrain.models.layers.aux_outputs import AuxOutput
from jaxtrain.models.layers.dense import Dense
from jaxtrain.models.layers.expert_ffn import GatedExperts, PlainExperts
from jaxtrain.models.layers.router import CORRECTION_BIAS, Router, RouterConfig, updated_correction_bias
from jaxtrain.pallas_kernels.moe_routing import route


@struct.dataclass
class RoutingStats(AuxOutput):
    """One MoE block's routing over the batch, summed over its tokens, and its aux loss. In a
    stack every field has a leading layers axis."""
    expert_load: jax.Array  # [experts] slots routed to each expert (before capacity drops)
    score_sum: jax.Array  # [experts] router scores summed over tokens
    z_sum: jax.Array  # sum of logsumexp(logits)^2
    entropy_sum: jax.Array  # sum of the router distribution's entropy
    tokens: jax.Array
    dropped: jax.Array  # slots dropped by the capacity
    aux_loss: jax.Array  # load-balancing + router z-loss, weighted (a mean over tokens)
    after_update_applies = True  # the router's correction bias follows the load

    def loss(self):
        return self.aux_loss

    @classmethod
    def metrics(cls, outputs: dict, microbatches: int) -> dict:
        """Per MoE layer: max/mean expert load, router entropy; per stack the aux loss; overall
        the dropped-slot fraction."""
        out, dropped, slots = {}, 0.0, 0.0
        for stack, stats in outputs.items():
            load = stats.expert_load.reshape((-1, stats.expert_load.shape[-1]))  # [layers, experts]
            tokens = jnp.maximum(stats.tokens.reshape(-1), 1.0)
            imbalance = load.max(-1) / jnp.maximum(load.mean(-1), 1e-9)
            entropy = stats.entropy_sum.reshape(-1) / tokens
            for i in range(load.shape[0]):
                out[f"moe/{stack}{i}/load_max_over_mean"] = imbalance[i]
                out[f"moe/{stack}{i}/router_entropy"] = entropy[i]
            out[f"moe/{stack}/aux_loss"] = stats.aux_loss.sum() / microbatches
            dropped, slots = dropped + stats.dropped.sum(), slots + load.sum()
        out["moe/dropped_fraction"] = dropped / jnp.maximum(slots, 1.0)
        return out


def make_route_fn(cfg: RouterConfig, kernels: str):
    def route_fn(logits, bias):
        plan = route(logits, top_k=cfg.top_k, score_fn=cfg.score_fn, n_group=cfg.n_group, topk_group=cfg.topk_group,
                     norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor,
                     correction_bias=jax.lax.stop_gradient(bias) if cfg.correction_bias else None, impl=kernels)
        scores = jax.nn.softmax(logits, -1) if cfg.score_fn == "softmax" else jax.nn.sigmoid(logits)
        return plan.expert_ids, plan.weights, scores, plan.sort_order
    return route_fn


class MoEBlock(nnx.Module):
    def __init__(self, embed: int, *, router: RouterConfig, expert_hidden: int, rngs: nnx.Rngs, gated: bool = True,
                 activation: str = "silu", shared: nnx.Module | None = None, latent_dim: int | None = None,
                 latent_bias: bool = False, init_std: float = 0.02, dtype=jnp.float32, kernels: str = "xla"):
        self.cfg, self.kernels, self.expert_hidden = router, kernels, expert_hidden
        self.router = Router(embed, router, rngs=rngs, init_std=init_std)
        inner = latent_dim or embed
        kw = dict(rngs=rngs, init_std=init_std, dtype=dtype)
        # `latent_bias`: biases on the two latent projections (Nemotron-H ties them to its mlp_bias)
        self.latent_down = Dense((embed,), (inner,), in_axes=("embed",), out_axes=("moe_latent",),
                                 use_bias=latent_bias, **kw) if latent_dim else None
        self.latent_up = Dense((inner,), (embed,), in_axes=("moe_latent",), out_axes=("embed",),
                               use_bias=latent_bias, **kw) if latent_dim else None
        experts_cls = GatedExperts if gated else PlainExperts
        self.experts = experts_cls(router.num_experts, inner, expert_hidden, activation=activation, **kw)
        self.shared = shared

    def __call__(self, x):
        logits = self.router.logits(x)
        h = self.latent_down(x) if self.latent_down is not None else x
        bias = getattr(self.router, CORRECTION_BIAS)
        kernels = self.kernels
        y, stats = moe_forward(
            h, logits, None if bias is None else bias[...], self.experts.weights(), self.experts.weight_axes(),
            route=make_route_fn(self.cfg, kernels),
            ffn=lambda tokens, sizes, weights: self.experts.compute(tokens, sizes, weights, kernels),
            batched_ffn=self.experts.compute_batched, dispatch=dispatch_for(self.cfg.capacity_factor),
            num_experts=self.cfg.num_experts, hidden=self.expert_hidden, mesh=active_mesh(), rules=active_rules(),
            weight_dtype=self.experts.dtype)
        if self.latent_up is not None:
            y = self.latent_up(y)
        if self.shared is not None:
            y = y + self.shared(x).astype(y.dtype)
        return y, RoutingStats(**stats, aux_loss=self.aux_loss(stats))

    def aux_loss(self, stats):
        """Load-balancing loss E * sum_e f_e * P_e (f: fraction of slots, P: mean score) and
        router z-loss, weighted by the router config."""
        c = self.cfg
        tokens = jnp.maximum(stats["tokens"], 1.0)
        balance = c.num_experts * jnp.sum(stats["expert_load"] / (tokens * c.top_k) * stats["score_sum"] / tokens)
        return c.aux_loss_weight * balance + c.z_loss_weight * stats["z_sum"] / tokens

    def after_update(self, stats: RoutingStats) -> None:
        self.update_correction_bias(stats.expert_load)

    def update_correction_bias(self, expert_load) -> None:
        """After an optimizer step: nudge the selection bias toward balanced load."""
        bias = getattr(self.router, CORRECTION_BIAS)
        if bias is not None:
            bias[...] = updated_correction_bias(bias[...], expert_load, self.cfg.bias_update_rate)
