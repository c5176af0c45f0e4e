"""MLA attention over a chunk-wise up-projected latent (meshes/latent_attention.py): the same
values and gradients as up-projecting the whole sequence first, alone and inside MLA; under
context parallelism MLA up-projects each rank's own tokens and rings per-head keys/values, or
(`LatentKV`) gathers the latent and up-projects the whole sequence on every rank."""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain.observe.hlo_dots import dot_dtypes
from jaxtrain.meshes.context_layout import (ContextParallel, LatentKV, LoadBalanced, RingKV, device_order,
                                   use_context_parallel)
from jaxtrain.meshes.latent_attention import latent_attention
from jaxtrain.meshes.mesh import MeshConfig, build_mesh
from jaxtrain.meshes.rules import get_rule_set, use_rules
from jaxtrain.models.layers.attention_impl import BlockwiseAttention, MaterializedAttention
from jaxtrain.models.layers.mla import MultiHeadLatentAttention, mla_softmax_scale
from jaxtrain.models.layers.rope import NoScaling
from jaxtrain.pallas_kernels.flash_attention import attention_reference

pytestmark = [pytest.mark.fast]

QUICK = {"xla_backend_optimization_level": 0}


@pytest.fixture(autouse=True)
def _exact_f32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def assert_close(actual, expected, what, rtol=1e-5):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert np.isfinite(actual).all() and np.isfinite(expected).all(), f"{what}: not finite"
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * np.abs(expected).max(), err_msg=what)


def packed_segments(rows, length, starts):
    seg = np.ones((rows, length), np.int32)
    for row, cuts in enumerate(starts):
        for c in cuts:
            seg[row, c:] += 1
    return seg


def test_chunked_latent_attention_equals_up_projecting_first():
    """One zigzag context rank's queries against the whole sequence's latent in 4 chunks,
    packed documents crossing chunk boundaries."""
    b, length, heads, kv_lora, nope, rope, dv, context = 2, 32, 3, 8, 4, 4, 5, 2
    rng = np.random.default_rng(0)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    order = device_order(LoadBalanced(), length, context)
    seg = packed_segments(b, length, ([5, 20], [13]))[:, order]
    mine = slice(length // context, length)  # rank 1's tokens (places 8..15 and 16..23)
    q, latent, k_rope = draw(b, length // context, heads, nope + rope), draw(b, length, kv_lora), draw(b, length, rope)
    w_up, weights = draw(kv_lora, heads, nope + dv), draw(b, length // context, heads, dv)
    q_seg, q_places = jnp.asarray(seg[:, mine]), jnp.asarray(order[mine])
    kv_seg, kv_places = jnp.asarray(seg), jnp.asarray(order)
    scale = 0.3

    def chunked(q, latent, k_rope, w_up):
        return latent_attention(q, latent, k_rope, w_up, q_seg, kv_seg, q_places, kv_places, nope=nope, scale=scale,
                                impl="xla", block_q=4, block_k=4, chunk=8)

    def up_projected(q, latent, k_rope, w_up):
        kv = jnp.einsum("bsc,chd->bshd", latent, w_up)
        k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(k_rope[:, :, None], kv.shape[:3] + (rope,))], -1)
        return attention_reference(q, k, kv[..., nope:], q_seg, kv_seg, q_places, kv_places, scale=scale)[0]

    args = (q, latent, k_rope, w_up)
    loss = lambda f: jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a) * weights), argnums=(0, 1, 2, 3)))
    (got, got_grads), (want, want_grads) = loss(chunked)(*args), loss(up_projected)(*args)
    assert_close(chunked(*args), up_projected(*args), "out")
    assert_close(got, want, "loss")
    for name, g, w in zip(("dq", "d latent", "d k_rope", "d w_up"), got_grads, want_grads):
        assert_close(g, w, name)


