"""Attention with the sequence split over `context` (meshes/context_attention.sharded_attention),
called directly at context 4: RingKV and AllGatherKV in the load-balanced (zigzag) order give the
values and q/k/v gradients of one unsplit call, with sequences long enough that every ring step
runs several query and key blocks; and the compiled programs move K/V the way each exchange says
(RingKV by collective-permute only, AllGatherKV by all-gather only)."""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain.meshes.context_attention import sharded_attention
from jaxtrain.meshes.context_layout import AllGatherKV, ContextParallel, Contiguous, LoadBalanced, RingKV, device_order
from jaxtrain.meshes.context_layout import use_context_parallel
from jaxtrain.meshes.mesh import MeshConfig, build_mesh
from jaxtrain.meshes.rules import get_rule_set, use_rules
from jaxtrain.pallas_kernels.flash_attention import flash_attention

pytestmark = [pytest.mark.fast]

QUICK = {"xla_backend_optimization_level": 0}
SCALE = 0.3
CONTEXT = 4
# 128 tokens over context 4, zigzag: each rank holds two 16-token chunks (32 tokens); blocks of 8
# make every ring step a 4 x 4 grid of query and key blocks (the multi-block path).
B, LENGTH, HEADS, KV_HEADS, D, DV, BLOCK = 2, 128, 4, 2, 8, 6, 8
# Document starts per row: documents cross chunk and rank edges (16, 32, ...), one starts on one.
STARTS = ([5, 40, 41, 90], [32, 70])
EXCHANGES = {"ring": RingKV, "allgather": AllGatherKV}
LAYOUTS = {"balanced": LoadBalanced, "contiguous": Contiguous}


@pytest.fixture(autouse=True)
def _exact_f32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    draw = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    seg = np.zeros((B, LENGTH), np.int32)
    for row, cuts in enumerate(STARTS):
        for c in cuts:
            seg[row, c:] += 1
    return dict(q=draw(B, LENGTH, HEADS, D), k=draw(B, LENGTH, KV_HEADS, D), v=draw(B, LENGTH, KV_HEADS, DV),
                seg=seg, weights=draw(B, LENGTH, HEADS, DV))


def _value_and_grads(attend, weights):
    def loss(q, k, v, seg):
        out = attend(q, k, v, seg)
        return jnp.sum(out * weights), out
    return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)


@functools.lru_cache(maxsize=None)
def single_device(seed=0):
    """The unsplit materialized reference: (out, (dq, dk, dv)) in the original token order."""
    x = inputs(seed)
    attend = lambda q, k, v, seg: flash_attention(q, k, v, seg, seg, scale=SCALE, impl="reference")
    (_, out), grads = jax.jit(_value_and_grads(attend, x["weights"]), compiler_options=QUICK)(
        x["q"], x["k"], x["v"], x["seg"])
    return np.asarray(out), tuple(np.asarray(g) for g in grads)


@functools.lru_cache(maxsize=None)
def context_parallel(exchange: str, layout: str, seed=0):
    """(out, grads) back in the original order, and the compiled HLO text of the step."""
    x = inputs(seed)
    mesh = build_mesh(MeshConfig(data=1, context=CONTEXT), jax.devices()[:CONTEXT])
    order = device_order(LAYOUTS[layout](), LENGTH, CONTEXT)
    back = np.argsort(order)
    split = lambda a: jax.device_put(a[:, order], NamedSharding(mesh, PartitionSpec(None, "context")))
    settings = ContextParallel(layout=LAYOUTS[layout](), kv_exchange=EXCHANGES[exchange]())
    with use_rules(mesh, get_rule_set("dp")), use_context_parallel(settings):
        attend = lambda q, k, v, seg: sharded_attention(q, k, v, seg, scale=SCALE, impl="xla", block_q=BLOCK,
                                                        block_k=BLOCK)
        args = [split(x[n]) for n in ("q", "k", "v", "seg")]
        step = jax.jit(_value_and_grads(attend, split(x["weights"])), compiler_options=QUICK)
        compiled = step.lower(*args).compile()
        (_, out), grads = compiled(*args)
    return np.asarray(out)[:, back], tuple(np.asarray(g)[:, back] for g in grads), compiled.as_text()


