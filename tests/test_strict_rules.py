"""Strict logical-axis rules (meshes/rules.py): every name is registered, a dimension its mesh
axes do not divide is an error unless its name replicates instead, and the check over a
model's parameters names the parameter; the sharding audit (meshes/sharding_audit.py) against
a count of the elements each device holds."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.training.optim import OptimizerConfig, make_optimizer
from jaxtrain.training.state import abstract_model, param_shardings, state_shardings
from jaxtrain.meshes.mesh import MeshConfig, build_mesh
from jaxtrain.meshes.rules import (LOGICAL_NAMES, OVERLAYS, RULE_SETS, SET_OVERLAYS, Indivisible, RuleTable, ShardingRuleError,
                          constrain, get_rule_set, spec_for, use_rules)
from jaxtrain.meshes.sharding_audit import ShardingAuditError, audit_sharding, check_sufficiently_sharded
from jaxtrain.models.deepseek import DeepSeekConfig
from jaxtrain.models.layers.mamba2 import SSMConfig
from jaxtrain.models.llama import LlamaConfig
from jaxtrain.models.mamba2 import Mamba2Config
from jaxtrain.models.nemotron_h import NemotronHConfig

pytestmark = [pytest.mark.fast]


@pytest.fixture(scope="module")
def mesh():
    return build_mesh(MeshConfig(data=2, context=2, tensor=4))


# ---- the registry ------------------------------------------------------------------------------

def test_unknown_name_is_an_error_naming_it_the_tensor_and_the_known_names(mesh):
    with pytest.raises(ShardingRuleError) as err:
        spec_for(("batch", "lenght", None), (8, 16, 4), get_rule_set("dp").activations, mesh)
    text = str(err.value)
    assert "unknown logical axis name 'lenght'" in text
    assert "(8, 16, 4)" in text and "('batch', 'lenght', None)" in text
    assert "known: batch, " in text and "length" in text and "vocab" in text
    assert isinstance(err.value, ValueError)  # the CLI's clear-error path catches ValueError
    # A table naming an unregistered name fails when it is made, not when a tensor meets it.
    with pytest.raises(ShardingRuleError, match="unknown logical axis name 'hedas'.*rule table 'mine'"):
        RuleTable({"hedas": ("tensor",)}, "mine")


def test_every_registered_name_has_a_meaning_and_every_table_only_registered_names():
    assert all(isinstance(v.indivisible, Indivisible) and len(v.meaning) > 10 for v in LOGICAL_NAMES.values())
    names = [*RULE_SETS] + [f"{base}+{o}" for o in (*OVERLAYS, *SET_OVERLAYS) for base in RULE_SETS]
    for name in names:
        rules = get_rule_set(name)
        for part in ("params", "activations", "optimizer_table"):
            table = getattr(rules, part)
            assert set(table) <= set(LOGICAL_NAMES), (name, part)
            assert table.name.startswith(name)  # errors can say which table


@pytest.mark.parametrize("cfg", [
    LlamaConfig(vocab_size=96, embed=32, layers=2, heads=4, kv_heads=2, mlp=64),
    DeepSeekConfig(q_lora_rank=16),
    NemotronHConfig(moe_latent=16),
    Mamba2Config(ssm=SSMConfig(groups=1)),
], ids=["llama", "deepseek", "nemotron_h", "mamba2"])
def test_every_family_lays_out_under_every_rule_set(cfg):
    """Every logical name the families use is registered, and the tiny defaults fit tensor=2 under
    every table (folded experts over data x context included)."""
    _, abstract = abstract_model(cfg)
    mesh = build_mesh(MeshConfig(data=4, context=2, tensor=2))
    for name in ("dp", "fsdp", "zero1", "fsdp+experts_folded", "fsdp+expert_tp"):
        param_shardings(abstract, mesh, get_rule_set(name).params)


# ---- divisibility ------------------------------------------------------------------------------

def test_indivisible_dimension_is_an_error_naming_the_axes_and_sizes(mesh):
    fsdp = get_rule_set("fsdp")
    with pytest.raises(ShardingRuleError) as err:
        spec_for(("embed", "heads", "head_dim"), (6, 8, 4), fsdp.params, mesh)
    # embed takes data x context (expert has size 1 and is skipped)
    assert "embed=6 is not divisible by data=2 x context=2 = 4" in str(err.value)
    assert "(6, 8, 4)" in str(err.value) and "rule table 'fsdp params'" in str(err.value)
    assert err.value.reason == "embed=6 is not divisible by data=2 x context=2 = 4"
    with pytest.raises(ShardingRuleError, match=r"heads=6 is not divisible by tensor=4 \(a tensor of shape"):
        spec_for(("embed", "heads", "head_dim"), (32, 6, 4), fsdp.params, mesh)
    # Axes an earlier dimension took are skipped before the check: batch holds data, so FSDP's
    # embed asks only for context.
    table = {**fsdp.activations, "embed": ("data", "context")}
    assert spec_for(("batch", "embed"), (2, 6), table, mesh) == P("data", "context")
    with pytest.raises(ShardingRuleError, match="embed=3 is not divisible by context=2"):
        spec_for(("batch", "embed"), (2, 3), table, mesh)
    # 8 experts on expert=16 would silently leave every device holding all experts.
    with pytest.raises(ShardingRuleError, match="experts=8 is not divisible by expert=16"):
        spec_for(("experts", "expert_embed", "expert_mlp"), (8, 32, 16), fsdp.params, build_mesh(MeshConfig(expert=16)))
    # None entries are never sharded.
    assert spec_for((None, "heads"), (7, 8), fsdp.params, mesh) == P(None, "tensor")


def test_vocab_and_layers_replicate_when_indivisible(mesh):
    dp = get_rule_set("dp")
    # An odd vocabulary stays whole; an even one splits.
    assert spec_for(("vocab", "embed"), (97, 32), dp.params, mesh) == P(None, None)
    assert spec_for(("vocab", "embed"), (96, 32), dp.params, mesh) == P("tensor", None)
    # The longest dividing prefix of the axes is kept: 2 x 49 splits over data, not data x tensor.
    assert spec_for(("vocab",), (98,), {"vocab": ("data", "tensor")}, mesh) == P("data")
    # A canonical stack of 23 layers on pipeline=2 stays whole (jaxtrain/training/state_layouts.py).
    pipe = build_mesh(MeshConfig(pipeline=2, data=8))
    assert spec_for(("layers", "embed"), (23, 32), {"layers": ("pipeline",)}, pipe) == P(None, None)
    assert spec_for(("layers", "embed"), (26, 32), {"layers": ("pipeline",)}, pipe) == P("pipeline", None)


def test_one_ssm_group_or_kv_head_is_replicated_but_several_must_divide(mesh):
    dp = get_rule_set("dp")
    # multi-query attention: the one key/value head on every tensor rank
    assert spec_for(("embed", "kv_heads", "head_dim"), (32, 1, 8), dp.params, mesh) == P(None, None, None)
    assert spec_for(("embed", "kv_heads", "head_dim"), (32, 4, 8), dp.params, mesh) == P(None, "tensor", None)
    with pytest.raises(ShardingRuleError, match="kv_heads=2 is not divisible by tensor=4"):
        spec_for(("embed", "kv_heads", "head_dim"), (32, 2, 8), dp.params, mesh)
    assert spec_for(("ssm_groups", "ssm_state"), (1, 16), dp.params, mesh) == P(None, None)
    assert spec_for(("ssm_groups", "ssm_state"), (8, 16), dp.params, mesh) == P("tensor", None)
    with pytest.raises(ShardingRuleError, match="ssm_groups=2 is not divisible by tensor=4"):
        spec_for(("ssm_groups", "ssm_state"), (2, 16), dp.params, mesh)


def test_parameter_check_names_the_path_shape_names_and_table():
    """Tiny Llama with 3 heads on tensor=2: the error from building the state's shardings names
    the parameters, before anything is compiled."""
    mesh = build_mesh(MeshConfig(data=8, tensor=2))
    tx, _ = make_optimizer(OptimizerConfig(), 10)
    cfg = LlamaConfig(vocab_size=96, embed=24, layers=2, heads=3, kv_heads=3, head_dim=8, mlp=64)
    cfg.validate(dict(mesh.shape))  # the config itself is fine
    with pytest.raises(ShardingRuleError) as err:
        state_shardings(cfg, tx, mesh, get_rule_set("fsdp"))
    text = str(err.value)
    assert "under rule table 'fsdp params'" in text and "mesh data=8 x tensor=2" in text
    assert ("heads=3 is not divisible by tensor=2: parameter stacks/blocks/layers/attn/o/kernel of shape "
            "(2, 3, 8, 24) named ('layers', 'heads', 'head_dim', 'embed') (and 1 more parameter)") in text
    assert ("kv_heads=3 is not divisible by tensor=2: parameter stacks/blocks/layers/attn/k/kernel of shape "
            "(2, 24, 3, 8) named ('layers', 'embed', 'kv_heads', 'head_dim') (and 1 more parameter)") in text
    assert len(text.splitlines()) == 1  # the CLI prints it as one line
    # The same model fits tensor=1.
    state_shardings(cfg, tx, build_mesh(MeshConfig(pipeline=2, data=8)), get_rule_set("fsdp"))


def test_activation_constraint_is_strict_when_traced(mesh):
    dp = get_rule_set("dp")

    def f(x):
        return constrain(x * 2, ("batch", "length", "heads", None))

    with use_rules(mesh, dp):
        jax.jit(f).trace(jax.ShapeDtypeStruct((4, 8, 8, 2), jnp.float32))  # fits: traced fine
        with pytest.raises(ShardingRuleError, match=r"batch=3 is not divisible by data=2 .*'dp activations'"):
            jax.jit(f).trace(jax.ShapeDtypeStruct((3, 8, 8, 2), jnp.float32))
    assert f(jnp.ones((3, 1, 1, 1))).shape == (3, 1, 1, 1)  # outside use_rules: a no-op


# ---- the audit -------------------------------------------------------------------------------

def _count_by_hand(shape, dtype, sharding):
    """(bytes per device, copies of each element) from each device's index into the array."""
    counts = np.zeros(shape, np.int64)
    per_device = []
    for index in sharding.devices_indices_map(shape).values():
        counts[index] += 1
        per_device.append(np.zeros(shape)[index].size * np.dtype(dtype).itemsize)
    assert counts.min() == counts.max()
    return max(per_device), int(counts.min())