def test_bf16_latent_attention_multiplies_bf16_and_matches_float32():
    """A bf16 model's chunked latent attention: on XLA:CPU every matmul of its forward and
    backward has bf16 operands (the up-projection and its two gradients took float32 ones, at
    half the speed), and its value and gradients are float32 whole-sequence attention's (plain
    autodiff) up to bf16 rounding of the keys, values and outputs."""
    b, length, heads, kv_lora, nope, rope, dv = 2, 32, 4, 64, 16, 8, 16
    rng = np.random.default_rng()
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    q, latent, k_rope = draw(b, length, heads, nope + rope), draw(b, length, kv_lora), draw(b, length, rope)
    w_up, weights = draw(kv_lora, heads, nope + dv) * 0.2, draw(b, length, heads, dv)
    seg, places = jnp.asarray(packed_segments(b, length, ([9], [20]))), jnp.arange(length)

    def attend(q, latent, k_rope, w_up):
        return latent_attention(q, latent, k_rope, w_up, seg, seg, places, places, nope=nope, scale=0.2,
                                impl="xla", block_q=8, block_k=8, chunk=8)

    def up_projected(q, latent, k_rope, w_up):  # the reference: whole-sequence keys, plain autodiff
        kv = jnp.einsum("bsc,chd->bshd", latent, w_up)
        k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(k_rope[:, :, None], kv.shape[:3] + (rope,))], -1)
        return attention_reference(q, k, kv[..., nope:], seg, seg, places, places, scale=0.2)[0]

    def out_and_grads(f, args):
        loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) * weights.astype(jnp.float32))
        return jax.jit(lambda *a: (f(*a), *jax.grad(loss, argnums=(0, 1, 2, 3))(*a)))

    args = (q, latent, k_rope, w_up)
    with jax.default_matmul_precision("default"):  # the training default (the fixture asks for highest)
        step = out_and_grads(attend, args)
        dots = dot_dtypes(step.lower(*args).compile().as_text())
        got = step(*args)
    assert len(dots) >= 6 and all(ops == ("bf16", "bf16") for _, ops in dots), dots
    args32 = [a.astype(jnp.float32) for a in args]
    want = out_and_grads(up_projected, args32)(*args32)
    # bf16 rounding of keys, values and outputs: 0.8% of the largest value at worst over 40 draws
    for name, g, w in zip(("out", "dq", "d latent", "d k_rope", "d w_up"), got, want):
        assert g.dtype == jnp.bfloat16, name
        assert_close(g, w, name, rtol=1.5e-2)


EMBED, HEADS, KV_LORA, NOPE, ROPE, V, LENGTH = 32, 4, 16, 8, 8, 6, 32


def mla_params(attention, seed=0):
    scaling = NoScaling()
    mla = MultiHeadLatentAttention(
        EMBED, HEADS, q_lora_rank=None, kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
        v_head_dim=V, inv_freq=scaling.inv_freq(ROPE, 10000.0), softmax_scale=mla_softmax_scale(NOPE + ROPE, scaling),
        rngs=nnx.Rngs(seed), dtype=jnp.float32, attention=attention)
    graphdef, params = nnx.split(mla)
    rng = np.random.default_rng(seed)  # widen the init so softmax and masks matter
    return graphdef, jax.tree.map(lambda a: jnp.asarray(0.3 * rng.standard_normal(a.shape), a.dtype), params)


MLA_MESH = MeshConfig(data=2, context=2, tensor=2)


def mla_inputs():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, LENGTH, EMBED)).astype(np.float32)
    seg = packed_segments(2, LENGTH, ([7, 20], [16, 17]))
    positions = np.zeros_like(seg)
    for row in range(2):
        for s in np.unique(seg[row]):
            idx = np.nonzero(seg[row] == s)[0]
            positions[row, idx] = np.arange(len(idx))
    weights = rng.standard_normal((2, LENGTH, EMBED)).astype(np.float32)
    return x, seg, positions, weights


def mla_loss(graphdef, positions, seg, weights):
    def loss(params, x):
        y = nnx.merge(graphdef, params)(x, positions, seg)
        return jnp.sum(y * weights), y
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), compiler_options=QUICK)


EXCHANGES = {"ring": RingKV(), "latent": LatentKV()}


