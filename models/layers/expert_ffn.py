"""Per-expert feed-forward weights and their computation on routed tokens.

One strategy per expert shape: gated (SwiGLU-style, DeepSeek) and plain (one up projection,
Nemotron-H's squared ReLU). Each computes two ways, with the same math:

- `compute`: tokens sorted by expert, ragged groups (the dropless dispatch). The grouped matmul
  is `pallas_kernels.grouped_matmul`, whose XLA path is `jax.lax.ragged_dot`.
- `compute_batched`: a fixed [experts, rows, embed] buffer, every expert the same number of rows
  (the capacity dispatch): a dense batched matmul, static shapes on every backend
  (`pallas_kernels.low_precision_dot.batched_matmul`: bf16 operands on XLA:CPU too).
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from models.layers.activations import activation as _activation
from models.layers.params import normal, param
from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.low_precision_dot import batched_matmul


def _batched_matmul(dtype):
    """[e, n, k] x [e, k, m] -> [e, n, m]: one dense matmul per expert."""
    return lambda a, w: batched_matmul(a, w.astype(dtype))


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
        mm = lambda a, w: grouped_matmul(a, w.astype(self.dtype), group_sizes, impl=kernels)
        return self._apply(tokens.astype(self.dtype), weights, mm)

    def compute_batched(self, buffer, weights):
        """buffer [e, n, embed] (n rows per expert, e = this device's experts) -> [e, n, embed]."""
        return self._apply(buffer.astype(self.dtype), weights, _batched_matmul(self.dtype))

    def _apply(self, x, weights, mm):
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
        mm = lambda a, w: grouped_matmul(a, w.astype(self.dtype), group_sizes, impl=kernels)
        return self._apply(tokens.astype(self.dtype), weights, mm)

    def compute_batched(self, buffer, weights):
        return self._apply(buffer.astype(self.dtype), weights, _batched_matmul(self.dtype))

    def _apply(self, x, weights, mm):
        return mm(_activation(self.activation)(mm(x, weights["up"])), weights["down"])


