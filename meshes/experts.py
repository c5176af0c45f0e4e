"""Expert parallelism: route, exchange tokens between expert shards, compute, return.

Runs inside `shard_map` over the whole mesh. Each device routes its own tokens, sends every
token-slot to the device that holds its expert (an all-to-all over the expert-parallel
axes), runs its local experts as one grouped matmul over expert-sorted rows, and sends the
results back. Which mesh axes the experts are split over comes from the rule table's
`experts` entry, so expert parallelism over `expert`, or experts folded over `data x context`
while attention uses `tensor x context x data`, is a table choice, not a code path:

  token axes  the axes the tokens are split over (the activation rules for batch, length);
              the expert-parallel (EP) axes must be among them
  EP axes     experts split over them (the `experts` parameter rule)
  ETP axis    each expert's hidden dimension split over it (`expert_mlp` rule): partial
              outputs are summed over it
  EDP axes    every other mesh axis: expert weights are replicated there, so each device takes
              its own slice of the (replicated) tokens and the outputs are gathered back

How routed slots reach their experts is a dispatch strategy, chosen by the router's
capacity factor (`dispatch_for`):

  DroplessDispatch  (no capacity) every slot is computed: slots sorted by expert, one grouped
                    matmul; the exchange (meshes/expert_exchange.py) never drops a token, so the
                    result does not depend on the layout: `ragged_all_to_all` on GPU, a padded
                    `all_to_all` with the same results elsewhere.
  CapacityDispatch  (meshes/expert_capacity.py) each expert takes at most ceil(cf x slots /
                    experts) slots of each device's tokens into a fixed buffer: a dense batched
                    matmul, a fixed-size all_to_all; cost proportional to cf.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain.meshes.expert_capacity import CapacityDispatch
from jaxtrain.meshes.expert_exchange import make_exchange
from jaxtrain.meshes.rules import RuleSet, spec_for
from jaxtrain.meshes.weight_gather import gather_axes, strategy

TOKEN_NAMES = ("batch", "length", None)


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    token_spec: PartitionSpec
    token_axes: tuple[str, ...]
    ep_axes: tuple[str, ...]
    etp_axes: tuple[str, ...]
    edp_axes: tuple[str, ...]
    ep_size: int
    edp_size: int

    def weight_spec(self, logical: tuple[str, ...]) -> PartitionSpec:
        place = {"experts": self.ep_axes, "expert_mlp": self.etp_axes}
        return PartitionSpec(*[(place.get(n) or None) if len(place.get(n) or ()) != 1 else place[n][0]
                               for n in logical])


def resolve_layout(mesh, rules: RuleSet, x_shape, num_experts: int, hidden: int) -> ExpertLayout:
    token_spec = spec_for(TOKEN_NAMES, x_shape, rules.activations, mesh)
    token_axes = _axes(token_spec[0]) + _axes(token_spec[1])
    ep_axes = _axes(spec_for(("experts",), (num_experts,), rules.params, mesh)[0])
    etp_axes = _axes(spec_for(("expert_mlp",), (hidden,), rules.params, mesh)[0])
    stray = [a for a in ep_axes if a not in token_axes]
    if stray:
        raise ValueError(f"experts are split over {ep_axes} but tokens only over {token_axes}: expert-parallel "
                         f"axes must be axes the tokens are split over (offending: {stray})")
    if set(etp_axes) & set(token_axes):
        raise ValueError(f"expert hidden dims are split over {etp_axes}, which also split the tokens {token_axes}")
    # `pipeline` is never EDP: pipeline stages vmap over it (meshes/pipeline.py), so its devices hold
    # different layers' tokens, not copies of the same ones.
    edp_axes = tuple(a for a in mesh.axis_names
                     if mesh.shape[a] > 1 and a != "pipeline" and a not in token_axes + ep_axes + etp_axes)
    return ExpertLayout(token_spec, token_axes, ep_axes, etp_axes, edp_axes,
                        ep_size=math.prod(mesh.shape[a] for a in ep_axes),
                        edp_size=math.prod(mesh.shape[a] for a in edp_axes))


# ---- one device's work --------------------------------------------------------------------

def _count(ids, n: int):
    """Occurrences of 0..n-1 in ids (other values ignored)."""
    return jax.ops.segment_sum(jnp.ones(ids.shape, jnp.int32), ids, num_segments=n + 1)[:n]


def _exchange_compute_combine(x, expert_ids, weights, expert_weights, ffn, layout: ExpertLayout | None,
                              num_experts: int, exchange, order=None):
    """x [t, d]; expert_ids [t, k] (num_experts = dropped); weights [t, k] -> [t, d]. `order`:
    the token-slots (t * k + j) stably sorted by expert, if the router already computed it."""
    t, k = expert_ids.shape
    slots = t * k
    flat_ids = expert_ids.reshape(slots)
    if order is None:
        order = jnp.argsort(flat_ids, stable=True)
    sorted_ids = flat_ids[order]
    tokens = x[order // k]
    ep = layout.ep_size if layout else 1
    if ep == 1:
        out = ffn(tokens, _count(sorted_ids, num_experts), expert_weights)
    else:
        local = num_experts // ep
        dest = jnp.where(sorted_ids < num_experts, sorted_ids // local, ep)  # ep = nowhere (dropped)
        recv, recv_ids, handle = exchange.send(tokens, sorted_ids - dest * local, dest, _count(dest, ep), local)
        order2 = jnp.argsort(recv_ids, stable=True)
        computed = ffn(recv[order2], _count(recv_ids, local), expert_weights)
        out = exchange.back(jnp.zeros_like(computed).at[order2].set(computed), handle)
    per_slot = jnp.zeros((slots,) + out.shape[1:], out.dtype).at[order].set(out).reshape((t, k) + out.shape[1:])
    return jnp.einsum("tkd,tk->td", per_slot, weights.astype(per_slot.dtype)).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class DroplessDispatch:
    """Every routed slot is computed: slots sorted by expert, one grouped matmul."""

    def __call__(self, x, expert_ids, weights, order, expert_weights, *, ffn, batched_ffn, layout, num_experts: int,
                 exchange):
        del batched_ffn  # the capacity dispatch's fixed-buffer compute
        y = _exchange_compute_combine(x, expert_ids, weights, expert_weights, ffn, layout, num_experts, exchange, order)
        return y, jnp.zeros((), jnp.float32)


def dispatch_for(capacity_factor: float | None):
    """The router config's choice: dropless without a capacity factor, else the capacity buffer."""
    return DroplessDispatch() if capacity_factor is None else CapacityDispatch(capacity_factor)