@functools.lru_cache(maxsize=None)
def mla_context_parallel(exchange: str = "ring"):
    """MLA (BlockwiseAttention; by default each rank's own keys over the context ring) on data x
    context x tensor = 2 x 2 x 2, zigzag layout: (y, (d params, d x)) in the original order and
    the compiled step's HLO."""
    graphdef, params = mla_params(BlockwiseAttention(block_q=8, block_k=8))
    x, seg, positions, weights = mla_inputs()
    mesh = build_mesh(MLA_MESH, jax.devices()[:MLA_MESH.fixed_device_count()])
    order = device_order(LoadBalanced(), LENGTH, 2)
    back = np.argsort(order)
    put = lambda a: jax.device_put(a, NamedSharding(mesh, PartitionSpec()))
    settings = ContextParallel(layout=LoadBalanced(), kv_exchange=EXCHANGES[exchange])
    with use_rules(mesh, get_rule_set("dp")), use_context_parallel(settings):
        step = mla_loss(graphdef, put(positions[:, order]), put(seg[:, order]), put(weights[:, order]))
        args = (jax.tree.map(put, params), put(x[:, order]))
        compiled = step.lower(*args).compile()
        (_, y), (gp, gx) = compiled(*args)
    return np.asarray(y)[:, back], (gp, np.asarray(gx)[:, back]), compiled.as_text()


@pytest.mark.parametrize("exchange", sorted(EXCHANGES))
def test_mla_latent_path_under_context_parallel_equals_materialized(exchange):
    """MLA with BlockwiseAttention on a data x context x tensor mesh, zigzag layout, per-head
    keys by ring or the latent gathered, equals MaterializedAttention on one device: outputs and
    every gradient."""
    graphdef_ref, params = mla_params(MaterializedAttention())
    graphdef, _ = mla_params(BlockwiseAttention(block_q=8, block_k=8))
    x, seg, positions, weights = mla_inputs()
    (_, ref_y), (ref_gp, ref_gx) = mla_loss(graphdef_ref, positions, seg, weights)(params, x)

    y, (gp, gx), _ = mla_context_parallel(exchange)
    assert_close(y, ref_y, "output")
    assert_close(gx, ref_gx, "d x")
    flat_ref = dict(jax.tree_util.tree_leaves_with_path(ref_gp))
    for path, g in jax.tree_util.tree_leaves_with_path(gp):
        assert_close(g, flat_ref[path], f"d {jax.tree_util.keystr(path)}")

    # Without a mesh the latent path is one direct call (a single chunk).
    (_, y1), (gp1, gx1) = mla_loss(graphdef, positions, seg, weights)(params, x)
    assert_close(y1, ref_y, "output, no mesh")
    assert_close(gx1, ref_gx, "d x, no mesh")
    for path, g in jax.tree_util.tree_leaves_with_path(gp1):
        assert_close(g, flat_ref[path], f"d {jax.tree_util.keystr(path)}, no mesh")


_ARRAY = re.compile(r"\b[a-z][a-z0-9]*\[([0-9,]+)\]")


def test_mla_never_holds_per_head_keys_for_the_whole_sequence():
    """Per device, the compiled step's per-head keys/values ([batch, length, heads, nope + rope |
    v | nope + v], or heads before length) span a context rank's length (one chunk of the
    latent), never the whole sequence: no array in the program has that shape."""
    batch, heads, length = 2 // MLA_MESH.data, HEADS // MLA_MESH.tensor, LENGTH // MLA_MESH.context
    shapes = {tuple(int(d) for d in dims.split(",")) for dims in _ARRAY.findall(mla_context_parallel()[2])}
    per_head = (NOPE + ROPE, V, NOPE + V)
    chunk_kv = {(batch, length, heads, w) for w in per_head}
    assert chunk_kv & shapes, "the chunk's keys/values are not where this test looks"
    whole = {(batch, LENGTH, heads, w) for w in per_head} | {(batch, heads, LENGTH, w) for w in per_head}
    assert not whole & shapes, f"per-head keys/values over the whole sequence: {sorted(whole & shapes)}"


