"""flash_attention impl="pallas" (Triton kernels, interpreted on CPU) against the materialized
reference: forward (out, lse) and gradients with packed documents, GQA, unequal head dims, ragged
lengths, permuted token places (zigzag / a ring step) and rows that see no key; the backward from
an (out, lse) over more keys than given (ring attention); the block tables the kernels skip by;
block-size errors; and Triton lowering for H100/H200 without a GPU."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_checks import TOL, assert_close, exact_f32_matmuls  # noqa: F401
from jaxtrain.pallas_kernels import flash_attention as fa
from jaxtrain.pallas_kernels import flash_attention_pallas, gpu_lowering
from jaxtrain.pallas_kernels.flash_attention_reference import visible

pytestmark = [pytest.mark.fast, pytest.mark.gpu, pytest.mark.usefixtures("exact_f32_matmuls")]

BLOCKS = dict(block_q=16, block_k=16)  # several blocks per tiny sequence: skipping and row tails


def _zigzag_places(l, s, rng):
    """Context rank 0 of 2 under zigzag: query chunks 0 and 3 of a 2l sequence; keys at shuffled
    places 4..s+3, so queries 0..3 see no key at all."""
    c = l // 2
    q_index = np.concatenate([np.arange(c), np.arange(3 * c, 3 * c + l - c)])
    kv_index = rng.permutation(np.arange(4, 4 + s))
    return q_index, kv_index


# name: (b, l, s, h, kv, d, dv, places, blocks)
CASES = {
    # two packed documents per row, GQA 4/2, d=24, dv=8, l not a multiple of the block
    "packed_gqa_ragged": (2, 37, 37, 4, 2, 24, 8, "causal", BLOCKS),
    # l != s, permuted places, one kv head for two query heads, d=12; default blocks (fitted to
    # the short lengths: one 32-query block, one 64-key block)
    "zigzag_no_key_rows": (1, 24, 40, 2, 1, 12, 8, "zigzag", {}),
    # a zigzag ring step at context 2: rank 0's queries (chunks 0 and 3 of four 24-token chunks)
    # against rank 1's keys (chunks 1 and 2), 16-token blocks: 3 query x 3 key blocks, a query
    # block that sees nothing, one half blind (straddling chunks 0 and 3), key blocks skipped
    "zigzag_ring_step_blocks": (2, 48, 48, 4, 2, 16, 8, "ring_step", BLOCKS),
}


def make_inputs(case, seed, dtype=jnp.float32):
    b, l, s, h, kv, d, dv, places, _ = CASES[case]
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, l, h, d)), dtype)
    k = jnp.asarray(rng.standard_normal((b, s, kv, d)), dtype)
    v = jnp.asarray(rng.standard_normal((b, s, kv, dv)), dtype)
    if places == "causal":
        q_index = kv_index = np.arange(l)
        # documents: [0, 10) [10, 37) in row 0; [0, 21) [21, 37) in row 1 (ids reused per row)
        q_seg = np.stack([np.arange(l) >= 10, np.arange(l) >= 21][:b]).astype(np.int32) + 5
        kv_seg = q_seg
    elif places == "zigzag":
        q_index, kv_index = _zigzag_places(l, s, rng)
        # documents follow places: the boundary at place 20 cuts both query and key sets
        q_seg = np.broadcast_to(q_index >= 20, (b, l)).astype(np.int32)
        kv_seg = np.broadcast_to(kv_index >= 20, (b, s)).astype(np.int32)
    else:  # ring_step
        c = l // 2
        q_index, kv_index = np.concatenate([np.arange(c), np.arange(3 * c, 4 * c)]), np.arange(c, c + s)
        # documents [0, 20) [20, 60) [60, ...) in row 0, [0, 30) [30, 80) [80, ...) in row 1: chunk 3's
        # queries see only the keys of their own document
        cuts = np.array([[20, 60], [30, 80]])[:b]
        doc = lambda places: (places[None, :, None] >= cuts[:, None, :]).sum(-1).astype(np.int32)
        q_seg, kv_seg = doc(q_index), doc(kv_index)
    labels = tuple(jnp.asarray(x, jnp.int32) for x in (q_seg, kv_seg, q_index, kv_index))
    scale = 1.0 / np.sqrt(d)
    return (q, k, v), labels, scale


def _loss(qkv, labels, scale, impl, blocks):
    out = fa.flash_attention(*qkv, *labels, scale=scale, impl=impl, **blocks)
    return jnp.sum(jnp.sin(out.astype(jnp.float32)))


@functools.partial(jax.jit, static_argnames=("scale", "impl", "case"))
def forward_and_grads(qkv, labels, scale, impl, case):
    blocks = CASES[case][-1]
    out, lse = fa.attention_forward(*qkv, *labels, scale=scale, impl=impl, **blocks)
    return out, lse, jax.grad(_loss)(qkv, labels, scale, impl, blocks)


def assert_finite(*arrays):
    for a in jax.tree.leaves(arrays):
        assert np.all(np.isfinite(np.asarray(a, np.float32))), "non-finite values"


@pytest.mark.parametrize(
    "case,dtype",
    [("packed_gqa_ragged", jnp.float32), ("zigzag_no_key_rows", jnp.float32),
     ("zigzag_ring_step_blocks", jnp.float32), ("packed_gqa_ragged", jnp.bfloat16)],
)
def test_pallas_matches_reference(case, dtype):
    qkv, labels, scale = make_inputs(case, 0, dtype)
    out, lse, grads = forward_and_grads(qkv, labels, scale, "pallas", case)
    assert out.dtype == lse.dtype == jnp.float32
    assert [g.dtype for g in grads] == [dtype] * 3
    assert_finite(out, lse, grads)
    # The f32 reference on the same (rounded) inputs is the target.
    qkv32 = tuple(x.astype(jnp.float32) for x in qkv)
    want_out, want_lse, want_grads = forward_and_grads(qkv32, labels, scale, "reference", case)
    q_seg, kv_seg, q_index, kv_index = labels
    blind = ~np.asarray(visible(q_index, kv_index, q_seg, kv_seg)).any(-1)  # [b, l]: rows that see no key
    if case == "zigzag_no_key_rows":
        assert blind.sum() == 4 * qkv[0].shape[0]  # queries at places 0..3
    if case == "zigzag_ring_step_blocks":
        # chunk 0 is before every key; in row 1, places 80..95 start a document after every key
        assert blind.sum() == 24 + (24 + 16)
    tol = TOL[dtype]
    assert_close(out, want_out, tol)
    lse_rows, want_lse_rows = (np.asarray(x).transpose(0, 2, 1) for x in (lse, want_lse))  # [b, l, h]
    assert_close(lse_rows[~blind], want_lse_rows[~blind], tol)
    for got, want in zip(grads, want_grads):
        assert_close(got, want, tol)
    # rows that see no key: out exactly 0, lse NO_KEYS, no gradient into their queries
    np.testing.assert_array_equal(np.asarray(out)[blind], 0.0)
    np.testing.assert_array_equal(lse_rows[blind], np.float32(fa.NO_KEYS))
    np.testing.assert_array_equal(np.asarray(grads[0], np.float32)[blind], 0.0)


@functools.partial(jax.jit, static_argnames=("scale", "impl"))
def _ring_step_grads(qkv, labels, out, lse, dout, scale, impl):
    return fa.attention_backward(*qkv, *labels, out, lse, dout, scale=scale, impl=impl, **BLOCKS)


def test_backward_from_larger_key_set():
    """A ring step: (out, lse) over all keys, the backward given part of the keys. Its dk/dv are
    those keys' share of the full gradient, and the parts' dq sum to the full dq."""
    qkv, labels, scale = make_inputs("packed_gqa_ragged", 1)
    q, k, v = qkv
    q_seg, kv_seg, q_index, kv_index = labels
    out, lse = jax.jit(fa.attention_reference, static_argnames="scale")(q, k, v, *labels, scale=scale)
    dout = jnp.asarray(np.random.default_rng(2).standard_normal(out.shape), jnp.float32)
    full = _ring_step_grads(qkv, labels, out, lse, dout, scale, "reference")
    parts = [slice(0, 21), slice(21, None)]  # uneven, neither a multiple of the block
    ring = [((q, k[:, p], v[:, p]), (q_seg, kv_seg[:, p], q_index, kv_index[p])) for p in parts]
    # the kernels on the first part (one compile keeps the test fast), the reference on both
    got = _ring_step_grads(*ring[0], out, lse, dout, scale, "pallas")
    assert_finite(got)
    want = [_ring_step_grads(*r, out, lse, dout, scale, "reference") for r in ring]
    for g, w in zip(got, want[0]):
        assert_close(g, w, 1e-4)
    assert_close(got[1], full[1][:, parts[0]], 1e-4)
    assert_close(got[2], full[2][:, parts[0]], 1e-4)
    assert_close(got[0] + want[1][0], full[0], 1e-4)


def test_block_tables_skip_what_no_query_sees():
    n = 64
    places = jnp.arange(n, dtype=jnp.int32)
    # one document per row, then documents aligned with the 16-token blocks
    segs = jnp.stack([jnp.zeros(n, jnp.int32), places // 32])
    t = flash_attention_pallas.block_tables(places, places, segs, segs, 16, 16)
    blocks = np.arange(4)
    # causal: query block i meets key blocks [0, i]; key block j meets query blocks [j, 4)
    np.testing.assert_array_equal(t.q_span[0], np.stack([0 * blocks, blocks + 1], -1))
    np.testing.assert_array_equal(t.k_span[0], np.stack([blocks, 0 * blocks + 4], -1))
    # documents [0, 32) and [32, 64): query blocks 2, 3 start at key block 2
    np.testing.assert_array_equal(t.q_span[1], [[0, 1], [0, 2], [2, 3], [2, 4]])
    np.testing.assert_array_equal(t.k_span[1], [[0, 2], [1, 2], [2, 4], [3, 4]])
    # queries before every key: nothing to visit
    late = jnp.arange(n, 2 * n, dtype=jnp.int32)
    t = flash_attention_pallas.block_tables(places, late, segs, segs, 16, 16)
    np.testing.assert_array_equal(t.q_span, 0)
    np.testing.assert_array_equal(t.k_span, 0)


def test_bad_blocks_raise_clear_errors():
    qkv, labels, scale = make_inputs("packed_gqa_ragged", 0)
    out, lse = fa.attention_reference(*qkv, *labels, scale=scale)
    with pytest.raises(ValueError, match="block_q"):
        fa.flash_attention(*qkv, *labels, scale=scale, impl="pallas", block_q=24)
    with pytest.raises(ValueError, match="block_k"):
        fa.attention_forward(*qkv, *labels, scale=scale, impl="pallas", block_k=48)
    with pytest.raises(ValueError, match="block_k"):
        fa.attention_backward(*qkv, *labels, out, lse, out, scale=scale, impl="pallas", block_k=8)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("kind", sorted(gpu_lowering.GPU_DEVICE_KINDS))
def test_lowers_to_triton_for_gpu(kind, dtype):
    # DeepSeek-V2-Lite MLA head geometry (d=192, dv=128) with GQA 4/2, packed documents.
    s = jax.ShapeDtypeStruct
    b, l, h, kv, d, dv = 1, 256, 4, 2, 192, 128
    args = (s((b, l, h, d), dtype), s((b, l, kv, d), dtype), s((b, l, kv, dv), dtype),
            s((b, l), jnp.int32), s((b, l), jnp.int32))

    def loss(q, k, v, q_seg, kv_seg):
        out = fa.flash_attention(q, k, v, q_seg, kv_seg, scale=d**-0.5, impl="pallas")
        return jnp.sum(out.astype(jnp.float32))

    text = gpu_lowering.lower_for_gpu(jax.value_and_grad(loss, argnums=(0, 1, 2)), *args,
                                      device_kind=gpu_lowering.GPU_DEVICE_KINDS[kind])
    assert gpu_lowering.count_triton_kernels(text) == 3  # forward, dK/dV, dQ
    for name in ("flash_attention_fwd", "flash_attention_bwd_dkv", "flash_attention_bwd_dq"):
        assert name in text
