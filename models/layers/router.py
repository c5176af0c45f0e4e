"""MoE router: a linear score per expert, then top-k selection by a routing strategy.

Selection itself (softmax or sigmoid scores, group-limited top-k, weight normalization and
scaling, the aux-loss-free correction bias) lives in `pallas_kernels.moe_routing.route`, whose
XLA path is the reference and whose Pallas path is the GPU kernel; `moe.make_route_fn` calls it.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from jaxtrain.models.layers.params import LOGICAL_AXES, OPTIMIZER, normal, param

CORRECTION_BIAS = "correction_bias"  # updated by the train step, never by the optimizer


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    num_experts: int = 8
    top_k: int = 2
    score_fn: str = "softmax"  # softmax | sigmoid
    n_group: int = 1  # group-limited routing: experts in n_group groups,
    topk_group: int = 1  # tokens may only pick experts in their best topk_group groups
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False  # DeepSeek-V3 aux-loss-free balancing bias (selection only)
    bias_update_rate: float = 1e-3  # bias += rate * sign(mean load - load) after each step
    aux_loss_weight: float = 0.0  # load-balancing loss E * sum_e f_e * P_e
    z_loss_weight: float = 0.0  # router z-loss mean(logsumexp(logits)^2)
    capacity_factor: float | None = None  # None: dropless; else each device keeps at most
    #   ceil(cf * slots / experts) slots per expert in a fixed buffer, computed densely
    #   (meshes/expert_capacity.py): compute, memory and exchange proportional to cf

    def validate(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"RouterConfig.top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"RouterConfig: n_group={self.n_group} must divide num_experts={self.num_experts} "
                             f"and topk_group={self.topk_group} must be in [1, n_group]")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"RouterConfig.capacity_factor must be positive, got {self.capacity_factor}")


class Router(nnx.Module):
    def __init__(self, embed: int, cfg: RouterConfig, *, rngs: nnx.Rngs, init_std: float = 0.02):
        cfg.validate()
        self.cfg = cfg
        self.kernel = param(rngs, normal(init_std), (embed, cfg.num_experts), ("embed", "router_experts"))
        if cfg.correction_bias:
            setattr(self, CORRECTION_BIAS, nnx.Param(jnp.zeros((cfg.num_experts,), jnp.float32),
                                                     **{LOGICAL_AXES: ("router_experts",), OPTIMIZER: "frozen"}))
        else:
            setattr(self, CORRECTION_BIAS, None)

    def logits(self, x):
        """Router logits in float32 (selection is sensitive to rounding)."""
        return jnp.einsum("...d,de->...e", x.astype(jnp.float32), self.kernel[...].astype(jnp.float32))


def updated_correction_bias(bias, expert_load, rate: float):
    """Aux-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded ones."""
    load = expert_load.astype(jnp.float32)
    return bias + rate * jnp.sign(load.mean(-1, keepdims=True) - load)
