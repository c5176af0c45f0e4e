"""The capacity-factor MoE dispatch (meshes/expert_capacity.py): equal to a float64 per-slot loop
in values, gradients and drops, on one device and expert-parallel layouts; equal to the dropless
dispatch when nothing drops (a block, and a tiny DeepSeek's loss and gradients); compute and memory grow
with the capacity factor and stay below the dropless path's at cf = 1."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from helpers import assert_finite, assert_trees_close, random_packed_batch
from jaxtrain.training.step import AccumulatedGradients, loss_tokens, training_loss
from jaxtrain.meshes.expert_capacity import CapacityDispatch
from jaxtrain.meshes.experts import dispatch_for, moe_forward
from jaxtrain.meshes.mesh import AXES, MeshConfig, build_mesh
from jaxtrain.meshes.rules import get_rule_set, use_rules
from jaxtrain.models.layers.expert_ffn import WEIGHT_AXES, GatedExperts, PlainExperts
from jaxtrain.models.layers.moe import make_route_fn
from jaxtrain.models.layers.router import RouterConfig

pytestmark = [pytest.mark.slow]

E, K, D, H = 8, 2, 12, 16


def slot_loop_reference(x, logits, p, groups, cf, cot):
    """float64. Softmax top-K routing (weights = the chosen probabilities); within each device's
    token group, slots in priority order (all first choices in token order, then all second
    choices) keep their place while their expert has fewer than ceil(cf * slots / E) slots.
    Returns y, the gradients of sum(y * cot) for x, logits and the expert weights, and the
    number of dropped slots."""
    x, logits, cot = (np.asarray(a, np.float64) for a in (x, logits, cot))
    p = {n: np.asarray(v, np.float64) for n, v in p.items()}
    prob = np.exp(logits - logits.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    ids = np.argsort(-prob, axis=-1, kind="stable")[:, :K]
    kept, dropped = [], 0
    for group in groups:
        capacity, taken = math.ceil(cf * len(group) * K / E), np.zeros(E, int)
        for j in range(K):
            for t in group:
                e = ids[t, j]
                if taken[e] < capacity:
                    taken[e] += 1
                    kept.append((t, j, e))
                else:
                    dropped += 1
    y, dx, dprob = np.zeros_like(x), np.zeros_like(x), np.zeros_like(prob)
    dp = {n: np.zeros_like(v) for n, v in p.items()}
    for t, j, e in kept:
        g, u = x[t] @ p["gate"][e], x[t] @ p["up"][e]
        s = 1 / (1 + np.exp(-g))
        a = g * s
        h = a * u
        o = h @ p["down"][e]
        w = prob[t, e]
        y[t] += w * o
        dprob[t, e] += cot[t] @ o
        do = w * cot[t]
        dp["down"][e] += np.outer(h, do)
        dh = p["down"][e] @ do
        dg, du = dh * u * (s + g * s * (1 - s)), dh * a
        dp["gate"][e] += np.outer(x[t], dg)
        dp["up"][e] += np.outer(x[t], du)
        dx[t] += p["gate"][e] @ dg + p["up"][e] @ du
    dlogits = prob * (dprob - (prob * dprob).sum(-1, keepdims=True))
    return y, dx, dlogits, dp, dropped


def device_groups(batch, length, row_blocks, length_blocks, edp):
    """Each device's tokens (flat indices into [batch * length]) in its own order: a block of rows
    x a block of positions, row-major, split in `edp` contiguous shares."""
    index = np.arange(batch * length).reshape(batch, length)
    return [share for rows in np.split(index, row_blocks, 0) for block in np.split(rows, length_blocks, 1)
            for share in np.split(block.reshape(-1), edp)]


def experts(gated=True):
    return (GatedExperts if gated else PlainExperts)(E, D, H, rngs=nnx.Rngs(params=jax.random.key(7)), init_std=0.3)


def moe_loss(module, dispatch, mesh=None, rules=None, score_fn="softmax"):
    """sum(y * cot) of the MoE dispatch and its statistics, as a function of (x, logits, weights, cot)."""
    cfg = RouterConfig(num_experts=E, top_k=K, score_fn=score_fn)

    def loss(x, logits, w, cot):
        y, stats = moe_forward(x, logits, None, w, WEIGHT_AXES, route=make_route_fn(cfg, "xla"),
                               ffn=lambda t, s, ws: module.compute(t, s, ws, "xla"),
                               batched_ffn=module.compute_batched, dispatch=dispatch, num_experts=E, hidden=H,
                               mesh=mesh, rules=rules)
        return jnp.sum(y * cot), (y, stats)
    return loss


def values_and_grads(module, dispatch, args, mesh=None, rules=None, score_fn="softmax"):
    fn = jax.value_and_grad(moe_loss(module, dispatch, mesh, rules, score_fn), argnums=(0, 1, 2), has_aux=True)
    if mesh is None:
        return jax.jit(fn)(*args)
    with use_rules(mesh, rules):
        return jax.jit(fn)(*args)


LAYOUTS = {  # mesh, rules, (row blocks, length blocks, EDP shares) of the tokens
    "one_device": (None, None, (1, 1, 1)),
    "expert4": (MeshConfig(data=4, expert=4), "fsdp", (16, 1, 1)),  # EP 4, batch over data x expert
    "folded_edp": (MeshConfig(data=2, context=2, tensor=4), "fsdp+experts_folded", (2, 2, 4)),  # EP 4, EDP 4
    "expert_tp": (MeshConfig(data=4, expert=2, tensor=2), "dp+expert_tp", (8, 1, 1)),  # EP 2, ETP 2
}


# 4.0 = E / K: capacity = tokens, nothing can drop. 1.3: cf * t * K / E is not an integer (t = 16,
# 16, 32 tokens per device: 5.2, 5.2, 10.4 slots), and some expert's queue reaches the 6th / 11th
# slot, so rounding up rather than down decides whether it is kept. (On one device, 83.2 slots,
# no expert's load reaches 84 with this seed: that case would not see the rounding.)
CASES = [(layout, cf) for layout in sorted(LAYOUTS) for cf in (0.5, 1.0, 4.0)] + [
    (layout, 1.3) for layout in ("expert4", "expert_tp", "folded_edp")]


@pytest.mark.parametrize("layout, cf", CASES)
def test_capacity_dispatch_equals_the_float64_slot_loop(layout, cf):
    mesh_cfg, rules, blocks = LAYOUTS[layout]
    rng = np.random.default_rng(31)
    b, l = 16, 16
    x = rng.normal(size=(b, l, D)).astype(np.float32)
    logits = rng.normal(size=(b, l, E)).astype(np.float32)
    cot = rng.normal(size=(b, l, D)).astype(np.float32)
    module = experts()
    mesh = build_mesh(mesh_cfg) if mesh_cfg else None
    (_, (y, stats)), (dx, dlogits, dw) = values_and_grads(
        module, CapacityDispatch(cf), (x, logits, module.weights(), cot), mesh, get_rule_set(rules) if rules else None)
    assert_finite((y, dx, dlogits, dw, stats), "capacity dispatch")
    ref_y, ref_dx, ref_dlogits, ref_dw, ref_dropped = slot_loop_reference(
        x.reshape(-1, D), logits.reshape(-1, E), module.weights(), device_groups(b, l, *blocks), cf, cot.reshape(-1, D))
    if cf in (0.5, 4.0):  # the cases cover drops and none (at 1.0 and 1.3 the uneven load drops some)
        assert (ref_dropped > 0) == (cf < 1.0), ref_dropped
    assert float(stats["dropped"]) == ref_dropped
    np.testing.assert_array_equal(np.asarray(stats["expert_load"]),  # routed load, before drops
                                  np.bincount(np.argsort(-logits.reshape(-1, E), -1)[:, :K].ravel(), minlength=E))
    close = dict(rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, D), ref_y, **close)
    np.testing.assert_allclose(np.asarray(dx).reshape(-1, D), ref_dx, **close)
    np.testing.assert_allclose(np.asarray(dlogits).reshape(-1, E), ref_dlogits, **close)
    for name in ref_dw:
        np.testing.assert_allclose(np.asarray(dw[name]), ref_dw[name], err_msg=name, **close)


@pytest.mark.parametrize("gated", [True, False])
def test_without_drops_capacity_equals_dropless(gated):
    """cf = E / K: every expert has room for every token, so the fixed buffer computes exactly
    the dropless dispatch's slots (both expert kinds' batched compute)."""
    rng = np.random.default_rng(32)
    args = [rng.normal(size=s).astype(np.float32) for s in ((4, 8, D), (4, 8, E))]
    module = experts(gated)
    args = (*args, module.weights(), rng.normal(size=(4, 8, D)).astype(np.float32))
    score_fn = "softmax" if gated else "sigmoid"
    (_, (y, s)), grads = values_and_grads(module, CapacityDispatch(E / K), args, score_fn=score_fn)
    (_, (y_ref, s_ref)), grads_ref = values_and_grads(module, dispatch_for(None), args, score_fn=score_fn)
    assert_finite((y, grads), "capacity dispatch")
    assert float(s["dropped"]) == 0
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-6)
    assert_trees_close(jax.device_get(grads), jax.device_get(grads_ref), rtol=1e-5, atol=1e-6)


def deepseek_loss_and_grads(graphdef, params, batch):
    """The train step's loss (cross-entropy + MoE aux losses) and its gradients, one device."""
    gradients = AccumulatedGradients(graphdef, microbatches=1, loss_chunk=16, z_loss=0.0)
    tokens = loss_tokens(batch["loss_mask"].sum())
    grads, sums, aux = jax.jit(gradients)(params, batch, tokens)
    return training_loss(sums, aux, tokens, 1), nnx.to_pure_dict(grads), aux["moe_blocks"]["moe"]


