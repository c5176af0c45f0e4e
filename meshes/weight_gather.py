"""How an FSDP-sharded float32 weight reaches the layer that computes with it.

Parameters live in float32, split over the data-parallel axes (FSDP/ZeRO-3, `rules=fsdp`), and
are cast to the compute dtype where they are used. A strategy object, chosen by the rule set
(`RuleSet.weight_gather`), decides where that cast happens relative to the all-gather and in
which dtype the weight gradient is reduced:

  CastWhereUsed    (dp, zero1, dp_sp: no weight gathered; overlay `+cast_where_used`) the cast at the use;
                   XLA's sharding propagation decides whether the convert runs before or after
                   the gather, and the weight gradient is reduced in the dtype its matmul
                   produced (bf16 for a bf16 model).
  CastThenGather   (fsdp, fsdp_sp; overlay `+gather_bf16`; FSDP2's mixed-precision policy): the weight
                   is cast on its sharded layout, then gathered (bf16 on the wire), and its
                   gradient leaves its matmul in float32 and is reduce-scattered in float32.
                   The dense contraction keeps the SHARDED bf16 copy for the backward and
                   gathers it again there (FSDP2's reshard after forward): no gathered weight
                   lives from a layer's forward to its backward. Under remat the recomputed
                   forward's gather and the backward's are one (XLA merges them: same operand).
  CastThenGatherHeld (overlay `+gather_bf16_held`, FSDP2's reshard_after_forward=False): as
                   CastThenGather, but the contraction keeps the gathered bf16 weight: one gather
                   per weight per step instead of two under remat `none`, at the price of every
                   layer's gathered weights held until the backward (a larger temp than
                   CastThenGather's under remat `none`).

Where weights are used: `contract` (a dense layer's matmul under SPMD: Dense, the LM head),
`lookup` (the embedding table), `gather_in_shard_map` (a weight entering a shard_map sharded,
e.g. routed experts in meshes/experts.py, where each device's gradient is still its own
unreduced contribution, so the bwd reduce-scatters it) and `cast_for_use` (MLA's up-projection,
gathered by the latent attention itself).

Read collective dtypes on the partitioned program (jaxtrain/observe/hlo_stats.py
`compile_with_partitioned_hlo`): XLA:CPU widens every bf16 collective to float32 afterwards.
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain.pallas_kernels import low_precision_dot

# The names FSDP splits over the data-parallel axes on top of tensor/expert parallelism: a weight
# is "gathered" when these dimensions are whole (meshes/rules.py `_FSDP_PARAMS`).
FSDP_GATHERED_NAMES = ("embed", "expert_embed", "q_lora", "kv_lora", "lora_rank")


def gathered_table(params: dict) -> dict:
    """The parameter table of a weight as a layer computes with it: FSDP's splits dropped."""
    return {k: v for k, v in params.items() if k not in FSDP_GATHERED_NAMES}


@dataclasses.dataclass(frozen=True)
class _KeepSharded:
    """The contraction's weight residual is the sharded bf16 copy; the backward gathers it again
    (FSDP2's reshard after forward): no gathered weight lives from a layer's forward to its backward."""

    def residual(self, ws, wb):
        return ws

    def gathered(self, residual, gathered):
        return _pin(residual, gathered)


@dataclasses.dataclass(frozen=True)
class _KeepGathered:
    """The residual is the gathered bf16 weight, as plain autodiff of the matmul keeps it."""

    def residual(self, ws, wb):
        return wb

    def gathered(self, residual, gathered):
        return residual


@dataclasses.dataclass(frozen=True)
class CastWhereUsed:
    """The cast at the use; XLA places it and the gradient's reduction (module docstring)."""
    name = "cast_where_used"
    casts_before_gather = False

    def contract(self, x, w, n_in: int, dtype, names, mesh, rules):
        return low_precision_dot.tensordot(x.astype(dtype), w.astype(dtype), n_in)

    def gather_in_shard_map(self, w, axes_per_dim, dtype):
        return _all_gather_dims(w, axes_per_dim).astype(dtype)

    def lookup(self, table, ids, dtype, names, mesh, rules):
        from jaxtrain.meshes.rules import constrain_param
        return jnp.take(constrain_param(table, (names[0], None)), ids, axis=0).astype(dtype)