def assert_close(actual, expected, what, rtol=1e-5):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert np.isfinite(actual).all() and np.isfinite(expected).all(), f"{what}: not finite"
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * np.abs(expected).max(), err_msg=what)


@pytest.mark.parametrize("exchange, layout", [("ring", "balanced"), ("allgather", "balanced"),
                                              ("ring", "contiguous")])
def test_context4_attention_equals_one_device(exchange, layout):
    out, grads, _ = context_parallel(exchange, layout)
    ref_out, ref_grads = single_device()
    assert_close(out, ref_out, "out")
    for name, g, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(g, want, name)


# ---- what the compiled programs send ------------------------------------------------------------

_OP = re.compile(r"\s(all-gather|collective-permute)(?:-start)?\(")
_ARRAY = re.compile(r"[a-z0-9]+\[([0-9,]*)\]")


def collectives(hlo_text: str) -> dict[str, list[tuple[tuple[int, ...], str]]]:
    """{op: (shape, source_target_pairs) of every array each all-gather / collective-permute
    outputs} (a combined collective's tuple contributes each of its arrays; the -done halves are
    not counted; pairs are "" for an all-gather)."""
    found = {"all-gather": [], "collective-permute": []}
    for line in hlo_text.splitlines():
        if "=" not in line:
            continue
        rhs = line.split("=", 1)[1]
        m = _OP.search(" " + rhs.split("(", 1)[0] + "(")  # the instruction's own op, not an operand's
        if m is None:
            continue
        pairs = re.search(r"source_target_pairs=(\{[{},0-9]*\})", rhs)
        found[m.group(1)] += [(tuple(int(d) for d in dims.split(",") if d), pairs.group(1) if pairs else "")
                              for dims in _ARRAY.findall(rhs.split(m.group(1))[0])]
    return found


