"""Context parallelism for the Mamba-2 mixer: the SSD scan and the short causal conv with the
sequence split over the `context` mesh axis, instead of gathered whole by XLA.

Each rank holds `chunks_per_rank` chunks of the sequence (meshes/context_layout.py); each chunk
runs through the single-device kernel as an independent sequence (stacked on the batch dim),
and only a small summary of every chunk crosses the network:

  conv   the last `kernel - 1` tokens of each chunk (and their segment ids) go to the rank
         holding the next chunk (ppermute), which prepends them as a halo; the kernel's segment
         masking drops halo taps from another document, and the halo's outputs are thrown away.
  scan   each chunk is scanned from a zero state, giving its outputs y0, its final state F_j
         and its decay T_j = exp(sum dt*A) (0 when a document starts inside it). After an
         all_gather of these, every rank runs the tiny recurrence over chunks in global order,
             S_in(j) = keep_j * (T_{j-1} S_in(j-1) + F_{j-1}),   S_in(0) = 0,
         keep_j = 0 where a document starts exactly at chunk j, and adds the incoming state's
         share to the tokens of its chunk's first document:
             y_t += exp(cumsum_{s<=t} dt_s A) * (C_t . S_in(j)).

Everything is plain JAX around the kernels, so gradients come from autodiff (all_gather's
transpose is a reduce-scatter back to the owning rank, ppermute's the reverse ppermute).
Per-chunk summaries are laid out [b, chunk, ...], so stacking chunks on the batch dim is a
free reshape.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jaxtrain.meshes.context_layout import active_context_parallel
from jaxtrain.meshes.rules import _ACTIVE, spec_for

AXIS = "context"
_F32 = jnp.float32


def _runs(order):
    """`order` (gathered positions in global chunk order) as runs of constant stride:
    [(first position, stride, count)], so reordering costs a slice or two (Contiguous: one;
    LoadBalanced: two, the second reversed), not one per chunk."""
    runs, i = [], 0
    while i < len(order):
        j = i + 1
        step = order[j] - order[i] if j < len(order) else 1
        while j < len(order) and order[j] - order[j - 1] == step and step != 0:
            j += 1
        runs.append((int(order[i]), int(step), j - i))
        i = j
    return runs


class _Split:
    """The active mesh, its rule table with `length` over `context`, and the layout's chunks."""

    def __init__(self, length: int, what: str):
        active = _ACTIVE.get()
        if active is None:
            raise ValueError(f"{what}: context parallelism needs an active mesh (meshes.rules.use_rules)")
        self.mesh, rules = active
        self.table = {**rules.activations, "length": (AXIS,)}
        self.context = self.mesh.shape[AXIS]
        layout = active_context_parallel().layout
        self.per_rank = layout.chunks_per_rank
        chunks = self.context * self.per_rank
        if length % chunks:
            raise ValueError(f"{what}: sequence length {length} is not divisible by context={self.context} x "
                             f"{self.per_rank} chunks per rank ({type(layout).__name__} layout)")
        self.chunk = length // chunks
        self.ids = layout.chunk_ids(self.context)  # [context, per_rank] global chunk ids
        gathered = self.ids.reshape(-1)  # global id at each all_gather position (rank-major)
        self.runs = _runs([int(p) for p in sorted(range(chunks), key=lambda p: gathered[p])])

    def spec(self, names, a):
        return spec_for(names, a.shape, self.table, self.mesh)

    def place(self, a, spec):
        return jax.lax.with_sharding_constraint(a, NamedSharding(self.mesh, spec))

    # ---- inside the shard_map; per-chunk arrays are [b, chunk, ...] ----

    def stack(self, a):
        """[b, per_rank * m, ...] -> [b * per_rank, m, ...]: each local chunk its own row."""
        return a.reshape(a.shape[0] * self.per_rank, a.shape[1] // self.per_rank, *a.shape[2:])

    def unstack(self, a, b):
        return a.reshape(b, self.per_rank * a.shape[1], *a.shape[2:])

    def gather_global(self, a):
        """[b, per_rank, ...] per local chunk -> [b, chunks, ...] of every chunk, global order."""
        everyone = jax.lax.all_gather(a, AXIS, axis=1, tiled=True)  # rank-major
        parts = []
        for start, step, count in self.runs:  # static slices: cheap to compile and to transpose
            stop = start + step * (count - 1)
            if step > 0:
                parts.append(everyone[:, start:stop + 1:step])
            else:
                parts.append(jnp.flip(everyone[:, stop:start + 1:-step], axis=1))
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)

    def pick_mine(self, per_chunk):
        """[b, chunks, ...] in global order -> [b, per_rank, ...]: this rank's chunks."""
        ids = jnp.asarray(self.ids, jnp.int32)[jax.lax.axis_index(AXIS)]
        mine = [jax.lax.dynamic_slice_in_dim(per_chunk, ids[i], 1, axis=1) for i in range(self.per_rank)]
        return mine[0] if len(mine) == 1 else jnp.concatenate(mine, axis=1)

    def from_predecessor(self, a):
        """[b, per_rank, ...] per local chunk -> the same of the chunk before each one in the
        original sequence (zeros for chunk 0). One ppermute per (source slot, destination slot)
        pair in use; each rank receives a slot from exactly one of them, zeros from the rest."""
        where = {int(c): (r, i) for r, row in enumerate(self.ids) for i, c in enumerate(row)}
        pairs = {}
        for chunk, (rank, slot) in where.items():
            if chunk:
                src_rank, src_slot = where[chunk - 1]
                pairs.setdefault((src_slot, slot), []).append((src_rank, rank))
        out = [None] * self.per_rank
        for (src_slot, slot), perm in sorted(pairs.items()):
            got = jax.lax.ppermute(a[:, src_slot], AXIS, perm)
            out[slot] = got if out[slot] is None else out[slot] + got
        return jnp.stack([jnp.zeros_like(a[:, 0]) if o is None else o for o in out], axis=1)