def test_audit_matches_a_count_of_each_devices_elements(mesh):
    n = mesh.size
    f32, bf16 = jnp.float32, jnp.bfloat16
    tree = {"a": jax.ShapeDtypeStruct((8, 16), f32), "e": jax.ShapeDtypeStruct((4, 6), f32),
            "b": {"c": jax.ShapeDtypeStruct((4, 6, 10), bf16), "d": jax.ShapeDtypeStruct((3,), jnp.int32)}}
    specs = {"a": P(("data", "context"), "tensor"), "e": P("tensor", "data"),
             "b": {"c": P("tensor", None, None), "d": P()}}
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
    report = audit_sharding(tree, shardings, name="t")
    total = per_device = replicated = 0
    by_path = {leaf.path: leaf for leaf in report.leaves}
    flat = {"a": "a", "e": "e", "b/c": ("b", "c"), "b/d": ("b", "d")}
    for path, key in flat.items():
        leaf, sharding = (tree[key], shardings[key]) if isinstance(key, str) else (tree[key[0]][key[1]],
                                                                                  shardings[key[0]][key[1]])
        size = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        bpd, copies = _count_by_hand(leaf.shape, leaf.dtype, sharding)
        assert (by_path[path].bytes_per_device, by_path[path].copies, by_path[path].bytes) == (bpd, copies, size)
        total, per_device, replicated = total + size, per_device + bpd, replicated + bpd - size / n
    assert (report.devices, report.total_bytes, report.bytes_per_device) == (n, total, per_device)
    assert report.ideal_bytes_per_device == pytest.approx(total / n)
    assert report.replicated_bytes_per_device == pytest.approx(replicated)
    assert [leaf.path for leaf in report.leaves] == ["b/c", "b/d", "e", "a"]  # most replicated bytes first
    assert [by_path[p].copies for p in ("a", "e", "b/c", "b/d")] == [1, 2, 4, n]
    assert report.top(10)[-1].path == "e"  # top leaves cost something
    # Leaves carrying their own shardings (and explicit paths) give the same report.
    carried = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)
    again = audit_sharding(carried, paths=["A", "C", "D", "E"], name="t")
    assert again.bytes_per_device == report.bytes_per_device and again.leaves[0].path == "C"