def test_tiny_deepseek_without_drops_equals_dropless():
    from test_deepseek import TINY_DEEPSEEK
    dropless = dataclasses.replace(TINY_DEEPSEEK, layers=2)  # a dense block and a MoE block
    router = dropless.router
    roomy = dataclasses.replace(dropless, router=dataclasses.replace(
        router, capacity_factor=router.num_experts / router.top_k))  # capacity = tokens
    graphdef, params = nnx.split(dropless.build(nnx.Rngs(params=jax.random.key(0))))
    roomy_graphdef, _ = nnx.split(nnx.eval_shape(lambda: roomy.build(nnx.Rngs(params=jax.random.key(0)))))
    batch = random_packed_batch(5, 4, 16, dropless.vocab_size)
    loss, grads, stats = deepseek_loss_and_grads(roomy_graphdef, params, batch)
    ref_loss, ref_grads, ref_stats = deepseek_loss_and_grads(graphdef, params, batch)
    assert_finite((loss, grads), "capacity DeepSeek")
    assert float(stats.dropped.sum()) == 0
    np.testing.assert_array_equal(np.asarray(stats.expert_load), np.asarray(ref_stats.expert_load))
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    assert_trees_close(jax.device_get(grads), jax.device_get(ref_grads), rtol=1e-5, atol=1e-7)