def _device_moe(x, logits, bias, expert_weights, *, route: Callable, ffn: Callable, batched_ffn: Callable | None,
                layout: ExpertLayout | None, num_experts: int, dispatch, exchange=None):
    lead = x.shape[:-1]
    x2, lg = x.reshape(-1, x.shape[-1]), logits.reshape(-1, logits.shape[-1])
    t = x2.shape[0]
    edp = layout.edp_size if layout else 1
    split = edp > 1 and t % edp == 0  # otherwise every EDP device computes all tokens (same result)
    if split:
        share = t // edp
        start = jax.lax.axis_index(layout.edp_axes) * share
        x2, lg = jax.lax.dynamic_slice_in_dim(x2, start, share), jax.lax.dynamic_slice_in_dim(lg, start, share)
    expert_ids, weights, scores, order = route(lg, bias)
    stats = {"expert_load": _count(expert_ids.reshape(-1), num_experts).astype(jnp.float32),
             "score_sum": scores.sum(0),
             "z_sum": jnp.square(jax.nn.logsumexp(lg, axis=-1)).sum(),
             "entropy_sum": _entropy(scores).sum(),
             "tokens": jnp.asarray(lg.shape[0], jnp.float32)}
    y, stats["dropped"] = dispatch(x2, expert_ids, weights, order, expert_weights, ffn=ffn, batched_ffn=batched_ffn,
                                   layout=layout, num_experts=num_experts, exchange=exchange)
    if layout is not None:
        if layout.etp_axes:
            y = jax.lax.psum(y, layout.etp_axes)
        if split:  # gather the EDP shares back; a psum of placed shares keeps y replicated-typed
            y = jax.lax.psum(jax.lax.dynamic_update_slice_in_dim(jnp.zeros((t,) + y.shape[1:], y.dtype), y, start, 0), layout.edp_axes)
        summed = layout.token_axes + (layout.edp_axes if split else ())
        if summed:
            stats = jax.lax.psum(stats, summed)
    return y.reshape(lead + (y.shape[-1],)), stats


def _entropy(scores):
    p = scores / jnp.maximum(scores.sum(-1, keepdims=True), 1e-9)
    return -(p * jnp.log(jnp.maximum(p, 1e-9))).sum(-1)