def test_audit_of_fsdp_and_dp_llama_params():
    """FSDP x tensor on 16 devices splits every matrix 16 ways (only norms stay replicated); dp
    keeps each weight whole on every data rank."""
    mesh = build_mesh(MeshConfig(data=8, tensor=2))
    tx, _ = make_optimizer(OptimizerConfig(), 10)
    cfg = LlamaConfig(vocab_size=96, embed=32, layers=2, heads=4, kv_heads=2, mlp=64)
    _, fsdp_abstract, _ = state_shardings(cfg, tx, mesh, get_rule_set("fsdp"))
    fsdp = audit_sharding(fsdp_abstract.params, name="params")
    norms = (2 * 2 * 32 + 32) * 4  # attn and mlp norm scales of 2 layers and the final norm, float32
    assert fsdp.replicated_bytes_per_device == pytest.approx(norms * 15 / 16)
    assert fsdp.replicated_fraction < 0.1
    assert {leaf.path for leaf in fsdp.top(10)} == {"final_norm/scale", "stacks/blocks/layers/attn_norm/scale",
                                                    "stacks/blocks/layers/mlp_norm/scale"}
    matrices = [leaf for leaf in fsdp.leaves if leaf.replicated_bytes_per_device == 0]
    assert matrices and all(leaf.copies == 1 for leaf in matrices)

    _, dp_abstract, _ = state_shardings(cfg, tx, mesh, get_rule_set("dp"))
    dp = audit_sharding(dp_abstract.params, name="params")
    assert dp.total_bytes == fsdp.total_bytes == cfg.param_count() * 4
    # Under dp every weight split over tensor has 8 copies, the norms 16: per device, a weight of B
    # bytes costs B / 2 (split weights) or B (norms), of which B / 16 is its ideal share.
    split = dp.total_bytes - norms
    assert dp.bytes_per_device == split // 2 + norms
    assert dp.replicated_bytes_per_device == pytest.approx(split / 2 + norms - dp.total_bytes / 16)
    q = next(leaf for leaf in dp.leaves if leaf.path == "stacks/blocks/layers/attn/q/kernel")
    assert q.copies == 8 and q.spec == str(P(None, None, "tensor", None))
    summary = dp.summary()
    assert summary.startswith("params ") and "/device" in summary and "replicated (" in summary
    assert " x8 " in summary and "\n" not in summary