@dataclasses.dataclass(frozen=True)
class CastThenGather:
    """Cast on the sharded layout, gather in the compute dtype; gradients reduced in float32.
    The backward gathers the sharded bf16 copy again (no gathered weight held across passes)."""
    name = "cast_then_gather"
    casts_before_gather = True
    keep = _KeepSharded()

    def contract(self, x, w, n_in: int, dtype, names, mesh, rules):
        if mesh is None or dtype is None or jnp.dtype(dtype) == w.dtype:
            return CastWhereUsed().contract(x, w, n_in, dtype, names, mesh, rules)
        from jaxtrain.meshes.rules import spec_for
        sharded = NamedSharding(mesh, spec_for(names, w.shape, rules.params, mesh))
        gathered = NamedSharding(mesh, spec_for(names, w.shape, gathered_table(rules.params), mesh))
        return _contract_cast_then_gather(x.astype(dtype), w, n_in, jnp.dtype(dtype), sharded, gathered, self.keep)

    def lookup(self, table, ids, dtype, names, mesh, rules):
        if mesh is None or dtype is None or jnp.dtype(dtype) == table.dtype:
            return CastWhereUsed().lookup(table, ids, dtype, names, mesh, rules)
        from jaxtrain.meshes.rules import spec_for
        sharded = NamedSharding(mesh, spec_for(names, table.shape, rules.params, mesh))
        rows_whole = NamedSharding(mesh, spec_for((names[0], None), table.shape, rules.params, mesh))
        return _lookup_cast_then_gather(table, ids, jnp.dtype(dtype), sharded, rows_whole)

    def gather_in_shard_map(self, w, axes_per_dim, dtype):
        if not any(axes_per_dim) or dtype is None or jnp.dtype(dtype) == w.dtype:
            # nothing to cast (a float32 model): gathered as where used (it returned the shard
            # ungathered, unseen while no float32 run took this path)
            return CastWhereUsed().gather_in_shard_map(w, axes_per_dim, dtype)
        return _gather_cast_first(w, tuple(axes_per_dim), jnp.dtype(dtype))


@dataclasses.dataclass(frozen=True)
class CastThenGatherHeld(CastThenGather):
    """As CastThenGather, but the dense contraction keeps the gathered bf16 weight for the backward."""
    name = "cast_then_gather_held"
    keep = _KeepGathered()


WEIGHT_GATHERS = {s.name: s for s in (CastWhereUsed(), CastThenGather(), CastThenGatherHeld())}


def cast_for_use(w, names: Sequence[str | None], dtype):
    """`w` in `dtype` for a consumer that gathers it itself (MLA's up-projection inside the latent
    attention): under CastThenGather the cast is pinned to the sharded layout, so XLA gathers the
    bf16 copy; the gradient comes back to float32 there. Its reduction happens where the
    consumer's backward produces it (in that consumer's dtype)."""
    from jaxtrain.meshes.rules import active_mesh, active_rules, spec_for
    rules, mesh = active_rules(), active_mesh()
    if (mesh is None or dtype is None or jnp.dtype(dtype) == w.dtype
            or not strategy(rules).casts_before_gather):
        return w.astype(dtype)
    return _cast_pinned(w, jnp.dtype(dtype), NamedSharding(mesh, spec_for(tuple(names), w.shape, rules.params, mesh)))


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _cast_pinned(w, dtype, sharded):
    return _pin(w.astype(dtype), sharded)


_cast_pinned.defvjp(lambda w, dtype, sharded: (_cast_pinned(w, dtype, sharded), None),
                    lambda dtype, sharded, _, g: (_pin(g.astype(jnp.float32), sharded),))


# ---- the matmul under SPMD -----------------------------------------------------------------

def _pin(v, sharding):
    return jax.lax.with_sharding_constraint(v, sharding)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _contract_cast_then_gather(x, w, n_in, dtype, sharded, gathered, keep):
    return _contract_fwd(x, w, n_in, dtype, sharded, gathered, keep)[0]


def _contract_fwd(x, w, n_in, dtype, sharded, gathered, keep):
    # Pinning the bf16 copy to the sharded layout first makes XLA convert before it gathers.
    ws = _pin(w.astype(dtype), sharded)
    wb = _pin(ws, gathered)
    return low_precision_dot.tensordot(x, wb, n_in), (x, keep.residual(ws, wb))


