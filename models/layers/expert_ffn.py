"""Per-expert feed-forward weights and their computation on routed tokens.

One strategy per expert shape: gated (SwiGLU-style, DeepSeek) and plain (one up projection,
Nemotron-H's squared ReLU). Each computes two ways, with the same math:

- `compute`: tokens sorted by expert, ragged groups (the dropless dispatch). The grouped matmul
  is `pallas_kernels.grouped_matmul`, whose XLA path is `jax.lax.ragged_dot`.
- `compute_batched`: a fixed [experts, rows, embed] buffer, every expert the same number of rows
  (the capacity dispatch): a dense batched matmul, static shapes on every backend
  (`pallas_kernels.low_precision_dot.batched_matmul`: bf16 operands on XLA:CPU too).

`adapter`, when a model transform sets one (models/lora.py ExpertAdapters), adds a low-rank term
per expert to named projections. Its factors are expert weights like the others (stacked over
experts, in `weights()` under their own names and logical axes), so the expert-parallel dispatch
slices and gathers them as it does the experts, and both paths add the term with the same
per-expert matmul as the base projection.
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxtrain.models.layers.activations import activation as _activation
from jaxtrain.models.layers.params import normal, param
from jaxtrain.pallas_kernels.grouped_matmul import grouped_matmul
from jaxtrain.pallas_kernels.low_precision_dot import batched_matmul


def _batched_matmul(dtype):
    """[e, n, k] x [e, k, m] -> [e, n, m]: one dense matmul per expert."""
    return lambda a, w: batched_matmul(a, w.astype(dtype))


WEIGHT_AXES = {  # logical axes of each expert weight (`expert_embed`: FSDP splits it over EDP too)
    "gate": ("experts", "expert_embed", "expert_mlp"),
    "up": ("experts", "expert_embed", "expert_mlp"),
    "down": ("experts", "expert_mlp", "expert_embed"),
}


class Experts(nnx.Module):
    """What both expert shapes share: their weights by name, and one projection with its adapter."""

    adapter = None
    projections: tuple[str, ...] = ()

    def weights(self) -> dict:
        base = {name: getattr(self, name)[...] for name in self.projections}
        return base if self.adapter is None else {**base, **self.adapter.weights()}

    def weight_axes(self) -> dict:
        """{weight name: logical axes} for every entry of `weights()`."""
        base = {name: WEIGHT_AXES[name] for name in self.projections}
        return base if self.adapter is None else {**base, **self.adapter.weight_axes()}

    def compute(self, tokens, group_sizes, weights, kernels: str):
        """tokens [n, embed] sorted by expert; weights may be this device's slice of experts."""
        mm = lambda a, w: grouped_matmul(a, w.astype(self.dtype), group_sizes, impl=kernels)
        return self._apply(tokens.astype(self.dtype), weights, mm)

    def compute_batched(self, buffer, weights):
        """buffer [e, n, embed] (n rows per expert, e = this device's experts) -> [e, n, embed]."""
        return self._apply(buffer.astype(self.dtype), weights, _batched_matmul(self.dtype))

    def _project(self, x, weights, name: str, mm):
        y = mm(x, weights[name])
        if self.adapter is not None and self.adapter.adapts(name):
            y = y + self.adapter.term(name, x, weights, mm)
        return y


class GatedExperts(Experts):
    """down(act(x @ gate) * (x @ up)) per expert."""

    projections = ("gate", "up", "down")

    def __init__(self, num_experts: int, embed: int, hidden: int, *, rngs: nnx.Rngs, activation: str = "silu",
                 init_std: float = 0.02, dtype=jnp.float32):
        self.activation, self.dtype = activation, dtype
        _activation(activation)
        self.gate = param(rngs, normal(init_std), (num_experts, embed, hidden), WEIGHT_AXES["gate"])
        self.up = param(rngs, normal(init_std), (num_experts, embed, hidden), WEIGHT_AXES["up"])
        self.down = param(rngs, normal(init_std), (num_experts, hidden, embed), WEIGHT_AXES["down"])

    def _apply(self, x, weights, mm):
        project = lambda v, name: self._project(v, weights, name, mm)
        h = _activation(self.activation)(project(x, "gate")) * project(x, "up")
        return project(h, "down")


class PlainExperts(Experts):
    """down(act(x @ up)) per expert (no gate)."""

    projections = ("up", "down")

    def __init__(self, num_experts: int, embed: int, hidden: int, *, rngs: nnx.Rngs, activation: str = "relu2",
                 init_std: float = 0.02, dtype=jnp.float32):
        self.activation, self.dtype = activation, dtype
        _activation(activation)
        self.up = param(rngs, normal(init_std), (num_experts, embed, hidden), WEIGHT_AXES["up"])
        self.down = param(rngs, normal(init_std), (num_experts, hidden, embed), WEIGHT_AXES["down"])

    def _apply(self, x, weights, mm):
        project = lambda v, name: self._project(v, weights, name, mm)
        return project(_activation(self.activation)(project(x, "up")), "down")