def compiled_cost(dispatch, tokens=2048, embed=64, hidden=256):
    """XLA's FLOPs and temp bytes of one MoE layer's forward + backward on one device."""
    module = GatedExperts(E, embed, hidden, rngs=nnx.Rngs(0))
    cfg = RouterConfig(num_experts=E, top_k=K)

    def loss(x, logits, w):
        y, _ = moe_forward(x, logits, None, w, WEIGHT_AXES, route=make_route_fn(cfg, "xla"),
                           ffn=lambda t, s, ws: module.compute(t, s, ws, "xla"), batched_ffn=module.compute_batched,
                           dispatch=dispatch, num_experts=E, hidden=hidden)
        return jnp.sum(y * y)

    shapes = (jax.ShapeDtypeStruct((1, tokens, embed), jnp.float32), jax.ShapeDtypeStruct((1, tokens, E), jnp.float32),
              {n: jax.ShapeDtypeStruct(v.shape, v.dtype) for n, v in module.weights().items()})
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*shapes).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return cost["flops"], compiled.memory_analysis().temp_size_in_bytes


def test_flops_and_temp_scale_with_the_capacity_factor():
    """Measured: FLOPs 0.61 / 1.23 / 2.45 G and temp 12.7 / 26.2 / 52.2 MiB at cf 0.5 / 1 / 2;
    dropless 31.3 MiB (on CPU a loop over row tiles, whose FLOPs XLA's cost analysis counts for
    one trip only, so FLOPs are compared between capacities)."""
    half, one, two = (compiled_cost(CapacityDispatch(cf)) for cf in (0.5, 1.0, 2.0))
    dropless = compiled_cost(dispatch_for(None))
    for what, i in (("flops", 0), ("temp", 1)):
        # roughly proportional to cf: doubling it adds at least 3/4 of what proportional would
        assert half[i] < one[i] < two[i], (what, half[i], one[i], two[i])
        assert two[i] - one[i] > 0.75 * one[i] and one[i] - half[i] > 0.75 * half[i], (what, half[i], one[i], two[i])
    assert one[1] < dropless[1], ("temp", one[1], dropless[1])


def test_capacity_factor_must_be_positive():
    with pytest.raises(ValueError, match="capacity_factor must be positive"):
        CapacityDispatch(0.0)
    with pytest.raises(ValueError, match="capacity_factor must be positive"):
        RouterConfig(capacity_factor=-1.0).validate()


def test_capacity_moe_lowers_for_cuda_with_fixed_all_to_alls():
    """Cross-lowered for an H100 mesh (expert=4): the exchange is two plain all_to_alls of fixed
    buffers (no counts gathered, no ragged collective), the experts one batched dot_general each."""
    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1, 2, 1, 4, 1), AXES, axis_types=(AxisType.Auto,) * 5, abstract_device=device)
    module, rules = experts(), get_rule_set("dp")
    weights = {n: jax.ShapeDtypeStruct(v.shape, v.dtype) for n, v in module.weights().items()}
    forward = lambda x, logits, w: moe_loss(module, CapacityDispatch(1.0), mesh, rules)(x, logits, w, x)[0]
    with jax.sharding.use_abstract_mesh(mesh), use_rules(mesh, rules):
        text = jax.jit(forward).trace(jax.ShapeDtypeStruct((8, 16, D), jnp.float32),
                                      jax.ShapeDtypeStruct((8, 16, E), jnp.float32),
                                      weights).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("all_to_all") == 2 and "ragged" not in text and "all_gather" not in text
