"""The update's per-leaf reductions as one collective each (issue 26.5).

meshes/leaf_sums.py sums every leaf of a tree of differently sharded arrays with one psum
(exact against float64, replicated copies counted once); the train step's gradient and
parameter norms then cost one all-reduce each on a 4-axis mesh, where every leaf group paid its
own, and the clip takes the step's gradient norm (the same result as optax's clip)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain.observe.hlo_stats import collective_stats
from jaxtrain.training.config import TrainConfig
from jaxtrain.training.optim import OptimizerConfig, clip_by_global_norm
from jaxtrain.training.parallel_plan import ParallelPlan
from jaxtrain.training.step import make_update
from jaxtrain.training.train_setup import build_train_setup
from jaxtrain.meshes.leaf_sums import leaf_sums, squares
from jaxtrain.meshes.mesh import MeshConfig, build_mesh
from jaxtrain.meshes.rules import get_rule_set, use_rules
from jaxtrain.models.deepseek import DeepSeekConfig
from jaxtrain.models.layers.router import RouterConfig

pytestmark = [pytest.mark.fast]

FOUR_AXES = MeshConfig(data=2, tensor=2, context=2, expert=2)
SPECS = {"split_two_axes": P(("data", "expert"), "tensor"), "replicated": P(), "split_context": P(None, "context"),
         "split_everywhere": P(("data", "context", "tensor", "expert"))}
SHAPES = {"split_two_axes": (8, 6), "replicated": (5,), "split_context": (6, 4, 3), "split_everywhere": (32,)}


def _all_reduces(text: str) -> dict[str, int]:
    """Compiled all-reduce instructions by the dtype of their (first) result."""
    out = {}
    for line in text.splitlines():
        m = re.search(r"=\s*\(?(\w+)\[[^=]*?\s+all-reduce(?:-start)?\(", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0) + 1
    return out


def test_leaf_sums_are_exact_with_one_all_reduce():
    mesh = build_mesh(FOUR_AXES, jax.devices()[:16])
    rng = np.random.default_rng(3)
    host = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    tree = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in host.items()}
    want = np.array([np.sum(np.square(host[k].astype(np.float64))) for k in sorted(host)])  # the tree's leaf order

    def run(specs):
        with use_rules(mesh, get_rule_set("fsdp")):
            compiled = jax.jit(lambda t: leaf_sums(squares, t, specs)).lower(tree).compile()
        return np.asarray(compiled(tree)), collective_stats(compiled.as_text())

    got, stats = run(SPECS)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert stats["all-reduce"]["count"] == 1, stats
    per_leaf, per_leaf_stats = run(None)  # the per-leaf reductions it replaces: one per leaf's device groups
    np.testing.assert_allclose(per_leaf, want, rtol=1e-6)
    assert per_leaf_stats["all-reduce"]["count"] >= 3, per_leaf_stats


def test_clip_with_the_steps_norm_equals_optax():
    rng = np.random.default_rng(5)
    tree = {"w": jnp.asarray(rng.standard_normal((7, 3)), jnp.float32), "b": jnp.asarray(rng.standard_normal(4), jnp.float32)}
    norm = optax.tree.norm(tree)
    for max_norm in (0.5 * float(norm), 2.0 * float(norm)):  # clipped, and left alone
        want, _ = optax.clip_by_global_norm(max_norm).update(tree, optax.EmptyState())
        ours = clip_by_global_norm(max_norm)
        for kwargs in ({}, {"global_norm": norm}):
            got, state = ours.update(tree, ours.init(tree), **kwargs)
            assert state == optax.EmptyState()  # the checkpointed state keeps optax's structure
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                assert np.isfinite(np.asarray(a)).all()
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


# Tiny DeepSeek: MLA, routed and shared experts, dense and MoE stacks: leaves split over different
# axes (experts over expert, heads over tensor, embed over the data axes, norms whole).
MODEL = DeepSeekConfig(vocab_size=96, embed=32, layers=3, first_k_dense=1, heads=4, kv_lora_rank=16,
                       qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, mlp=64, expert_mlp=16, shared_experts=2,
                       router=RouterConfig(num_experts=8, top_k=2))


@pytest.fixture(scope="module")
def four_axis_update():
    """make_update of tiny DeepSeek on data x tensor x context x expert (FSDP), compiled with the
    parameters' layouts (one collective per reduction) and without (one per leaf group), and
    both run on the same random state and gradients."""
    setup = build_train_setup(MODEL, ParallelPlan.parse("data=2,tensor=2,context=2,expert=2,rules=fsdp+expert_tp"),
                              TrainConfig(global_batch=16, seq_len=16), OptimizerConfig(learning_rate=1e-2, warmup_steps=0))
    shardings = setup.state.shardings
    state = setup.state.init(0)
    rng = np.random.default_rng(7)
    grads = jax.tree.map(lambda p: jax.device_put(rng.standard_normal(p.shape).astype(np.float32), p.sharding),
                         state.params)
    scalar = jnp.float32(3.0)
    out = {}
    for name, params_shardings in (("one_psum", shardings.params), ("per_leaf", None)):
        update = make_update(setup.state.graphdef, setup.tx, setup.lr_schedule, rules=setup.rules,
                             opt_state_shardings=shardings.opt_state, params_shardings=params_shardings)

        def run(state, grads):
            with use_rules(setup.mesh, setup.rules):
                return update(state, grads, (scalar, scalar, scalar), {}, jnp.float32(64.0), {})

        compiled = jax.jit(run).lower(state, grads).compile()
        out[name] = (compiled.as_text(), compiled(state, grads))
    return state, grads, out


@pytest.mark.slow  # a multi-axis step compile: out of the edit-test lane
def test_update_norms_take_one_all_reduce_each(four_axis_update):
    _, _, out = four_axis_update
    ours, per_leaf = _all_reduces(out["one_psum"][0]), _all_reduces(out["per_leaf"][0])
    # The gradient norm and the parameter norm: one float all-reduce each. The would-be
    # parameters' finite check stays per leaf group (pred), fused with AdamW (guarded_update.py).
    assert ours.get("f32", 0) == 2, ours
    assert ours.get("pred", 0) == per_leaf.get("pred", 0)
    assert per_leaf.get("f32", 0) > 2 * ours["f32"], per_leaf
    print(f"update all-reduces by dtype: one psum per norm {ours}, per leaf group {per_leaf}")


@pytest.mark.slow  # a multi-axis step compile: out of the edit-test lane
def test_update_norms_and_state_equal_float64_and_the_per_leaf_program(four_axis_update):
    state, grads, out = four_axis_update
    (new, metrics), (ref_new, ref_metrics) = out["one_psum"][1], out["per_leaf"][1]
    g64 = np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64))) for g in jax.tree.leaves(grads)))
    new_leaves = [np.asarray(x) for x in jax.tree.leaves(new.params)]
    assert all(np.isfinite(x).all() for x in new_leaves)
    p64 = np.sqrt(sum(np.sum(np.square(x.astype(np.float64))) for x in new_leaves))
    assert float(metrics["nonfinite"]) == 0.0
    np.testing.assert_allclose(float(metrics["grad_norm"]), g64, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["param_norm"]), p64, rtol=1e-6)
    moved = [np.abs(a - np.asarray(b)).max() for a, b in zip(new_leaves, jax.tree.leaves(state.params))]
    assert min(moved) > 0  # a real step: every parameter moved
    for a, b in zip(jax.tree.leaves((new.params, new.opt_state)), jax.tree.leaves((ref_new.params, ref_new.opt_state))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
