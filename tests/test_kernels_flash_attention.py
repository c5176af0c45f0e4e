"""flash_attention, blockwise XLA backend: values (out, lse) and gradients against the
materialized reference on packed documents, GQA/MQA, unequal head dims, ragged lengths and
permuted (zigzag) token places; rows that see no key; the ring-attention backward (lse over
more keys than given); skipping of fully masked blocks; agreement with the model's attention;
O(l) memory; bad arguments."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_checks import TOL, assert_close, exact_f32_matmuls  # noqa: F401
from jaxtrain.models.layers.attention_core import attention_mask, dot_product_attention
from jaxtrain.pallas_kernels.flash_attention import (
    NO_KEYS,
    attention_backward,
    attention_backward_reference,
    attention_forward,
    flash_attention,
)
from jaxtrain.pallas_kernels.flash_attention_reference import visible

pytestmark = [pytest.mark.fast, pytest.mark.gpu, pytest.mark.usefixtures("exact_f32_matmuls")]

SCALE = 0.3

# b, l (queries), s (keys), h, kv heads, d, dv, blocks, and where the tokens sit in the sequence.
CASES = {
    # l = s = 37 not a multiple of 16; GQA 4 over 2; d = 12 (not a power of 2) != dv = 8.
    "packed_gqa_ragged": dict(b=2, l=37, s=37, h=4, kv=2, d=12, dv=8, block_q=16, block_k=16, layout="contiguous"),
    # MQA; l != s; both sides hold permuted 8-token chunks of a 64-token sequence (zigzag-style):
    # the queries of chunk 0 see no key at all (every key is placed later).
    "mqa_zigzag": dict(b=2, l=24, s=40, h=4, kv=1, d=16, dv=16, block_q=8, block_k=16, layout="zigzag"),
}
CHUNK = 8
ZIGZAG_Q_CHUNKS, ZIGZAG_KV_CHUNKS = (5, 0, 7), (6, 1, 3, 2, 4)


def _documents(rng, b: int, total: int):
    """[b, total] segment id of every place: several documents per row, different per row; the
    second row counts down (ids need not be sorted for the block ranges to stay correct)."""
    rows = []
    for row in range(b):
        starts = np.zeros(total, np.int32)
        starts[rng.choice(np.arange(1, total), size=3 + row, replace=False)] = 1
        ids = np.cumsum(starts)
        rows.append(ids + 3 if row % 2 == 0 else 20 - ids)
    return np.stack(rows).astype(np.int32)


def make_inputs(case: str, seed: int, dtype=jnp.float32):
    c = CASES[case]
    rng = np.random.default_rng(seed)
    if c["layout"] == "contiguous":
        q_index, kv_index = np.arange(c["l"]), np.arange(c["s"])
    else:
        chunks = lambda ids: np.concatenate([np.arange(i * CHUNK, (i + 1) * CHUNK) for i in ids])
        q_index, kv_index = chunks(ZIGZAG_Q_CHUNKS), chunks(ZIGZAG_KV_CHUNKS)
    docs = _documents(rng, c["b"], int(max(q_index.max(), kv_index.max())) + 1)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    b, l, s, h, kv = c["b"], c["l"], c["s"], c["h"], c["kv"]
    return dict(
        q=normal(b, l, h, c["d"]),
        k=normal(b, s, kv, c["d"]),
        v=normal(b, s, kv, c["dv"]),
        q_segment=jnp.asarray(docs[:, q_index]),
        kv_segment=jnp.asarray(docs[:, kv_index]),
        q_index=jnp.asarray(q_index, jnp.int32),
        kv_index=jnp.asarray(kv_index, jnp.int32),
        weights=jnp.asarray(rng.standard_normal((b, l, h, c["dv"])), jnp.float32),
    )


@functools.partial(jax.jit, static_argnames=("impl", "block_q", "block_k"))
def run(q, k, v, q_segment, kv_segment, q_index, kv_index, weights, impl, block_q=None, block_k=None):
    """(out, lse) of attention_forward, and flash_attention's output with the gradients of
    sum(weights * output) w.r.t. q, k, v. One jitted function serves every test (few compiles)."""
    masks = (q_segment, kv_segment, q_index, kv_index)
    kw = dict(scale=SCALE, impl=impl, block_q=block_q, block_k=block_k)
    out, lse = attention_forward(q, k, v, *masks, **kw)
    flash_out, pullback = jax.vjp(lambda q, k, v: flash_attention(q, k, v, *masks, **kw), q, k, v)
    return out, lse, flash_out, pullback(weights.astype(flash_out.dtype))


def run_case(inputs, impl, case=None):
    blocks = {} if case is None else dict(block_q=CASES[case]["block_q"], block_k=CASES[case]["block_k"])
    return run(**inputs, impl=impl, **blocks)


def assert_finite(*arrays):
    for a in arrays:
        assert np.all(np.isfinite(np.asarray(a, np.float32))), "non-finite values"


def assert_all_close(got, want, rtol):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert_finite(*got, *want)  # NaN == NaN would pass the comparison
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        assert_close(g, w, rtol)


@pytest.mark.parametrize(
    "case,dtype",
    [("packed_gqa_ragged", jnp.float32), ("packed_gqa_ragged", jnp.bfloat16), ("mqa_zigzag", jnp.float32)],
)
def test_xla_matches_reference(case, dtype):
    inputs = make_inputs(case, seed=1, dtype=dtype)
    out, lse, flash_out, grads = run_case(inputs, "xla", case)
    ref_out, ref_lse, ref_flash_out, ref_grads = run_case(inputs, "reference")
    assert out.dtype == lse.dtype == jnp.float32 and flash_out.dtype == dtype
    assert_all_close((out, flash_out), (ref_out, ref_flash_out), TOL[dtype])
    assert_lse_close(lse, ref_lse, inputs, TOL[dtype])
    assert_all_close(grads, ref_grads, TOL[dtype])


def assert_lse_close(lse, ref_lse, inputs, rtol):
    """lse on the rows that see a key, scaled by their own magnitudes (a row that sees none holds
    NO_KEYS = -1e30, which as a scale would hide any error); those rows exactly NO_KEYS."""
    seen = np.asarray(visible(inputs["q_index"], inputs["kv_index"], inputs["q_segment"],
                              inputs["kv_segment"])).any(-1)  # [b, l]
    rows, ref_rows = (np.asarray(x).transpose(0, 2, 1) for x in (lse, ref_lse))  # [b, l, h]
    assert_finite(rows, ref_rows)
    assert_close(rows[seen], ref_rows[seen], rtol)
    np.testing.assert_array_equal(rows[~seen], np.float32(NO_KEYS))


def test_rows_that_see_no_key():
    inputs = make_inputs("mqa_zigzag", seed=2)
    out, lse, _, grads = run_case(inputs, "xla", "mqa_zigzag")
    assert_finite(out, lse, *grads)
    blind = np.asarray(inputs["q_index"]) < np.asarray(inputs["kv_index"]).min()  # chunk 0: before every key
    assert blind.sum() == CHUNK
    np.testing.assert_array_equal(np.asarray(out)[:, blind], 0.0)
    np.testing.assert_array_equal(np.asarray(lse)[:, :, blind], np.float32(NO_KEYS))
    np.testing.assert_array_equal(np.asarray(grads[0])[:, blind], 0.0)
    assert np.all(np.asarray(lse)[:, :, ~blind] > NO_KEYS / 2)


@functools.partial(jax.jit, static_argnames=("impl",))
def ring_backward(q, k, v, q_segment, kv_segment, q_index, kv_index, out, lse, dout, impl):
    args = (q, k, v, q_segment, kv_segment, q_index, kv_index, out, lse, dout)
    if impl == "reference":
        return attention_backward_reference(*args, scale=SCALE)
    return attention_backward(*args, scale=SCALE, impl=impl, block_q=8, block_k=8)


def test_backward_from_lse_over_more_keys():
    """Ring attention: (out, lse) cover all keys, the backward gets every other one of them."""
    x = make_inputs("packed_gqa_ragged", seed=3)
    out, lse, _, _ = run_case(x, "reference")
    n = {name: np.asarray(a) for name, a in x.items()}
    half = np.arange(0, n["k"].shape[1], 2)
    given = (n["q"], n["k"][:, half], n["v"][:, half], n["q_segment"], n["kv_segment"][:, half], n["q_index"],
             n["kv_index"][half], out, lse, n["weights"])
    assert_all_close(ring_backward(*given, impl="xla"), ring_backward(*given, impl="reference"), TOL[jnp.float32])


def test_fully_masked_blocks_are_skipped():
    """Key blocks no query may see hold NaN values: computing them (even masked: 0 * NaN) would
    spread NaN, so results that are finite and equal the reference (with zeros there) show the
    blocks were skipped — one for its places, one for its document ids."""
    case = "mqa_zigzag"
    x = {name: np.array(a) for name, a in make_inputs(case, seed=4).items()}
    block = CASES[case]["block_k"]
    by_doc, by_place = slice(block, 2 * block), slice(2 * block, None)  # key blocks 1 and 2 (8 keys + padding)
    x["kv_segment"][:, by_doc] = 99  # a document no query belongs to
    x["kv_index"][by_place] = 64 + np.arange(x["kv_index"][by_place].size)  # after every query
    want = run_case(x, "reference")
    # A copy, not x["v"] in place: on CPU jax may read a numpy input without copying it, after
    # this line (asynchronous dispatch), so mutating it would race with the reference run.
    v = x["v"].copy()
    for hidden in (by_doc, by_place):
        v[:, hidden] = np.nan
    got = run_case({**x, "v": v}, "xla", case)
    assert_all_close(got, want, TOL[jnp.float32])


def test_model_attention_agrees():
    """The model's materialized attention (causal over packed rows) equals flash_attention."""
    x = make_inputs("packed_gqa_ragged", seed=5)
    assert np.array_equal(x["q_segment"], x["kv_segment"]) and np.array_equal(x["q_index"], np.arange(37))
    model = jax.jit(lambda q, k, v, seg: dot_product_attention(q, k, v, attention_mask(seg, seg), scale=SCALE))
    flash_out = run_case(x, "xla", "packed_gqa_ragged")[2]
    assert_all_close(flash_out, model(x["q"], x["k"], x["v"], x["q_segment"]), TOL[jnp.float32])


