"""MoE router: scores -> (group-limited) top-k -> weights and a dispatch plan.

  scores    = softmax(logits) or sigmoid(logits)                 (f32)
  selection = scores + correction_bias (bias picks experts only; DeepSeek-V3)
  groups    : experts split into n_group contiguous groups; keep the best
              topk_group groups by group score = max selection score (softmax)
              or sum of the top-2 selection scores (sigmoid); other experts
              are excluded (-inf, as DeepSeek's reference code does)
  expert_ids: top_k of selection; ties go to the LOWER expert (and group) index
  weights   = scores[expert_ids] (/ (sum + 1e-20) if norm_topk_prob)
              * routed_scaling_factor
Dispatch plan: token-slot s = token * top_k + j; `sort_order` lists slots
stably sorted by expert, `inverse_order[s]` is where slot s lands,
`group_sizes[e]` counts slots per expert.

Pallas/Triton: kernel 1 fuses scores, group limiting, top-k, weights and a
per-tile expert histogram; kernel 2 is a counting sort (rank of each slot
among earlier same-expert slots + per-tile expert offsets from an XLA cumsum
over the tiny histogram) that scatters `sort_order` directly, so no general
sort runs. Gradients reach logits through the weights only; the backward
recomputes the weights from the saved ids in XLA (one small elementwise op on
[tokens, experts], as fast as a kernel would be).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jaxtrain.pallas_kernels import _common

_NAME = "route"
_F32 = jnp.float32
SCORE_FNS = ("softmax", "sigmoid")


class RoutingPlan(NamedTuple):
    expert_ids: jax.Array  # [t, k] int32
    weights: jax.Array  # [t, k] f32
    sort_order: jax.Array  # [t*k] int32 slots sorted (stably) by expert
    group_sizes: jax.Array  # [e] int32 slots per expert
    inverse_order: jax.Array  # [t*k] int32, sort_order[inverse_order[s]] == s


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Static routing options (hashable: a custom_vjp nondiff argument)."""

    top_k: int
    score_fn: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    has_bias: bool
    block_t: int = 0
    num_warps: int = 4
    interpret: bool = False


# ----------------------------------------------------------------------------
# Reference (XLA).


def _scores(logits, score_fn):
    x = logits.astype(_F32)
    return jax.nn.softmax(x, axis=-1) if score_fn == "softmax" else (jax.nn.sigmoid(x))


def _weights_from_ids(logits, expert_ids, spec):
    w = jnp.take_along_axis(_scores(logits, spec.score_fn), expert_ids, axis=1)
    if spec.norm_topk_prob:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return w * spec.routed_scaling_factor


def dispatch_plan(expert_ids, num_experts):
    """(sort_order, group_sizes, inverse_order) for [t, k] ids, in XLA."""
    flat = expert_ids.reshape(-1)
    sort_order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    inverse = jnp.zeros_like(sort_order).at[sort_order].set(jnp.arange(flat.shape[0], dtype=jnp.int32))
    return sort_order, group_sizes, inverse


