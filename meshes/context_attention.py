"""Attention under a mesh: each device attends its own queries, the `context` axis splits the
sequence for real.

One `shard_map` over the whole mesh (batch over the data axes, heads over `tensor`, the
sequence over `context`) runs a single-device attention kernel (pallas_kernels/flash_attention)
on every device's shard. How a rank sees the keys of other ranks is the context-parallel
setting's choice (meshes/context_layout.py):

  RingKV        K/V blocks travel around the context ring (meshes/ring_attention.py)
  AllGatherKV   K/V gathered over `context` once, inside the shard_map
  LatentKV      (MLA's choice, below; attention without a latent rings as RingKV)
  kv_whole      the caller already holds whole-sequence K/V

`sharded_latent_attention` is MLA's variant: every rank holds the whole sequence's small latent
(gathered over `context`) and up-projects it to per-head keys/values one chunk at a time inside
the attention (meshes/latent_attention.py), so per-head keys neither cross the network nor exist
for the whole sequence at once. MLA (models/layers/mla.py) takes it with one context rank, and
under context parallelism only with `LatentKV()`: every rank up-projecting the whole sequence
replicates (C - 1) / C of that work for ~9x fewer bytes crossing `context`; by default each rank
up-projects its own tokens and `sharded_attention` moves the per-head keys.

Token places from the layout give the causal mask, so the load-balanced order is exact.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain.meshes.context_layout import active_context_parallel, device_order
from jaxtrain.meshes.latent_attention import latent_attention
from jaxtrain.meshes.ring_attention import ring_attention
from jaxtrain.meshes.rules import _ACTIVE, spec_for
from jaxtrain.pallas_kernels.flash_attention import flash_attention

_DEFAULT_BLOCK = 512  # the blockwise kernel's default block (pallas_kernels/flash_attention_xla.py)

Q_NAMES = ("batch", "length", "heads", None)
KV_NAMES = ("batch", "length", "kv_heads", None)
ROW_NAMES = ("batch", "length")
# MLA: the latent and the rotary key span the whole sequence; the latent's dim is contracted
# inside, so it stays whole on every device (as do the head dims).
LATENT_NAMES = ("batch", None, None)
W_UP_NAMES = (None, "heads", None)


def sequence_order(length: int):
    """Token places in the order the active layout holds them: [length] int32 numpy (0..L-1
    without context parallelism)."""
    active = _ACTIVE.get()
    context = 1 if active is None else active[0].shape["context"]
    if context == 1:
        return np.arange(length, dtype=np.int32)
    return device_order(active_context_parallel().layout, length, context)


def layout_block(block, layout, length: int, context: int):
    """The kernel's block along a rank's tokens: the caller's, or else one chunk of the layout
    when a rank holds several (LoadBalanced: chunks r and 2C-1-r). A block spanning both chunks
    has the place range of both, so the kernel's causal skip (a key block placed wholly after a
    query block) never fires: every rank would compute the full local square at every ring step,
    twice the causal work. With chunk-sized blocks 3 of a rank's 8 tiles per layer are skipped
    at context 2. Only a power-of-2 chunk of 16 to 256 tokens (the GPU kernels'
    tile rules); a longer power-of-2 chunk already holds whole default blocks (512, or fewer
    tokens), and a bigger block would grow the kernel's score tile with the length."""
    if block is not None or layout.chunks_per_rank == 1:
        return block
    chunk = length // (context * layout.chunks_per_rank)
    return chunk if 16 <= chunk < _DEFAULT_BLOCK and chunk & (chunk - 1) == 0 else None


