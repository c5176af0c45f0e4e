"""Capacity-factor MoE dispatch: fixed [experts, capacity, embed] buffers (GShard, Switch, MaxText).

Each device keeps at most C = ceil(cf * tokens * top_k / experts) slots per expert of its own
tokens: all first choices in token order, then all second choices, ...; later slots are dropped
and contribute nothing. The kept slots are gathered into an [experts, C, embed] buffer. Under
expert parallelism a plain `all_to_all` moves it as fixed [EP, local experts, C, embed] blocks
(no counts, no ragged collective), each device runs its local experts as one dense batched
matmul over [local experts, EP * C, embed], the results travel back the same way, and every token
gathers its kept slots' rows. Work, memory and exchanged bytes are proportional to cf, not to the
number of slots routed.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp


def expert_capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots each expert takes from one device's tokens."""
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def slot_positions(expert_ids, num_experts: int):
    """expert_ids [t, k] -> each slot's place in its expert's queue [t, k]: first choices before
    second ones, earlier tokens first."""
    t, k = expert_ids.shape
    priority = expert_ids.T.reshape(-1)  # all first choices, then all second choices, ...
    onehot = jax.nn.one_hot(priority, num_experts, dtype=jnp.int32)
    position = (jnp.cumsum(onehot, axis=0) * onehot).sum(-1) - 1
    return position.reshape(k, t).T


def apply_capacity(expert_ids, num_experts: int, capacity_factor: float):
    """The ids with slots past the capacity relabelled `num_experts` (dropped); (ids, dropped count)."""
    t, k = expert_ids.shape
    keep = slot_positions(expert_ids, num_experts) < expert_capacity(t, k, num_experts, capacity_factor)
    return jnp.where(keep, expert_ids, num_experts), (~keep).sum()


def _run_experts(buffer, expert_weights, batched_ffn: Callable, layout):
    """buffer [experts, C, d] of this device's tokens -> the experts' outputs, same shape."""
    ep = layout.ep_size if layout is not None else 1
    if ep == 1:
        return batched_ffn(buffer, expert_weights)
    e, c, d = buffer.shape
    local = e // ep
    # Block i (experts i*local ...) goes to EP device i; each device receives every source's C rows
    # for each of its experts, sources side by side: [1, local, EP * C, d].
    mine = jax.lax.all_to_all(buffer.reshape(ep, local, c, d), layout.ep_axes, 0, 2, tiled=True)
    out = batched_ffn(mine[0], expert_weights)
    back = jax.lax.all_to_all(out[None], layout.ep_axes, 2, 0, tiled=True)  # [EP, local, C, d]
    return back.reshape(e, c, d)


@dataclasses.dataclass(frozen=True)
class CapacityDispatch:
    """Experts take at most `capacity_factor` x their even share of each device's slots."""
    capacity_factor: float

    def __post_init__(self):
        if not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be positive, got {self.capacity_factor}")

    def __call__(self, x, expert_ids, weights, order, expert_weights, *, ffn, batched_ffn, layout,
                 num_experts: int, exchange):
        """x [t, d]; expert_ids, weights [t, k] -> (y [t, d], slots dropped). `order`, `ffn` and
        `exchange` serve the dropless dispatch (sorted slots, grouped matmul, ragged exchange)."""
        del order, ffn, exchange
        if batched_ffn is None:
            raise ValueError("the capacity dispatch runs experts on a fixed buffer: pass batched_ffn "
                             "(e.g. GatedExperts.compute_batched) to moe_forward")
        t, k = expert_ids.shape
        c = expert_capacity(t, k, num_experts, self.capacity_factor)
        position = slot_positions(expert_ids, num_experts)
        keep = position < c
        cells = num_experts * c
        cell = jnp.where(keep, expert_ids * c + position, cells)  # [t, k] buffer row; `cells`: dropped
        # The token in each buffer row (t: empty). Dropped slots index past the end: mode="drop".
        source = jnp.full((cells,), t, jnp.int32).at[cell.reshape(-1)].set(
            jnp.repeat(jnp.arange(t, dtype=jnp.int32), k), mode="drop")
        buffer = x.at[source].get(mode="fill", fill_value=0).reshape(num_experts, c, x.shape[-1])
        out = _run_experts(buffer, expert_weights, batched_ffn, layout).reshape(cells, -1)
        per_slot = out.at[cell].get(mode="fill", fill_value=0)  # [t, k, d]; dropped slots read zeros
        y = jnp.einsum("tkd,tk->td", per_slot, weights.astype(per_slot.dtype)).astype(x.dtype)
        return y, (~keep).sum().astype(jnp.float32)
