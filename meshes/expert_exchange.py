"""Token exchange between expert-parallel devices: one strategy per collective.

Both take this device's token-slots sorted by destination device (dropped slots last) and
return (rows received, their local expert ids, a handle); `back` sends computed rows home in
the original order. Received rows that carry no token have the id `num_local` (sorted last,
ignored by the grouped matmul).

- PaddedExchange: `all_to_all` of fixed [devices, slots] buffers. Runs on every backend
  (XLA:CPU has no ragged collective) and is what the CPU tests check.
- RaggedExchange: `ragged_all_to_all` sends only the filled rows (GPU). Same results; the
  receive buffer keeps the worst-case size, since shapes must be static.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def _exclusive_cumsum(x, axis=-1):
    return jnp.cumsum(x, axis=axis) - x


@dataclasses.dataclass(frozen=True)
class PaddedExchange:
    axes: tuple[str, ...]
    devices: int

    def send(self, tokens, local_ids, dest, counts, num_local):
        slots = tokens.shape[0]
        pos = jnp.arange(slots) - _exclusive_cumsum(counts)[jnp.minimum(dest, self.devices - 1)]
        buf = jnp.zeros((self.devices, slots) + tokens.shape[1:], tokens.dtype).at[dest, pos].set(tokens, mode="drop")
        ids = jnp.full((self.devices, slots), num_local, jnp.int32).at[dest, pos].set(local_ids, mode="drop")
        recv, recv_ids = self._a2a(buf), self._a2a(ids)
        return recv.reshape((-1,) + tokens.shape[1:]), recv_ids.reshape(-1), (dest, pos)

    def back(self, computed, handle):
        dest, pos = handle
        slots = computed.shape[0] // self.devices
        home = self._a2a(computed.reshape((self.devices, slots) + computed.shape[1:]))
        return home.at[dest, pos].get(mode="fill", fill_value=0)

    def _a2a(self, x):
        return jax.lax.all_to_all(x, self.axes, 0, 0, tiled=True)


def ragged_send_plan(matrix, me):
    """From the [sender, receiver] slot-count matrix, device `me`'s ragged_all_to_all arguments
    for sending its destination-sorted rows: (input offsets, send sizes, offsets in each
    receiver's buffer — after the rows of lower-ranked senders —, receive sizes)."""
    counts = matrix[me]
    return _exclusive_cumsum(counts), counts, _exclusive_cumsum(matrix, axis=0)[me], matrix[:, me]


def ragged_back_plan(matrix, me):
    """The same for sending computed rows back: the receive layout becomes the send layout."""
    recv_sizes = matrix[:, me]
    return _exclusive_cumsum(recv_sizes), recv_sizes, _exclusive_cumsum(matrix, axis=1)[:, me], matrix[me]


@dataclasses.dataclass(frozen=True)
class RaggedExchange:
    axes: tuple[str, ...]
    devices: int

    def send(self, tokens, local_ids, dest, counts, num_local):
        slots = tokens.shape[0]
        matrix = jax.lax.all_gather(counts, self.axes)  # [sender, receiver] slot counts
        me = jax.lax.axis_index(self.axes)
        send_offsets, send_sizes, remote_offsets, recv_sizes = ragged_send_plan(matrix, me)
        size = (self.devices * slots,)
        ragged = lambda x, out: jax.lax.ragged_all_to_all(x, out, send_offsets, send_sizes, remote_offsets,
                                                          recv_sizes, axis_name=self.axes)
        recv = ragged(tokens, jnp.zeros(size + tokens.shape[1:], tokens.dtype))
        recv_ids = ragged(local_ids, jnp.full(size, num_local, jnp.int32))
        return recv, recv_ids, (matrix, me)

    def back(self, computed, handle):
        matrix, me = handle
        slots = computed.shape[0] // self.devices
        return jax.lax.ragged_all_to_all(computed, jnp.zeros((slots,) + computed.shape[1:], computed.dtype),
                                         *ragged_back_plan(matrix, me), axis_name=self.axes)


EXCHANGES = {"padded": PaddedExchange, "ragged": RaggedExchange}


def make_exchange(kind: str, axes: tuple[str, ...], devices: int, platform: str):
    """`auto`: ragged where the backend implements it (GPU), padded elsewhere."""
    if kind == "auto":
        kind = "ragged" if platform in ("gpu", "cuda", "rocm") else "padded"
    if kind not in EXCHANGES:
        raise ValueError(f"unknown expert exchange {kind!r}; choose auto, padded or ragged")
    return EXCHANGES[kind](axes, devices)