def _length_split(spec, what):
    if spec[1] != AXIS:
        raise ValueError(f"{what}: the rule table must split `length` over `{AXIS}` only, got {spec}")


def context_causal_conv(conv: Callable, x, w, bias, segment_ids, channel: str):
    """conv(x [b, l, d], w [d, k], bias [d] | None, seg [b, l]) -> [b, l, d], run per shard with
    the sequence split over `context`; `channel` is the logical name of d."""
    split = _Split(x.shape[1], "causal conv")
    halo = w.shape[1] - 1
    if split.chunk < halo:
        raise ValueError(f"causal conv: context chunks of {split.chunk} tokens are shorter than the conv halo "
                         f"({halo} tokens); use a longer sequence or a smaller context axis")
    x_spec = split.spec(("batch", "length", channel), x)
    _length_split(x_spec, "causal conv")
    w_spec = split.spec((channel, None), w)
    s_spec = split.spec(("batch", "length"), segment_ids)

    def local(x, w, seg, bias=None):
        b, k = x.shape[0], split.per_rank
        xs, ss = split.stack(x), split.stack(seg)  # [b*k, m, d], [b*k, m]
        if halo == 0:
            return split.unstack(conv(xs, w, bias, ss), b)
        # Chunk 0 receives zeros, as the kernel pads before t = 0.
        hx = split.from_predecessor(xs[:, -halo:].reshape(b, k, halo, -1)).reshape(b * k, halo, -1)
        hs = split.from_predecessor(ss[:, -halo:].reshape(b, k, halo)).reshape(b * k, halo)
        y = conv(jnp.concatenate([hx, xs], 1), w, bias, jnp.concatenate([hs, ss], 1))
        return split.unstack(y[:, halo:], b)

    args, specs = [x, w, segment_ids], [x_spec, w_spec, s_spec]
    if bias is not None:
        args.append(bias)
        specs.append(split.spec((channel,), bias))
    args = [split.place(a, s) for a, s in zip(args, specs)]
    # check_vma=False: Pallas outputs carry no varying-axes annotation.
    return jax.shard_map(local, mesh=split.mesh, in_specs=tuple(specs), out_specs=x_spec, check_vma=False)(*args)


