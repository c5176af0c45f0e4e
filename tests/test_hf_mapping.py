"""The declarative tensor-mapping engine on its own: rearrangement patterns, region reads, and a
toy family that uses every kind of map (fused HF tensor split into several of ours, several HF
tensors fused into one of ours, a stack over chosen HF layers), imported and exported."""
from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
from flax import nnx

from jaxtrain.hf.exporter import ExportPlan
from jaxtrain.hf.importer import ImportPlan
from jaxtrain.hf.mapping import Family, TensorMap
from jaxtrain.hf.rearrange import parse
from jaxtrain.models.layers.params import param, zeros

pytestmark = [pytest.mark.fast]

# ----------------------------------------------------------------------------- rearrange


@pytest.mark.parametrize("pattern, left_shape, right_shape", [
    ("(h d) e -> e h d", (12, 5), (5, 4, 3)),
    ("e (h d) -> h d e", (5, 12), (3, 4, 5)),
    ("a b c -> (b a) c", (3, 4, 2), (12, 2)),
    ("v e -> e v", (7, 3), (3, 7)),
    ("(h d) 1 k -> h d k", (12, 1, 5), (3, 4, 5)),  # a depthwise conv weight: the size-1 dim dropped
])
def test_forward_backward_and_region_reads(pattern, left_shape, right_shape):
    r = parse(pattern)
    if all(len(g) == 1 for g in r.right):  # our side names every axis: it alone sizes the HF side
        assert r.left_shape(right_shape) == left_shape
    x = np.arange(np.prod(left_shape), dtype=np.float32).reshape(left_shape)
    y = r.forward(x, right_shape)
    assert y.shape == right_shape
    np.testing.assert_array_equal(r.backward(y, left_shape), x)
    rng = np.random.default_rng(0)
    for _ in range(20):
        region = []
        for d in right_shape:
            a = int(rng.integers(0, d))
            region.append(slice(a, int(rng.integers(a + 1, d + 1))))
        got = r.read_region(lambda s: x[s], left_shape, right_shape, tuple(region))
        np.testing.assert_array_equal(got, y[tuple(region)])


def test_region_read_of_split_heads_reads_only_those_rows():
    r = parse("(h d) e -> e h d")  # q_proj [heads*dim, embed] -> ours [embed, heads, dim]
    x = np.arange(8 * 4 * 6, dtype=np.float32).reshape(32, 6)
    reads = []

    def read(s):
        reads.append(s)
        return x[s]

    got = r.read_region(read, (32, 6), (6, 8, 4), (slice(None), slice(2, 4), slice(None)))
    np.testing.assert_array_equal(got, r.forward(x, (6, 8, 4))[:, 2:4])
    assert reads == [(slice(8, 16), slice(None))]  # heads 2-3 are rows 8..15 on disk


@pytest.mark.parametrize("pattern", ["a b -> a", "(a b -> b a", "a a -> a a", "a -> b", "(a 1) -> a"])
def test_bad_patterns(pattern):
    with pytest.raises(ValueError, match="bad rearrange pattern"):
        parse(pattern)


# ----------------------------------------------------------------------------- a toy family

L, E, H, K, D, F, V = 2, 6, 4, 2, 3, 5, 7


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    def build(self, rngs):
        return Toy(rngs)


class Toy(nnx.Module):
    def __init__(self, rngs):
        self.embed = param(rngs, zeros, (V, E), ("vocab", "embed"))
        self.q = param(rngs, zeros, (L, E, H, D), ("layers", "embed", "heads", "head_dim"))
        self.k = param(rngs, zeros, (L, E, K, D), ("layers", "embed", "kv_heads", "head_dim"))
        self.v = param(rngs, zeros, (L, E, K, D), ("layers", "embed", "kv_heads", "head_dim"))
        self.gate_up = param(rngs, zeros, (L, E, 2, F), ("layers", "embed", None, "mlp"))
        self.odd_norm = param(rngs, zeros, (L, E), ("layers", "norm"))


LAYER = "layers.{layer}."
TOY_TENSORS = (
    TensorMap("embed", "embed.weight"),
    # one fused HF tensor [(q + k + v) rows, embed] split into three of ours
    TensorMap("q", LAYER + "qkv.weight", "(h d) e -> e h d", hf_slice=(0, 0, H * D)),
    TensorMap("k", LAYER + "qkv.weight", "(h d) e -> e h d", hf_slice=(0, H * D, (H + K) * D)),
    TensorMap("v", LAYER + "qkv.weight", "(h d) e -> e h d", hf_slice=(0, (H + K) * D, (H + 2 * K) * D)),
    # two HF tensors fused into one of ours along its axis 1
    TensorMap("gate_up", LAYER + "gate.weight", "(one f) e -> e one f", ours_slice=(1, 0, 1)),
    TensorMap("gate_up", LAYER + "up.weight", "(one f) e -> e one f", ours_slice=(1, 1, 2)),
    # a stack over HF layers 1 and 3 only
    TensorMap("odd_norm", LAYER + "norm.weight", hf_indices={"layer": (1, 3)}),
)
TOY = Family(model_type="toy", architecture="ToyForCausalLM", config_class=ToyConfig, config_from_hf=None,
             config_to_hf=None, tensors=lambda cfg: TOY_TENSORS)