# Per device (data=1, tensor=1): the whole batch and all kv heads, a rank's length or all of it.
LOCAL_KV = (B, LENGTH // CONTEXT, KV_HEADS, D)
WHOLE_KV = (B, LENGTH, KV_HEADS, D)


RING = "{" + ",".join(f"{{{i},{(i + 1) % CONTEXT}}}" for i in range(CONTEXT)) + "}"  # {{0,1},{1,2},...}


def test_ring_moves_kv_by_collective_permute_only():
    sent = collectives(context_parallel("ring", "balanced")[2])
    assert (LOCAL_KV, RING) in sent["collective-permute"], sent
    assert {pairs for _, pairs in sent["collective-permute"]} == {RING}, "every hop goes one rank on"
    assert sent["all-gather"] == [], f"the ring gathers: {sent['all-gather']}"


def test_allgather_moves_kv_by_all_gather_only():
    sent = collectives(context_parallel("allgather", "balanced")[2])
    assert (WHOLE_KV, "") in sent["all-gather"], sent
    assert sent["collective-permute"] == [], sent


# ---- issue 26.5's cuts: chunk-sized blocks under the zigzag layout, the backward's last hop -------

@functools.lru_cache(maxsize=None)
def ring_with_default_blocks():
    """context_parallel("ring", "balanced") with no block given: the layout chooses (one chunk)."""
    x = inputs(0)
    mesh = build_mesh(MeshConfig(data=1, context=CONTEXT), jax.devices()[:CONTEXT])
    order = device_order(LoadBalanced(), LENGTH, CONTEXT)
    split = lambda a: jax.device_put(a[:, order], NamedSharding(mesh, PartitionSpec(None, "context")))
    with use_rules(mesh, get_rule_set("dp")), use_context_parallel(ContextParallel(layout=LoadBalanced())):
        attend = lambda q, k, v, seg: sharded_attention(q, k, v, seg, scale=SCALE, impl="xla")
        args = [split(x[n]) for n in ("q", "k", "v", "seg")]
        lowered = jax.jit(_value_and_grads(attend, split(x["weights"])), compiler_options=QUICK).lower(*args)
        (_, out), grads = lowered.compile()(*args)
    back = np.argsort(order)
    return np.asarray(out)[:, back], tuple(np.asarray(g)[:, back] for g in grads), lowered.as_text()


CHUNK = LENGTH // (2 * CONTEXT)  # zigzag: each rank holds two chunks of 16 tokens


def test_zigzag_ring_computes_chunk_sized_tiles_and_equals_one_device():
    """Without a block from the caller the kernel's blocks are one chunk of the layout, so a
    block's place range is one chunk's and the causal skip can fire (a 32-token block spans
    chunks r and 2C-1-r: no key block is ever wholly after it). Values and gradients equal the
    unsplit reference; every score tile [b, kv, group, bq, bk] of the program is [CHUNK, CHUNK]."""
    out, grads, stablehlo = ring_with_default_blocks()
    ref_out, ref_grads = single_device()
    assert_close(out, ref_out, "out")
    for name, g, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(g, want, name)
    # the probability tiles [B, KV_HEADS, group, bq, bk] that the P.V and dS products read
    products = "\n".join(line for line in stablehlo.splitlines() if "dot_general" in line)
    found = re.findall(rf"tensor<{B}x{KV_HEADS}x{HEADS // KV_HEADS}x(\d+)x(\d+)xf32>", products)
    tiles = {(int(q), int(k)) for q, k in found if int(k) not in (D, DV)}
    assert tiles == {(CHUNK, CHUNK)}, found


def test_zigzag_chunk_tiles_skip_what_causality_hides():
    """The work those tiles leave, counted with the kernel's own skip rule over the places each
    rank holds at each ring step: a rank attends chunks r and 2C-1-r to every chunk, 16 chunk
    pairs; (r + 1) + (2C - r) = 2C + 1 of them hold a visible key. With one block per rank's
    tokens (the kernel's default before) no tile is skipped."""
    from jaxtrain.meshes.context_attention import layout_block
    from jaxtrain.pallas_kernels.flash_attention_xla import _may_see, _tokens

    order = device_order(LoadBalanced(), LENGTH, CONTEXT)
    local = LENGTH // CONTEXT
    seg = jnp.ones((1, local), jnp.int32)
    chosen = layout_block(None, LoadBalanced(), LENGTH, CONTEXT) or local  # None: the kernel's, capped at local
    # a long chunk keeps the kernel's default block (chunk-sized tiles would grow with the length)
    assert layout_block(None, LoadBalanced(), 65536, CONTEXT) is None
    assert layout_block(8, LoadBalanced(), LENGTH, CONTEXT) == 8  # the caller's block stands
    places = lambda r: jnp.asarray(order[r * local:(r + 1) * local])
    pick = lambda t, n: jax.tree.map(lambda a: a[n], t)
    for block, want in ((chosen, 2 * CONTEXT + 1), (local, 4 * CONTEXT)):
        for rank in range(CONTEXT):
            qt, ran = _tokens(places(rank), seg, block, 0), 0
            for s in range(CONTEXT):  # the block of rank (rank - s) mod C at ring step s
                kt = _tokens(places((rank - s) % CONTEXT), seg, block, 0)
                ran += sum(bool(_may_see(pick(qt, i), pick(kt, j)))
                           for i in range(local // block) for j in range(local // block))
            assert ran * (block // CHUNK) ** 2 == want, (block, rank, ran)  # in chunk pairs


def _permuted_bytes(hlo: str) -> int:
    from jaxtrain.observe.hlo_stats import executed_collective_stats
    return executed_collective_stats(hlo)["collective-permute"]["bytes"]


def test_ring_backward_last_hop_sends_gradients_only():
    """Forward: C - 1 hops of (k, v, segment ids). Backward: C - 1 hops of the block with its
    running dK/dV, then one hop of dK/dV alone: the keys/values have visited every rank."""
    per_rank = LENGTH // CONTEXT
    k, v = B * per_rank * KV_HEADS * D * 4, B * per_rank * KV_HEADS * DV * 4  # float32 here
    seg = B * per_rank * 4
    forward = (CONTEXT - 1) * (k + v + seg)
    backward = (CONTEXT - 1) * (k + v + seg + k + v) + (k + v)
    assert _permuted_bytes(context_parallel("ring", "balanced")[2]) == forward + backward