def _incoming_states(split: _Split, final, decay, first_id, last_id):
    """[b, per_rank, h, p, n]: the state entering each local chunk from the chunks before it in
    the original sequence. Per local chunk: final [b, k, h, p, n], decay [b, k, h], ids of
    its first and last token [b, k]."""
    final, decay = split.gather_global(final), split.gather_global(decay)
    first_id, last_id = split.gather_global(first_id), split.gather_global(last_id)
    keep = first_id[:, 1:] == last_id[:, :-1]  # [b, chunks-1]: one document across the boundary

    # A few chunks per context rank: a Python loop (no while loop to compile, forward and back).
    s_in = [jnp.zeros_like(final[:, 0])]
    for j in range(1, final.shape[1]):
        passed = decay[:, j - 1, :, None, None] * s_in[-1] + final[:, j - 1]
        s_in.append(jnp.where(keep[:, j - 1, None, None, None], passed, 0.0))
    return split.pick_mine(jnp.stack(s_in, axis=1))


def context_ssd_scan(scan: Callable, x, dt, A, B, C, D, segment_ids):
    """scan(x, dt, A, B, C, D, seg) -> (y, final_states) is the single-device SSD scan
    (pallas_kernels.ssd_scan with its chunk size and impl bound). Returns y [b, l, h, p] with
    the sequence split over `context`: the same values as one scan over the whole row."""
    split = _Split(x.shape[1], "SSD scan")
    heads, groups = ("batch", "length", "ssm_heads", None), ("batch", "length", "ssm_groups", None)
    specs = (split.spec(heads, x), split.spec(heads[:3], dt), split.spec(("ssm_heads",), A), split.spec(groups, B),
             split.spec(groups, C), split.spec(("ssm_heads",), D), split.spec(heads[:2], segment_ids))
    _length_split(specs[0], "SSD scan")

    def local(x, dt, A, B, C, D, seg):
        b, h, p = x.shape[0], x.shape[2], x.shape[3]
        g, n = B.shape[2:]
        k = split.per_rank
        xs, dts, bs, cs, ss = (split.stack(a) for a in (x, dt, B, C, seg))
        y0, final = scan(xs, dts, A, bs, cs, D, ss)  # every chunk from a zero state

        # Where a chunk's first document runs (no document start at or before t in it).
        starts = jnp.cumsum((ss[:, 1:] != ss[:, :-1]).astype(jnp.int32), axis=1)
        first_doc = jnp.concatenate([jnp.ones_like(ss[:, :1], bool), starts == 0], 1)  # [b*k, m]
        acum = jnp.cumsum(dts.astype(_F32) * A.astype(_F32), axis=1)  # [b*k, m, h]
        decay = jnp.where(first_doc[:, -1:], jnp.exp(acum[:, -1]), 0.0)  # a start inside: nothing passes
        s_in = _incoming_states(split, final.reshape(b, k, h, p, n), decay.reshape(b, k, h),
                                ss[:, 0].reshape(b, k), ss[:, -1].reshape(b, k))
        read = jnp.einsum("xmgn,xgjpn->xmgjp", cs.astype(_F32), s_in.reshape(b * k, g, h // g, p, n))
        weight = jnp.where(first_doc[..., None], jnp.exp(acum), 0.0)
        y = (y0.astype(_F32) + weight[..., None] * read.reshape(b * k, -1, h, p)).astype(y0.dtype)
        return split.unstack(y, b)

    args = [split.place(a, s) for a, s in zip((x, dt, A, B, C, D, segment_ids), specs)]
    return jax.shard_map(local, mesh=split.mesh, in_specs=specs, out_specs=specs[0], check_vma=False)(*args)