def test_mla_context_ranks_up_project_only_their_own_tokens():
    """Under context parallelism each rank up-projects its own tokens' latent and the per-head
    keys/values travel the context ring; gathering the latent made every rank up-project the
    whole sequence ((C - 1) / C of that work replicated: issue 26.5). Per device the compiled step
    holds the latent of a rank's length only, never the whole sequence's, and moves per-head
    key blocks by collective-permute."""
    batch, heads, length = 2 // MLA_MESH.data, HEADS // MLA_MESH.tensor, LENGTH // MLA_MESH.context
    text = mla_context_parallel()[2]
    # The forward's instructions (the backward's weight gradient may gather activations: XLA's
    # choice for a weight replicated over the data axes, also without context parallelism).
    forward = [line for line in text.splitlines() if "op_name=" in line and "transpose(" not in line]
    shapes = {tuple(int(d) for d in dims.split(",")) for line in forward for dims in _ARRAY.findall(line)}
    assert (batch, length, KV_LORA) in shapes, "the rank's latent is not where this test looks"
    assert (batch, LENGTH, KV_LORA) not in shapes, "a whole-sequence latent on a device: up-projected by every rank"
    permuted = {tuple(int(d) for d in dims.split(",")) for line in text.splitlines()
                if re.search(r"collective-permute(-start)?\(", line) for dims in _ARRAY.findall(line.split("(")[0])}
    assert (batch, length, heads, NOPE + ROPE) in permuted, sorted(permuted)


def _collective_bytes(text: str, kind: str, forward_only: bool = True) -> list[tuple[tuple[int, ...], int]]:
    """(shape, bytes) of each float `kind` collective's result in the compiled HLO, the
    forward's only by default (the backward's ops carry `transpose(` in their op_name)."""
    found = []
    for line in text.splitlines():
        if not re.search(rf"= f32\[[0-9,]+\][^ ]* {kind}(-start)?\(", line):
            continue
        if forward_only and "transpose(" in line:
            continue
        dims = tuple(int(d) for d in _ARRAY.findall(line.split("(")[0])[0].split(","))
        found.append((dims, 4 * int(np.prod(dims))))
    return found


def _widths(exchange):
    return exchange.exchanged_width(kv_heads=HEADS // MLA_MESH.tensor, qk_head_dim=NOPE + ROPE, v_head_dim=V,
                                    latent_width=KV_LORA + ROPE)


def test_latent_exchange_moves_the_latent_not_per_head_keys():
    """LatentKV: the forward gathers the whole sequence's latent and rotary key over `context`
    (kv_lora + rope values a token) and moves no per-head key or value; the bytes it gathers are
    what `LatentKV.exchanged_width` says (the planner's figure), and the ring's forward permutes
    what `RingKV.exchanged_width` says (per-head keys + values of this device's heads)."""
    batch, heads, length, context = 2 // MLA_MESH.data, HEADS // MLA_MESH.tensor, LENGTH // MLA_MESH.context, 2
    latent_text, ring_text = mla_context_parallel("latent")[2], mla_context_parallel("ring")[2]
    assert not re.search(r"collective-permute(-start)?\(", latent_text), "LatentKV still rings something"
    gathered = [(dims, size) for dims, size in _collective_bytes(latent_text, "all-gather") if LENGTH in dims]
    assert sorted(dims for dims, _ in gathered) == [(batch, LENGTH, ROPE), (batch, LENGTH, KV_LORA)], gathered
    per_head = {(batch, length, heads, w) for w in (NOPE + ROPE, V)}
    moved = {dims for kind in ("all-gather", "all-to-all", "collective-permute")
             for dims, _ in _collective_bytes(latent_text, kind, forward_only=False)}
    assert not moved & per_head, sorted(moved & per_head)
    # Bytes reaching a device in one layer's forward: (C - 1) / C of the sequence at the width.
    arrived = sum(size for _, size in gathered) * (context - 1) // context
    assert arrived == 4 * batch * LENGTH * (context - 1) // context * _widths(LatentKV())
    ring = [(dims, size) for dims, size in _collective_bytes(ring_text, "collective-permute")]
    assert sorted(dims for dims, _ in ring) == sorted(per_head), ring
    # One ring step (C = 2: the one step there is) moves a rank's length of tokens.
    assert sum(size for _, size in ring) == 4 * batch * length * _widths(RingKV())
    assert _widths(LatentKV()) < _widths(RingKV()), "this shape should favour the latent"