def _route_reference(logits, bias, spec):
    t, e = logits.shape
    sel = _scores(logits, spec.score_fn)
    if spec.has_bias:
        sel = sel + bias.astype(_F32)
    sel = jax.lax.stop_gradient(sel)
    if spec.n_group > 1:
        per = sel.reshape(t, spec.n_group, e // spec.n_group)
        if spec.score_fn == "sigmoid":
            group_score = jax.lax.top_k(per, min(2, per.shape[-1]))[0].sum(-1)
        else:
            group_score = per.max(-1)
        _, best = jax.lax.top_k(group_score, spec.topk_group)  # ties: lower index
        keep = jax.nn.one_hot(best, spec.n_group, dtype=jnp.int32).sum(1) > 0
        keep = jnp.repeat(keep, e // spec.n_group, axis=1)
        sel = jnp.where(keep, sel, -jnp.inf)
    _, ids = jax.lax.top_k(sel, spec.top_k)  # ties: lower index first
    ids = ids.astype(jnp.int32)
    weights = _weights_from_ids(logits, ids, spec)
    return RoutingPlan(ids, weights, *dispatch_plan(ids, e))


# ----------------------------------------------------------------------------
# Kernels.


def _first_max(v, cols, sentinel):
    """Per row: (max value, lowest column holding it)."""
    m = jnp.max(v, axis=1)
    idx = jnp.min(jnp.where(v == m[:, None], cols[None, :], sentinel), axis=1)
    return m, idx


def _route_kernel(logits_ref, bias_ref, ids_ref, w_ref, hist_ref, *, t, e, spec):
    bt, e2 = spec.block_t, _common.pl_next_pow2(e)
    k2 = _common.pl_next_pow2(spec.top_k)
    tile = pl.program_id(0)
    rows = tile * bt + jnp.arange(bt, dtype=jnp.int32)
    cols = jnp.arange(e2, dtype=jnp.int32)
    row_in, col_in = rows < t, cols < e
    x = pl_triton.load(
        logits_ref.at[pl.ds(tile * bt, bt), pl.ds(0, e2)], mask=row_in[:, None] & col_in[None, :], other=0
    )
    x = jnp.where(col_in[None, :], x.astype(_F32), -jnp.inf)
    if spec.score_fn == "softmax":
        ex = jnp.exp(x - jnp.max(x, axis=1)[:, None])
        scores = ex / jnp.sum(ex, axis=1)[:, None]
    else:
        scores = 1.0 / (1.0 + jnp.exp(-x))
    sel = scores
    if spec.has_bias:
        bias = pl_triton.load(bias_ref.at[pl.ds(0, e2)], mask=col_in, other=0)
        sel = sel + bias.astype(_F32)[None, :]
    sel = jnp.where(col_in[None, :], sel, -jnp.inf)

    if spec.n_group > 1:
        per = e // spec.n_group
        group_of = cols // per
        group_score = jnp.full((bt, e2), -jnp.inf, _F32)
        for g in range(spec.n_group):  # static: groups are few
            in_g = (group_of == g)[None, :]
            v = jnp.where(in_g, sel, -jnp.inf)
            best, at = _first_max(v, cols, e2)
            if spec.score_fn == "sigmoid" and per > 1:  # top-2 sum
                best = best + jnp.max(jnp.where(cols[None, :] == at[:, None], -jnp.inf, v), axis=1)
            group_score = jnp.where(in_g, best[:, None], group_score)
        keep = jnp.zeros((bt, e2), jnp.bool_)
        for _ in range(spec.topk_group):
            _, at = _first_max(group_score, cols, e2)  # lowest expert -> lowest group
            chosen = group_of[None, :] == (at // per)[:, None]
            keep = keep | chosen
            group_score = jnp.where(chosen, -jnp.inf, group_score)
        sel = jnp.where(keep, sel, -jnp.inf)

    ids, weights = [], []
    for _ in range(spec.top_k):
        _, at = _first_max(sel, cols, e2)
        hit = cols[None, :] == at[:, None]
        ids.append(at)
        weights.append(jnp.sum(jnp.where(hit, scores, 0.0), axis=1))
        sel = jnp.where(hit, -jnp.inf, sel)
    if spec.norm_topk_prob:
        total = sum(weights) + 1e-20
        weights = [w / total for w in weights]
    kcols = jnp.arange(k2, dtype=jnp.int32)[None, :]
    ids_tile = jnp.zeros((bt, k2), jnp.int32)
    w_tile = jnp.zeros((bt, k2), _F32)
    hist = jnp.zeros((e2,), jnp.int32)
    for j in range(spec.top_k):
        ids_tile = jnp.where(kcols == j, ids[j][:, None], ids_tile)
        w_tile = jnp.where(kcols == j, weights[j][:, None], w_tile)
        hit = (cols[None, :] == ids[j][:, None]) & row_in[:, None]
        hist = hist + jnp.sum(hit.astype(jnp.int32), axis=0)
    out_mask = row_in[:, None] & (kcols < spec.top_k)
    pl_triton.store(ids_ref.at[pl.ds(tile * bt, bt), pl.ds(0, k2)], ids_tile, mask=out_mask)
    pl_triton.store(w_ref.at[pl.ds(tile * bt, bt), pl.ds(0, k2)], w_tile * spec.routed_scaling_factor, mask=out_mask)
    hist_ref.at[tile][...] = hist


def _dispatch_kernel(ids_ref, base_ref, inv_ref, sort_ref, *, t, e, spec):
    """Counting sort: slot (r, j) -> base[tile, ex] + earlier slots of ex."""
    bt, e2 = spec.block_t, _common.pl_next_pow2(e)
    k, k2 = spec.top_k, _common.pl_next_pow2(spec.top_k)
    tile = pl.program_id(0)
    rows = tile * bt + jnp.arange(bt, dtype=jnp.int32)
    cols = jnp.arange(e2, dtype=jnp.int32)
    kcols = jnp.arange(k2, dtype=jnp.int32)
    row_in = rows < t
    ids_tile = pl_triton.load(
        ids_ref.at[pl.ds(tile * bt, bt), pl.ds(0, k2)], mask=row_in[:, None] & (kcols < k)[None, :], other=e2
    )  # e2 matches no expert
    ids = [jnp.sum(jnp.where(kcols[None, :] == j, ids_tile, 0), axis=1) for j in range(k)]
    per_row = sum((cols[None, :] == i[:, None]).astype(jnp.int32) for i in ids)
    earlier_rows = jnp.cumsum(per_row, axis=0) - per_row  # exclusive, [bt, e2]
    start = base_ref.at[tile][...][None, :] + earlier_rows
    pos_tile = jnp.zeros((bt, k2), jnp.int32)
    for j in range(k):
        same_before = sum((ids[jj] == ids[j]).astype(jnp.int32) for jj in range(j))
        pos = jnp.sum(jnp.where(cols[None, :] == ids[j][:, None], start, 0), axis=1) + same_before
        pos_tile = jnp.where(kcols[None, :] == j, pos[:, None], pos_tile)
    live = row_in[:, None] & (kcols < k)[None, :]
    pl_triton.store(inv_ref.at[pl.ds(tile * bt, bt), pl.ds(0, k2)], pos_tile, mask=live)
    slots = rows[:, None] * k + kcols[None, :]
    # Dead lanes target a private tail slot, so no index ever repeats (the CPU
    # interpreter writes masked lanes back in place).
    dead = t * k + rows[:, None] * k2 + kcols[None, :]
    pl_triton.store(sort_ref.at[jnp.where(live, pos_tile, dead)], slots, mask=live)


def _route_kernels(logits, bias, spec):
    t, e = logits.shape
    e2 = _common.pl_next_pow2(e)
    bt = spec.block_t
    tiles = pl.cdiv(t, bt)
    params = _common.triton_params(spec.num_warps, 1)
    ids, weights, hist = pl.pallas_call(
        functools.partial(_route_kernel, t=t, e=e, spec=spec),
        out_shape=(
            jax.ShapeDtypeStruct((t, spec.top_k), jnp.int32),
            jax.ShapeDtypeStruct((t, spec.top_k), _F32),
            jax.ShapeDtypeStruct((tiles, e2), jnp.int32),
        ),
        grid=(tiles,),
        compiler_params=params,
        interpret=spec.interpret,
        name="moe_route",
    )(logits, bias)
    group_sizes = jnp.sum(hist, axis=0)
    # base[tile, ex] = slots of experts < ex + slots of ex in earlier tiles.
    expert_start = jnp.cumsum(group_sizes) - group_sizes
    base = expert_start[None, :] + jnp.cumsum(hist, axis=0) - hist
    k2 = _common.pl_next_pow2(spec.top_k)
    inverse, sort_order = pl.pallas_call(
        functools.partial(_dispatch_kernel, t=t, e=e, spec=spec),
        out_shape=(
            jax.ShapeDtypeStruct((t, spec.top_k), jnp.int32),
            jax.ShapeDtypeStruct((t * spec.top_k + tiles * bt * k2,), jnp.int32),
        ),
        grid=(tiles,),
        compiler_params=params,
        interpret=spec.interpret,
        name="moe_dispatch",
    )(ids, base.astype(jnp.int32))
    return RoutingPlan(ids, weights, sort_order[: t * spec.top_k], group_sizes[:e], inverse.reshape(-1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _route_pallas(logits, bias, spec):
    return _route_kernels(logits, bias, spec)


def _route_pallas_fwd(logits, bias, spec):
    plan = _route_kernels(logits, bias, spec)
    return plan, (logits, plan.expert_ids)


def _route_pallas_bwd(spec, res, cot):
    logits, ids = res
    _, vjp = jax.vjp(lambda lg: _weights_from_ids(lg, ids, spec), logits)
    (dlogits,) = vjp(cot.weights)
    return dlogits.astype(logits.dtype), None  # bias only selects: no grad


_route_pallas.defvjp(_route_pallas_fwd, _route_pallas_bwd)


# ----------------------------------------------------------------------------
# Public API.


def route(
    logits,
    *,
    top_k: int,
    score_fn: str = "softmax",
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool,
    routed_scaling_factor: float = 1.0,
    correction_bias=None,
    impl: str = "auto",
    block_t: int | None = None,
) -> RoutingPlan:
    """Routes [tokens, experts] logits; see the module docstring.

    impl: "auto" (Pallas on GPU, XLA elsewhere) | "pallas" | "xla".
    """
    use_pallas, interpret = _common.resolve_impl(impl, _NAME)
    logits = jnp.asarray(logits)
    if logits.ndim != 2:
        raise ValueError(f"{_NAME}: logits must be [tokens, experts], got shape " f"{logits.shape}")
    t, e = logits.shape
    if score_fn not in SCORE_FNS:
        raise ValueError(f"{_NAME}: score_fn must be one of {SCORE_FNS}, got " f"{score_fn!r}")
    if n_group < 1 or e % n_group:
        raise ValueError(f"{_NAME}: n_group={n_group} must divide experts={e}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"{_NAME}: topk_group={topk_group} must be in " f"[1, n_group={n_group}]")
    if not 1 <= top_k <= topk_group * (e // n_group):
        raise ValueError(
            f"{_NAME}: top_k={top_k} must be in [1, experts in the " f"kept groups = {topk_group * (e // n_group)}]"
        )
    if correction_bias is not None:
        correction_bias = jnp.asarray(correction_bias)
        if correction_bias.shape != (e,):
            raise ValueError(f"{_NAME}: correction_bias must be [experts={e}], got " f"shape {correction_bias.shape}")
    spec = _Spec(
        top_k=int(top_k),
        score_fn=score_fn,
        n_group=int(n_group),
        topk_group=int(topk_group),
        norm_topk_prob=bool(norm_topk_prob),
        routed_scaling_factor=float(routed_scaling_factor),
        has_bias=correction_bias is not None,
    )
    bias = jnp.zeros((e,), _F32) if correction_bias is None else correction_bias.astype(_F32)
    if not use_pallas:
        return _route_reference(logits, bias, spec)
    e2 = _common.pl_next_pow2(e)
    # ~4K scores per program (32 f32 registers per thread and tile at 4 warps):
    # the few live [tokens, experts] tiles stay in registers.
    default_bt = min(256, max(16, 4096 // e2))
    bt = _common.check_block(_NAME, "block_t", block_t or default_bt)
    spec = dataclasses.replace(spec, block_t=_common.fit_block(t, bt, 16), interpret=interpret)
    return _route_pallas(logits, bias, spec)