def test_host_memory_leaves_are_reported_apart(mesh):
    tree = {"w": jax.ShapeDtypeStruct((16, 16), jnp.float32), "opt": jax.ShapeDtypeStruct((16, 16), jnp.float32)}
    device = NamedSharding(mesh, P("data", "tensor"))
    shardings = {"w": device, "opt": NamedSharding(mesh, P()).with_memory_kind("pinned_host")}
    report = audit_sharding(tree, shardings, name="state")
    assert report.total_bytes == 16 * 16 * 4 and [leaf.path for leaf in report.leaves] == ["w"]
    assert report.host_bytes_per_device == 16 * 16 * 4 and [leaf.path for leaf in report.host_leaves] == ["opt"]
    assert "1 host-memory leaves" in report.summary()
    check_sufficiently_sharded(report, tolerance=0.5)  # the replicated host copy does not count


def test_check_sufficiently_sharded_raises_above_tolerance_and_passes_below(mesh):
    tree = {"big": jax.ShapeDtypeStruct((64, 64), jnp.float32), "small": jax.ShapeDtypeStruct((64,), jnp.float32)}
    shardings = {"big": NamedSharding(mesh, P(("data", "context"), "tensor")), "small": NamedSharding(mesh, P())}
    report = audit_sharding(tree, shardings, name="params")
    # big: 1 KiB per device, no copies; small: 256 B on every device, 240 B of it copies.
    assert report.bytes_per_device == 1024 + 256 and report.replicated_bytes_per_device == pytest.approx(240)
    fraction = 240 / 1280
    check_sufficiently_sharded(report, tolerance=fraction + 0.01)
    with pytest.raises(ShardingAuditError) as err:
        check_sufficiently_sharded(report, tolerance=fraction - 0.01)
    text = str(err.value)
    assert "params:" in text and "small (64,) P() x16" in text and "big" not in text
    assert isinstance(err.value, ValueError)
    # Replicating the big one too is far over a 2% tolerance.
    worse = audit_sharding(tree, {"big": NamedSharding(mesh, P()), "small": shardings["small"]}, name="params")
    with pytest.raises(ShardingAuditError, match=r"most replicated: big \(64, 64\) P\(\) x16"):
        check_sufficiently_sharded(worse, tolerance=0.02)