def _contract_bwd(n_in, dtype, sharded, gathered, keep, residuals, g):
    x, kept = residuals
    wb = keep.gathered(kept, gathered)
    g = g.astype(dtype)
    batch = tuple(range(x.ndim - n_in))
    # dx = g . w^T over w's output dims; dw = x^T . g over the batch dims, produced in float32
    # (bf16 operands) so the partial sums are reduce-scattered in float32.
    dx = low_precision_dot.dot_general(g, wb, ((tuple(range(len(batch), g.ndim)), tuple(range(n_in, wb.ndim))), ((), ())))
    dw = jax.lax.dot_general(x, g, ((batch, batch), ((), ())), preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), _pin(dw, sharded)


_contract_cast_then_gather.defvjp(_contract_fwd, _contract_bwd)


# ---- an embedding lookup under SPMD ----------------------------------------------------------

@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _lookup_cast_then_gather(table, ids, dtype, sharded, rows_whole):
    return jnp.take(_pin(_pin(table.astype(dtype), sharded), rows_whole), ids, axis=0)


def _lookup_fwd(table, ids, dtype, sharded, rows_whole):
    return _lookup_cast_then_gather(table, ids, dtype, sharded, rows_whole), (ids, table.shape)


def _lookup_bwd(dtype, sharded, rows_whole, residuals, g):
    ids, shape = residuals
    # rows summed into a float32 table (a bf16 scatter-add would round every token's addition)
    rows = jnp.zeros(shape, jnp.float32).at[ids.reshape(-1)].add(g.reshape(-1, shape[1]).astype(jnp.float32))
    return _pin(_pin(rows, rows_whole), sharded), None


_lookup_cast_then_gather.defvjp(_lookup_fwd, _lookup_bwd)


# ---- a weight gathered inside a shard_map --------------------------------------------------

def _all_gather_dims(w, axes_per_dim):
    for dim, axes in enumerate(axes_per_dim):
        if axes:
            w = jax.lax.all_gather(w, axes, axis=dim, tiled=True)
    return w


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_cast_first(w, axes_per_dim, dtype):
    return _all_gather_dims(w.astype(dtype), axes_per_dim)


def _gather_fwd(w, axes_per_dim, dtype):
    return _all_gather_dims(w.astype(dtype), axes_per_dim), None


def _gather_bwd(axes_per_dim, dtype, _, g):
    g = g.astype(jnp.float32)  # this device's own contribution: reduce it in float32
    for dim, axes in enumerate(axes_per_dim):
        if axes:
            g = jax.lax.psum_scatter(g, axes, scatter_dimension=dim, tiled=True)
    return (g,)


_gather_cast_first.defvjp(_gather_fwd, _gather_bwd)


def spec_axes(spec: PartitionSpec, ndim: int) -> tuple[tuple[str, ...], ...]:
    """Each dimension's mesh axes in a PartitionSpec, as tuples."""
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)


def gather_axes(stored: PartitionSpec, compute: PartitionSpec, ndim: int):
    """Per dimension, the axes a tiled all-gather must undo to turn the `stored` layout into the
    `compute` one, or None when it is not such a gather (compute's axes not a major prefix)."""
    out = []
    for have, want in zip(spec_axes(stored, ndim), spec_axes(compute, ndim)):
        if have[:len(want)] != want:
            return None
        out.append(have[len(want):])
    return tuple(out)


def strategy(rules) -> CastWhereUsed | CastThenGather:
    return WEIGHT_GATHERS[getattr(rules, "weight_gather", CastWhereUsed.name)] if rules is not None else CastWhereUsed()


def lookup(table, ids, dtype, names: Sequence[str | None]):
    """Rows `ids` of `table` in `dtype`, the table read whole along its second dim (Embed)."""
    from jaxtrain.meshes.rules import active_mesh, active_rules
    rules = active_rules()
    return strategy(rules).lookup(table, ids, dtype, tuple(names), active_mesh(), rules)


def contract(x, w, n_in: int, dtype, names: Sequence[str | None]):
    """tensordot(x, w) over w's first `n_in` dims in `dtype`, w gathered per the active rules."""
    from jaxtrain.meshes.rules import active_mesh, active_rules
    rules = active_rules()
    return strategy(rules).contract(x, w, n_in, dtype, tuple(names), active_mesh(), rules)
