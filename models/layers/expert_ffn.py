"""Per-expert feed-forward weights and their grouped computation on expert-sorted tokens.

One strategy per expert shape: gated (SwiGLU-style, DeepSeek) and plain (one up projection,
Nemotron-H's squared ReLU). The grouped matmul is `pallas_kernels.grouped_matmul`, whose XLA
path is `jax.lax.ragged_dot`.
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from models.layers.activations import activation as _activation
from models.layers.params import normal, param
from pallas_kernels.grouped_matmul import grouped_matmul


WEIGHT_AXES = {  # logical axes of each expert weight (`expert_embed`: FSDP splits it over EDP too)
    "gate": ("experts", "expert_embed", "expert_mlp"),
    "up": ("experts", "expert_embed", "expert_mlp"),
    "down": ("experts", "expert_mlp", "expert_embed"),
}


class GatedExperts(nnx.Module):
    """down(act(x @ gate) * (x @ up)) per expert."""

    def __init__(self, num_experts: int, embed: int, hidden: int, *, rngs: nnx.Rngs, activation: str = "silu",
                 init_std: float = 0.02, dtype=jnp.float32):
        self.activation, self.dtype = activation, dtype
        _activation(activation)
        self.gate = param(rngs, normal(init_std), (num_experts, embed, hidden), WEIGHT_AXES["gate"])
        self.up = param(rngs, normal(init_std), (num_experts, embed, hidden), WEIGHT_AXES["up"])
        self.down = param(rngs, normal(init_std), (num_experts, hidden, embed), WEIGHT_AXES["down"])

    def weights(self) -> dict:
        return {"gate": self.gate[...], "up": self.up[...], "down": self.down[...]}

    def compute(self, tokens, group_sizes, weights, kernels: str):
        """tokens [n, embed] sorted by expert; weights may be this device's slice of experts."""
        x = tokens.astype(self.dtype)
        mm = lambda a, w: grouped_matmul(a, w.astype(self.dtype), group_sizes, impl=kernels)
        h = _activation(self.activation)(mm(x, weights["gate"])) * mm(x, weights["up"])
        return mm(h, weights["down"])


class PlainExperts(nnx.Module):
    """down(act(x @ up)) per expert (no gate)."""

    def __init__(self, num_experts: int, embed: int, hidden: int, *, rngs: nnx.Rngs, activation: str = "relu2",
                 init_std: float = 0.02, dtype=jnp.float32):
        self.activation, self.dtype = activation, dtype
        _activation(activation)
        self.up = param(rngs, normal(init_std), (num_experts, embed, hidden), WEIGHT_AXES["up"])
        self.down = param(rngs, normal(init_std), (num_experts, hidden, embed), WEIGHT_AXES["down"])

    def weights(self) -> dict:
        return {"up": self.up[...], "down": self.down[...]}

    def compute(self, tokens, group_sizes, weights, kernels: str):
        x = tokens.astype(self.dtype)
        mm = lambda a, w: grouped_matmul(a, w.astype(self.dtype), group_sizes, impl=kernels)
        return mm(_activation(self.activation)(mm(x, weights["up"])), weights["down"])


