"""route: XLA reference and Pallas kernels (interpreted on CPU) vs a per-token
float64 loop (ties, one expert taking every token, group limiting), gradients,
argument errors, and Triton lowering for H100/H200 without a GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.pallas_kernels import gpu_lowering
from jaxtrain.pallas_kernels.moe_routing import route

pytestmark = [pytest.mark.fast, pytest.mark.gpu]

T, E = 37, 16  # T not a multiple of the token block
# Constant within each group of 4 and exact in f32, so equal logits in a group
# stay exact ties in every precision.
BIAS = (np.arange(E) // 4 % 3) * 0.125
SPECS = {
    # DeepSeek-V2-Lite style: softmax, no groups.
    "softmax_top3": dict(top_k=3, norm_topk_prob=True),
    # DeepSeek-V3 style: sigmoid, selection bias, top-2-sum group limiting.
    "sigmoid_groups_bias": dict(
        top_k=4,
        score_fn="sigmoid",
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        correction_bias=BIAS,
    ),
    # DeepSeek-V2 group-limited greedy: softmax, max-score groups.
    "softmax_groups": dict(top_k=2, n_group=4, topk_group=1, norm_topk_prob=False, routed_scaling_factor=0.5),
}


def make_logits(kind, seed):
    rng = np.random.default_rng(seed)
    if kind == "random":
        x = rng.standard_normal((T, E))
    elif kind == "ties":  # few distinct values: many exact ties
        # {0, 1, 3}: no two different pairs have equal score sums (e.g. sigmoid(x)
        # + sigmoid(-x) == 1 would make group scores tie only in exact math).
        x = rng.choice([0.0, 1.0, 3.0], (T, E))
    else:  # "one_expert": every token's top choice is expert 5
        x = rng.standard_normal((T, E))
        x[:, 5] = 8.0
    return jnp.asarray(x, jnp.float32)


def numpy_route(
    logits,
    top_k,
    score_fn="softmax",
    n_group=1,
    topk_group=1,
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    correction_bias=None,
):
    logits = np.asarray(logits, np.float64)
    t, e = logits.shape
    ids = np.zeros((t, top_k), np.int64)
    weights = np.zeros((t, top_k))
    for r in range(t):
        x = logits[r]
        s = np.exp(x - x.max()) / np.exp(x - x.max()).sum() if score_fn == "softmax" else 1 / (1 + np.exp(-x))
        sel = s + (0 if correction_bias is None else correction_bias)
        allowed = set(range(e))
        if n_group > 1:
            per = e // n_group
            scores = []
            for g in range(n_group):
                part = sorted(sel[g * per : (g + 1) * per], reverse=True)
                scores.append(sum(part[:2]) if score_fn == "sigmoid" else part[0])
            groups = sorted(range(n_group), key=lambda g: (-scores[g], g))
            allowed = {i for g in groups[:topk_group] for i in range(g * per, (g + 1) * per)}
        order = sorted(allowed, key=lambda i: (-sel[i], i))[:top_k]
        ids[r] = order
        w = s[order]
        if norm_topk_prob:
            w = w / (w.sum() + 1e-20)
        weights[r] = w * routed_scaling_factor
    flat = ids.reshape(-1)
    sort_order = np.array(sorted(range(flat.size), key=lambda s: (flat[s], s)))
    inverse = np.empty_like(sort_order)
    inverse[sort_order] = np.arange(flat.size)
    return ids, weights, sort_order, np.bincount(flat, minlength=e), inverse


@functools.partial(jax.jit, static_argnames=("spec", "impl"))
def run(logits, spec, impl):
    return route(logits, impl=impl, block_t=16, **SPECS[spec])


def _loss(logits, spec, impl):
    return jnp.sum(jnp.sin(3.0 * run(logits, spec, impl).weights))


grad = jax.jit(jax.grad(_loss), static_argnames=("spec", "impl"))


def check_plan(plan, want):
    ids, weights, sort_order, group_sizes, inverse = want
    np.testing.assert_array_equal(plan.expert_ids, ids)
    np.testing.assert_allclose(plan.weights, weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(plan.sort_order, sort_order)
    np.testing.assert_array_equal(plan.group_sizes, group_sizes)
    np.testing.assert_array_equal(plan.inverse_order, inverse)
    assert plan.expert_ids.dtype == plan.sort_order.dtype == jnp.int32
    assert plan.weights.dtype == jnp.float32


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("inputs", ["random", "ties", "one_expert"])
@pytest.mark.parametrize("spec", SPECS)
def test_matches_float64_loop(spec, inputs, impl):
    logits = make_logits(inputs, len(spec))
    plan = run(logits, spec, impl)
    check_plan(plan, numpy_route(logits, **SPECS[spec]))
    if inputs == "one_expert":
        assert plan.group_sizes[5] == T


def test_pallas_bf16_logits():
    logits = make_logits("random", 5).astype(jnp.bfloat16)
    plan = run(logits, "sigmoid_groups_bias", "pallas")
    check_plan(plan, numpy_route(logits.astype(jnp.float32), **SPECS["sigmoid_groups_bias"]))


@pytest.mark.parametrize("spec", ["softmax_top3", "sigmoid_groups_bias"])
def test_gradients_match_reference(spec):
    logits = make_logits("random", 9)
    got = grad(logits, spec, "pallas")
    want = grad(logits, spec, "xla")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert np.any(np.asarray(got) != 0)


def test_bad_arguments_raise_clear_errors():
    logits = make_logits("random", 0)
    with pytest.raises(ValueError, match="impl"):
        route(logits, top_k=2, norm_topk_prob=True, impl="fast")
    with pytest.raises(ValueError, match="score_fn"):
        route(logits, top_k=2, norm_topk_prob=True, score_fn="relu")
    with pytest.raises(ValueError, match="n_group"):
        route(logits, top_k=2, norm_topk_prob=True, n_group=3)
    with pytest.raises(ValueError, match="topk_group"):
        route(logits, top_k=2, norm_topk_prob=True, n_group=4, topk_group=5)
    with pytest.raises(ValueError, match="top_k"):
        route(logits, top_k=5, norm_topk_prob=True, n_group=4, topk_group=1)
    with pytest.raises(ValueError, match="correction_bias"):
        route(logits, top_k=2, norm_topk_prob=True, correction_bias=BIAS[:3])
    with pytest.raises(ValueError, match="logits"):
        route(logits[0], top_k=2, norm_topk_prob=True)


@pytest.mark.parametrize("kind", sorted(gpu_lowering.GPU_DEVICE_KINDS))
def test_lowers_to_triton_for_gpu(kind):
    s = jax.ShapeDtypeStruct
    device_kind = gpu_lowering.GPU_DEVICE_KINDS[kind]
    configs = [  # (tokens, experts, options): V2-Lite and V3 shapes, ragged t
        (300, 64, dict(top_k=6, norm_topk_prob=False)),
        (
            300,
            256,
            dict(top_k=8, score_fn="sigmoid", n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5),
        ),
    ]
    for t, e, opts in configs:
        fn = lambda lg, bias, o=opts: route(lg, correction_bias=bias, **o)
        args = (s((t, e), jnp.bfloat16), s((e,), jnp.float32))
        fwd = gpu_lowering.lower_for_gpu(fn, *args, device_kind=device_kind)
        assert gpu_lowering.count_triton_kernels(fwd) == 2  # route + dispatch
        bwd = gpu_lowering.lower_for_gpu(
            jax.grad(lambda lg, bias, f=fn: jnp.sum(f(lg, bias).weights ** 2)), *args, device_kind=device_kind
        )
        assert gpu_lowering.count_triton_kernels(bwd) >= 1