def _platform(mesh) -> str:
    abstract_device = getattr(mesh, "abstract_device", None)  # an AbstractMesh, when cross-lowering
    return abstract_device.platform if abstract_device is not None else mesh.devices.flat[0].platform


def moe_forward(x, logits, bias, expert_weights: dict, weight_axes: dict, *, route: Callable, ffn: Callable,
                num_experts: int, hidden: int, batched_ffn: Callable | None = None, dispatch=None, mesh=None,
                rules=None, exchange: str = "auto", weight_dtype=None):
    """x [b, l, d], router logits [b, l, e] -> (y [b, l, d], summed routing statistics).

    `route(logits [t, e], bias) -> (expert_ids [t, k], weights [t, k], scores [t, e], slots
    sorted by expert [t * k] or None)` and
    `ffn(sorted_tokens [n, d], group_sizes [e_local], weights) -> [n, d]` come from the model, and
    for the capacity dispatch `batched_ffn(buffer [e_local, n, d], weights) -> [e_local, n, d]`.
    `dispatch`: `dispatch_for(capacity_factor)` (default dropless). Without a mesh (or outside
    `use_rules`) everything runs on one device. `exchange`: auto | padded | ragged
    (meshes/expert_exchange.py; the dropless dispatch's). `weight_dtype`: the experts' compute
    dtype, for the rule set's weight gather (meshes/weight_gather.py).
    """
    kw = dict(route=route, ffn=ffn, batched_ffn=batched_ffn, num_experts=num_experts,
              dispatch=dispatch if dispatch is not None else DroplessDispatch())
    if mesh is None:
        return _device_moe(x, logits, bias, expert_weights, layout=None, **kw)
    layout = resolve_layout(mesh, rules, x.shape, num_experts, hidden)
    if num_experts % layout.ep_size:
        raise ValueError(f"{num_experts} experts do not split over the expert-parallel axes "
                         f"{layout.ep_axes} of size {layout.ep_size}")
    w_specs = {n: layout.weight_spec(weight_axes[n]) for n in expert_weights}
    place = lambda v, spec: jax.lax.with_sharding_constraint(v, NamedSharding(mesh, spec))
    gathers = _in_body_gathers(expert_weights, weight_axes, w_specs, mesh, rules, weight_dtype)
    if gathers is None:
        # Bring FSDP-sharded weights to their compute layout (XLA all-gathers them here).
        expert_weights = {n: place(w, w_specs[n]) for n, w in expert_weights.items()}
    else:  # they enter sharded; the body gathers them (cast first, float32 gradient reduction)
        w_specs = {n: stored for n, (stored, _) in gathers.items()}
        expert_weights = {n: place(w, w_specs[n]) for n, w in expert_weights.items()}
    x, logits = place(x, layout.token_spec), place(logits, layout.token_spec)
    bias_spec = PartitionSpec()
    if bias is None:
        bias = jnp.zeros((num_experts,), jnp.float32)
    kw["exchange"] = make_exchange(exchange, layout.ep_axes, layout.ep_size, _platform(mesh))
    def body(xs, lg, b, ws):
        if gathers is not None:
            how = strategy(rules)
            ws = {n: how.gather_in_shard_map(w, gathers[n][1], weight_dtype) for n, w in ws.items()}
        return _device_moe(xs, lg, b, ws, layout=layout, **kw)

    # check_vma=False: the Pallas kernels inside (routing, grouped matmul) carry no varying-axes
    # annotation; the layout-equivalence tests check the gradients.
    return jax.shard_map(body, mesh=mesh, in_specs=(layout.token_spec, layout.token_spec, bias_spec, w_specs),
                         out_specs=(layout.token_spec, PartitionSpec()), check_vma=False)(x, logits, place(bias, bias_spec),
                                                                           expert_weights)


def _in_body_gathers(expert_weights, weight_axes, w_specs, mesh, rules, weight_dtype):
    """{name: (stored spec, axes each dim gathers)} when the rule set gathers weights inside
    the body (meshes/weight_gather.py CastThenGather) and every weight's stored layout gathers
    to its compute layout; else None (XLA gathers them at the shard_map's edge)."""
    if not strategy(rules).casts_before_gather or weight_dtype is None:
        return None
    out = {}
    for n, w in expert_weights.items():
        stored = spec_for(weight_axes[n], w.shape, rules.params, mesh)
        axes = gather_axes(stored, w_specs[n], w.ndim)
        if axes is None:
            return None
        out[n] = (stored, axes)
    return out