def test_shard_map_carries_type_check():
    """Inside shard_map with check_vma, q and k varying over different mesh axes: the loop
    carries must vary over both (built from the inputs, never from jnp.zeros)."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from jaxtrain.pallas_kernels import flash_attention_xla

    if len(jax.devices()) < 4:  # the GPU check runs this file natively on one GPU
        pytest.skip("needs 4 devices (the suite has 16 simulated CPU devices)")
    mesh = jax.make_mesh((2, 2), ("x", "y"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4])
    b, l, h, d = 1, 16, 2, 8
    q = jnp.ones((b, l, h, d))
    segment, index = jnp.zeros((b, l), jnp.int32), jnp.arange(l, dtype=jnp.int32)

    def local(q, k, q_segment, kv_segment, q_index, kv_index):
        masks = (q_segment, kv_segment, q_index, kv_index)
        out, lse = flash_attention_xla.forward(q, k, k, *masks, scale=1.0, block_q=4, block_k=4)
        return out, flash_attention_xla.backward(q, k, k, *masks, out, lse, out, scale=1.0, block_q=4, block_k=4)

    specs = (P(None, "x"), P(None, "y"), P(None, "x"), P(None, "y"), P("x"), P("y"))
    both = P(None, ("x", "y"))
    f = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(both, (both, both, both)), check_vma=True)
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((q, q, segment, segment, index, index), specs)]
    jax.jit(f).trace(*args)  # type errors surface while tracing; nothing to compile


def _temp_bytes(length: int, impl: str) -> int:
    """Compile-only scratch memory of value_and_grad at one length (b = h = 1, d = 8)."""
    q = jax.ShapeDtypeStruct((1, length, 1, 8), jnp.float32)
    segment = jax.ShapeDtypeStruct((1, length), jnp.int32)

    def loss(q, k, v, segment):
        return flash_attention(q, k, v, segment, segment, scale=SCALE, impl=impl, block_q=256, block_k=256).sum()

    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, q, q, segment).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_memory_grows_linearly():
    xla_ratio = _temp_bytes(8192, "xla") / _temp_bytes(2048, "xla")
    reference_ratio = _temp_bytes(8192, "reference") / _temp_bytes(2048, "reference")
    assert xla_ratio <= 4.5, f"blockwise temp memory grew {xla_ratio:.1f}x for 4x the length"
    assert reference_ratio > 12, f"the materialized reference grew only {reference_ratio:.1f}x"


def test_bad_arguments():
    x = make_inputs("packed_gqa_ragged", seed=6)
    args = (x["q"], x["k"], x["v"], x["q_segment"], x["kv_segment"])
    with pytest.raises(ValueError, match="impl must be one of"):
        flash_attention(*args, scale=SCALE, impl="cuda")
    with pytest.raises(ValueError, match="block_q must be a positive integer, got 0"):
        flash_attention(*args, scale=SCALE, impl="xla", block_q=0)
    with pytest.raises(ValueError, match="block_k must be a positive integer, got -16"):
        attention_forward(*args, x["q_index"], x["kv_index"], scale=SCALE, impl="xla", block_k=-16)