def sharded_attention(q, k, v, segment_ids, *, scale: float, impl: str, block_q=None, block_k=None,
                      kv_whole: bool = False, kv_head_name: str = "kv_heads"):
    """q [b, l, h, d]; k, v [b, l or L, kv, d|dv]; segment_ids [b, l] -> [b, l, h, dv].

    Outside `use_rules` it is one kernel call. `kv_whole`: k and v span the whole sequence (in
    device order) on every context rank. `kv_head_name`: the logical name of k/v's head dim.
    """
    active = _ACTIVE.get()
    if active is None:
        return flash_attention(q, k, v, segment_ids, segment_ids, scale=scale, impl=impl, block_q=block_q,
                               block_k=block_k)
    mesh, rules = active
    context = mesh.shape["context"]
    settings = active_context_parallel()
    order = device_order(settings.layout, q.shape[1], context) if context > 1 else np.arange(q.shape[1],
                                                                                             dtype=np.int32)
    if context > 1:
        block_q, block_k = (layout_block(b, settings.layout, q.shape[1], context) for b in (block_q, block_k))
    kernel = (float(scale), impl, block_q, block_k)
    table = rules.activations
    kv_names = (KV_NAMES[0], None) + KV_NAMES[2:] if kv_whole else KV_NAMES
    kv_names = kv_names[:2] + (kv_head_name,) + kv_names[3:]
    q_spec = spec_for(Q_NAMES, q.shape, table, mesh)
    kv_spec = spec_for(kv_names, k.shape, table, mesh)
    v_spec = spec_for(kv_names, v.shape, table, mesh)
    row_spec = spec_for(ROW_NAMES, segment_ids.shape, table, mesh)
    length_axes = q_spec[1]  # "context", or None when the sequence is not split
    gather_kv = kv_whole or settings.kv_exchange.gathers_keys

    def local(q, k, v, seg, order):
        rank = jax.lax.axis_index(length_axes) if length_axes else 0
        places = jax.lax.dynamic_slice_in_dim(order, rank * q.shape[1], q.shape[1])
        if not length_axes:
            return flash_attention(q, k, v, seg, seg, places, places, scale=scale, impl=impl, block_q=block_q,
                                   block_k=block_k)
        if not gather_kv:
            return ring_attention(q, k, v, seg, order, length_axes, context, kernel)
        all_seg = jax.lax.all_gather(seg, length_axes, axis=1, tiled=True)
        if not kv_whole:
            k, v = (jax.lax.all_gather(a, length_axes, axis=1, tiled=True) for a in (k, v))
        return flash_attention(q, k, v, seg, all_seg, places, order, scale=scale, impl=impl, block_q=block_q,
                               block_k=block_k)

    place = lambda a, spec: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec))
    # check_vma=False: pallas_call outputs carry no varying-axes annotation (see ARCHITECTURE.md).
    run = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, v_spec, row_spec, PartitionSpec()),
                        out_specs=PartitionSpec(*q_spec[:3], None), check_vma=False)
    return run(place(q, q_spec), place(k, kv_spec), place(v, v_spec), place(segment_ids, row_spec),
               jax.numpy.asarray(order))


def sharded_latent_attention(q, latent, k_rope, w_up, segment_ids, *, nope: int, scale: float, impl: str,
                             block_q=None, block_k=None):
    """q [b, l, h, nope + rope] (this rank's queries); latent [b, L, kv_lora] and k_rope [b, L, rope]:
    the whole sequence in device order; w_up [kv_lora, h, nope + dv]; segment_ids [b, l]
    -> [b, l, h, dv]. Each device attends its queries to the latent up-projected by its own heads'
    slice of w_up, a context rank's length of keys at a time. Outside `use_rules`: one direct call.
    """
    kernel = dict(nope=nope, scale=scale, impl=impl, block_q=block_q, block_k=block_k)
    active = _ACTIVE.get()
    if active is None:
        places = jax.numpy.arange(q.shape[1], dtype=jax.numpy.int32)
        return latent_attention(q, latent, k_rope, w_up, segment_ids, segment_ids, places, places,
                                chunk=q.shape[1], **kernel)
    mesh, rules = active
    table = rules.activations
    order = sequence_order(q.shape[1])
    q_spec = spec_for(Q_NAMES, q.shape, table, mesh)
    latent_spec = spec_for(LATENT_NAMES, latent.shape, table, mesh)
    rope_spec = spec_for(LATENT_NAMES, k_rope.shape, table, mesh)
    # Each device needs the heads of its queries: the weight laid out like the activations' heads
    # (a parameter table may split it otherwise, e.g. FSDP; the constraint gathers it then).
    w_spec = spec_for(W_UP_NAMES, w_up.shape, table, mesh)
    row_spec = spec_for(ROW_NAMES, segment_ids.shape, table, mesh)
    length_axes = q_spec[1]  # "context", or None when the sequence is not split

    def local(q, latent, k_rope, w_up, seg, order):
        if length_axes:
            rank = jax.lax.axis_index(length_axes)
            places = jax.lax.dynamic_slice_in_dim(order, rank * q.shape[1], q.shape[1])
            all_seg = jax.lax.all_gather(seg, length_axes, axis=1, tiled=True)
        else:
            places, all_seg = order, seg
        return latent_attention(q, latent, k_rope, w_up, seg, all_seg, places, order, chunk=q.shape[1], **kernel)

    place = lambda a, spec: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec))
    # check_vma=False: pallas_call outputs carry no varying-axes annotation (see ARCHITECTURE.md).
    # Its transpose sums the latent's and w_up's per-rank gradient shares over `context`.
    run = jax.shard_map(local, mesh=mesh,
                        in_specs=(q_spec, latent_spec, rope_spec, w_spec, row_spec, PartitionSpec()),
                        out_specs=PartitionSpec(*q_spec[:3], None), check_vma=False)
    return run(place(q, q_spec), place(latent, latent_spec), place(k_rope, rope_spec), place(w_up, w_spec),
               place(segment_ids, row_spec), jax.numpy.asarray(order))


def gather_sequence(x, names):
    """`x` whole along its `length` dim on every device (an all-gather over `context`), still
    split as `names` says along its other dims. A no-op without context parallelism."""
    active = _ACTIVE.get()
    if active is None or active[0].shape["context"] == 1:
        return x
    mesh, rules = active
    whole = tuple(None if n == "length" else n for n in names)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec_for(whole, x.shape, rules.activations,
                                                                               mesh)))