class DictSource:
    def __init__(self, tensors):
        self.arrays = tensors
        self.tensors = {n: types.SimpleNamespace(shape=a.shape) for n, a in tensors.items()}

    def read(self, name, slices=None):
        return self.arrays[name][slices] if slices else self.arrays[name]


class OursSource:
    def __init__(self, params):
        self.params = params

    def region(self, path, index, slices):
        return self.params[path][tuple(index) + tuple(slices)]


@pytest.fixture(scope="module")
def hf_tensors():
    rng = np.random.default_rng(0)
    t = {"embed.weight": rng.standard_normal((V, E), np.float32)}
    for layer in range(L):
        t[f"layers.{layer}.qkv.weight"] = rng.standard_normal(((H + 2 * K) * D, E), np.float32)
        t[f"layers.{layer}.gate.weight"] = rng.standard_normal((F, E), np.float32)
        t[f"layers.{layer}.up.weight"] = rng.standard_normal((F, E), np.float32)
    for layer in (1, 3):
        t[f"layers.{layer}.norm.weight"] = rng.standard_normal((E,), np.float32)
    return t


@pytest.fixture(scope="module")
def ours(hf_tensors):
    def heads(w, n):
        return w.reshape(n, D, E).transpose(2, 0, 1)

    qkv = [hf_tensors[f"layers.{i}.qkv.weight"] for i in range(L)]
    return {
        "embed": hf_tensors["embed.weight"],
        "q": np.stack([heads(w[:H * D], H) for w in qkv]),
        "k": np.stack([heads(w[H * D:(H + K) * D], K) for w in qkv]),
        "v": np.stack([heads(w[(H + K) * D:], K) for w in qkv]),
        "gate_up": np.stack([np.stack([hf_tensors[f"layers.{i}.gate.weight"].T,
                                       hf_tensors[f"layers.{i}.up.weight"].T], 1) for i in range(L)]),
        "odd_norm": np.stack([hf_tensors["layers.1.norm.weight"], hf_tensors["layers.3.norm.weight"]]),
    }


def test_import_whole_and_by_region(hf_tensors, ours):
    plan = ImportPlan(TOY, ToyConfig(), DictSource(hf_tensors))
    rng = np.random.default_rng(1)
    for path, expected in ours.items():
        np.testing.assert_array_equal(plan.read_region(path, tuple(slice(None) for _ in expected.shape)), expected)
        for _ in range(10):
            region = []
            for d in expected.shape:
                a = int(rng.integers(0, d))
                region.append(slice(a, int(rng.integers(a + 1, d + 1))))
            np.testing.assert_array_equal(plan.read_region(path, tuple(region)), expected[tuple(region)], path)


def test_export_rebuilds_every_hf_tensor_in_row_blocks(hf_tensors, ours):
    plan = ExportPlan(TOY, ToyConfig())
    assert set(plan.planned) == set(hf_tensors)
    for name, expected in hf_tensors.items():
        np.testing.assert_array_equal(plan.build(name, OursSource(ours)), expected, name)
        blocks = [plan.build(name, OursSource(ours), rows) for rows in plan.row_blocks(name, 40)]
        np.testing.assert_array_equal(np.concatenate(blocks), expected, name)


def test_blocks_tile_each_parameter_once(hf_tensors):
    plan = ImportPlan(TOY, ToyConfig(), DictSource(hf_tensors))
    for leaf in plan.leaves.values():
        block, regions = leaf.blocks(max_bytes=50)
        count = np.zeros(leaf.shape, int)
        for region in regions:
            count[region] += 1
            assert all(s.stop - s.start <= b for s, b in zip(region, block))
        assert (count == 1).all(), leaf.path


def test_tables_that_do_not_fit_the_model_are_rejected(hf_tensors):
    unmapped = dataclasses.replace(TOY, tensors=lambda cfg: TOY_TENSORS[:-1])
    with pytest.raises(ValueError, match=r"no HF tensor maps to our parameter\(s\) \['odd_norm'\]"):
        ImportPlan(unmapped, ToyConfig(), DictSource(hf_tensors))
    gap = [m for m in TOY_TENSORS if m.hf != LAYER + "up.weight"]
    with pytest.raises(ValueError, match="do not tile"):
        ImportPlan(dataclasses.replace(TOY, tensors=lambda cfg: gap), ToyConfig(), DictSource(hf_tensors))


def test_fused_tensor_with_leftover_rows_is_rejected(hf_tensors):
    padded = dict(hf_tensors)
    padded["layers.0.qkv.weight"] = np.zeros(((H + 2 * K) * D + 3, E), np.float32)
    with pytest.raises(ValueError, match=r"'layers\.0\.qkv\.weight'.*do not tile"):
        ImportPlan(TOY, ToyConfig(), DictSource(padded))


def test_placeholders_and_names():
    m = TensorMap("x", "model.layers.{layer}.experts.{expert}.w", hf_indices={"layer": (4, 7)})
    assert m.stack == ("layer", "expert") and m.hf_name((1, 3)) == "model.layers.7.experts.3.w"
