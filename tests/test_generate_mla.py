"""Generation with MLA's latent cache (issue 24): prefill + absorbed decode against the training
forward, the cache holding only latent + rotary key, and no per-head keys for the context."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import jaxpr_shapes
from flax import nnx

from jaxtrain.generate.compiles import count_compiles
from jaxtrain.models.layers.attention_impl import BlockwiseAttention, MaterializedAttention
from jaxtrain.models.layers.mla import MultiHeadLatentAttention, mla_softmax_scale
from jaxtrain.models.layers.rope import NoScaling

pytestmark = [pytest.mark.slow]

EMBED, HEADS, KV_LORA, NOPE, ROPE, V = 32, 4, 16, 8, 8, 6
BATCH, PROMPT, NEW, MAX_LEN = 3, 6, 5, 13  # MAX_LEN > PROMPT + NEW: entries past `index` stay masked
VALID_FROM = np.array([0, 2, 5], np.int32)  # left padding per row; row 2 has a one-token prompt


def build_mla(q_lora_rank, attention, seed=0):
    scaling = NoScaling()
    # init_std 0.3: q/k of order one, so a wrong rotary or latent term moves the softmax visibly
    return MultiHeadLatentAttention(
        EMBED, HEADS, q_lora_rank=q_lora_rank, kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
        v_head_dim=V, inv_freq=scaling.inv_freq(ROPE, 10000.0), softmax_scale=mla_softmax_scale(NOPE + ROPE, scaling),
        rngs=nnx.Rngs(seed), init_std=0.3, dtype=jnp.float32, attention=attention)


def left_padded(length):
    """Segment ids (0 on pads) and positions counting from 0 at each row's first real token."""
    places = np.arange(length)[None]
    segment_ids = (places >= VALID_FROM[:, None]).astype(np.int32)
    return np.maximum(places - VALID_FROM[:, None], 0).astype(np.int32), segment_ids


def assert_rel_close(ours, theirs, rel=1e-5):
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert np.isfinite(ours).all() and np.isfinite(theirs).all()
    np.testing.assert_allclose(ours, theirs, rtol=rel, atol=rel * np.abs(theirs).max())


def generation_fns(mla):
    graphdef, state = nnx.split(mla)
    forward = jax.jit(lambda x, pos, seg: nnx.merge(graphdef, state)(x, pos, seg))
    prefill = jax.jit(lambda x, pos, seg, cache: nnx.merge(graphdef, state).prefill(x, pos, seg, cache))
    decode = jax.jit(lambda x, pos, cache, index, valid_from:
                     nnx.merge(graphdef, state).decode(x, pos, cache, index, valid_from), donate_argnums=2)
    return forward, prefill, decode


@pytest.mark.parametrize("q_lora_rank,attention", [(None, BlockwiseAttention()), (12, MaterializedAttention())],
                         ids=["direct-q-blockwise", "q-lora-materialized"])
def test_prefill_then_decode_equals_training_forward(q_lora_rank, attention):
    mla = build_mla(q_lora_rank, attention, seed=1)
    forward, prefill, decode = generation_fns(mla)
    total = PROMPT + NEW
    x = np.random.default_rng(2).standard_normal((BATCH, total, EMBED)).astype(np.float32)
    positions, segment_ids = left_padded(total)
    expected = np.asarray(forward(x, positions, segment_ids))
    real = segment_ids.astype(bool)

    cache = mla.init_cache(BATCH, MAX_LEN, jnp.float32)
    assert {k: v.shape for k, v in cache.items()} == {"latent": (BATCH, MAX_LEN, KV_LORA),
                                                      "k_rope": (BATCH, MAX_LEN, ROPE)}
    out, cache = prefill(x[:, :PROMPT], positions[:, :PROMPT], segment_ids[:, :PROMPT], cache)
    assert_rel_close(np.asarray(out)[real[:, :PROMPT]], expected[:, :PROMPT][real[:, :PROMPT]])
    with count_compiles() as compiled:
        for t in range(PROMPT, total):
            out, cache = decode(x[:, t:t + 1], positions[:, t:t + 1], cache, jnp.int32(t), VALID_FROM)
            assert_rel_close(out[:, 0], expected[:, t])
    assert compiled["<lambda>"] == 1  # one compile for every step


def test_decode_never_forms_per_head_context_keys():
    """Decode's work over the context is against the latent: no [b, max_len, heads, *] array
    (nor any other layout of per-head, per-entry values wider than one score) in its program."""
    mla = build_mla(None, BlockwiseAttention())
    graphdef, state = nnx.split(mla)
    cache = mla.init_cache(BATCH, MAX_LEN, jnp.float32)
    x = jnp.zeros((BATCH, 1, EMBED))
    jaxpr = jax.make_jaxpr(lambda x, cache: nnx.merge(graphdef, state).decode(
        x, jnp.zeros((BATCH, 1), jnp.int32), cache, jnp.int32(PROMPT), jnp.asarray(VALID_FROM)))(x, cache)
    shapes = list(jaxpr_shapes(jaxpr.jaxpr))
    assert (BATCH, HEADS, MAX_LEN) in shapes  # a block's scores (one block spans this 13-entry cache)
    per_head_context = [s for s in shapes if MAX_LEN in s and HEADS in s
                        and np.prod(s) > BATCH * MAX_LEN * HEADS]
    assert not per_head_context, f"decode materializes per-head values over the context: {per_head_context}"


def tiny_deepseek(capacity_factor):
    from jaxtrain.models.deepseek import DeepSeekConfig
    from jaxtrain.models.layers.router import RouterConfig
    return DeepSeekConfig(embed=EMBED, heads=HEADS, kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                          v_head_dim=V, expert_mlp=16, init_std=0.2,
                          router=RouterConfig(num_experts=8, top_k=2, capacity_factor=capacity_factor))


@pytest.mark.parametrize("capacity_factor,mesh_config", [(None, None), (4.0, 4)],
                         ids=["dropless", "capacity-expert-parallel"])
def test_moe_block_decodes_batch_times_one_tokens(capacity_factor, mesh_config):
    """A DeepSeekMoE block routes decode's b x 1 tokens as training routes b x l: with a capacity
    that drops nothing (cf = experts / top_k, so C = the local tokens) prefill + decode equal the
    training forward, one device or expert-parallel."""
    from jaxtrain.meshes.mesh import MeshConfig, build_mesh
    from jaxtrain.meshes.rules import get_rule_set, use_rules
    from jaxtrain.models.deepseek import DeepSeekBlock
    block = DeepSeekBlock(tiny_deepseek(capacity_factor), moe=True, rngs=nnx.Rngs(3))
    batch, valid_from = 4, np.array([0, 2, 5, 1], np.int32)
    total = PROMPT + 2
    places = np.arange(total)[None]
    segment_ids = (places >= valid_from[:, None]).astype(np.int32)
    positions = np.maximum(places - valid_from[:, None], 0).astype(np.int32)
    x = np.random.default_rng(4).standard_normal((batch, total, EMBED)).astype(np.float32)
    graphdef, state = nnx.split(block)
    scope = contextlib.nullcontext()
    if mesh_config:
        # one decode token per device: each expert's capacity there is ceil(4 x 1 x 2 / 8) = 1 slot
        mesh = build_mesh(MeshConfig(expert=mesh_config), devices=jax.devices()[:mesh_config])
        scope = use_rules(mesh, get_rule_set("dp"))
    with scope:
        expected = np.asarray(jax.jit(lambda x: nnx.merge(graphdef, state)(x, positions, segment_ids)[0])(x))
        cache = block.init_cache(batch, MAX_LEN, jnp.float32)
        out, cache = jax.jit(lambda x, cache: nnx.merge(graphdef, state).prefill(
            x, positions[:, :PROMPT], segment_ids[:, :PROMPT], cache))(x[:, :PROMPT], cache)
        real = segment_ids[:, :PROMPT].astype(bool)
        assert_rel_close(np.asarray(out)[real], expected[:, :PROMPT][real], rel=1e-4)
        decode = jax.jit(lambda x, pos, cache, index: nnx.merge(graphdef, state).decode(
            x, pos, cache, index, jnp.asarray(valid_from)))
        for t in range(PROMPT, total):
            out, cache = decode(x[:, t:t + 1], positions[:, t:t + 1], cache, jnp.int32(t))
            assert_rel_close(out[:, 0], expected[:, t], rel=1e-4)


# ---- a tiny DeepSeek-V2 imported from transformers, through the generation engine ------------

HF_VARIANTS = {
    "lite_direct_q": dict(q_lora_rank=None),
    # query LoRA, YaRN with both temperature corrections acting (mscale != mscale_all_dim)
    "q_lora_yarn": dict(q_lora_rank=12, rope_parameters={"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0,
                                                         "original_max_position_embeddings": 32, "mscale": 0.8,
                                                         "mscale_all_dim": 1.0}),
}
HF_PROMPT_LENGTHS, HF_NEW_TOKENS = (5, 11, 2), 32


@pytest.fixture(scope="module", params=list(HF_VARIANTS))
def tiny_hf(request, tmp_path_factory):
    from hf_tiny_models import save_tiny_deepseek_v2
    from jaxtrain import hf
    from jaxtrain.generate import Engine
    directory = save_tiny_deepseek_v2(tmp_path_factory.mktemp(request.param), seed=5, **HF_VARIANTS[request.param])
    rng = np.random.default_rng(6)
    prompts = [rng.integers(3, 97, n).tolist() for n in HF_PROMPT_LENGTHS]
    model = hf.load(directory)
    return dict(dir=directory, model=model, prompts=prompts, engine=Engine(model, bucket=16))


def test_deepseek_greedy_equals_transformers_generate(tiny_hf):
    """Token for token against transformers' generate, and every step's logits against our own
    full forward over the prompt and the tokens generated before it."""
    from hf_tiny_models import forward
    from test_generate import transformers_greedy
    steps = {}
    with count_compiles() as compiled:
        ours = tiny_hf["engine"].generate(tiny_hf["prompts"], max_new_tokens=HF_NEW_TOKENS,
                                          on_logits=lambda step, logits: steps.__setitem__(step, logits))
    assert compiled["_decode_fn"] <= 1  # none if an earlier test of this model compiled the same bucket
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: torch's thread pool on a loaded 2-core machine costs ~10x
    try:
        theirs = transformers_greedy(tiny_hf["dir"], tiny_hf["prompts"], HF_NEW_TOKENS)
    finally:
        torch.set_num_threads(threads)
    assert ours == theirs
    cached = np.stack([steps[s] for s in range(HF_NEW_TOKENS)], axis=1)
    sequences = [p + r[:-1] for p, r in zip(tiny_hf["prompts"], ours)]
    tokens = np.zeros((len(sequences), max(map(len, sequences))), np.int32)
    for row, seq in enumerate(sequences):
        tokens[row, :len(seq)] = seq  # right-padded: causal, so pads after a position change nothing there
    full = forward(tiny_hf["model"], tokens)
    expected = np.stack([full[row, len(p) - 1:len(p) - 1 + HF_NEW_TOKENS]
                         for row, p in enumerate(tiny_hf["prompts"])])
    assert_rel_close(cached, expected)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_deepseek_cache_holds_latent_and_rope_key_only(tiny_hf, dtype):
    model = tiny_hf["model"]
    cache = jax.eval_shape(lambda: model.init_cache(2, 32, dtype))
    per_token = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(cache)) / (2 * 32)
    assert per_token == (KV_LORA + ROPE) * 3 * jnp.dtype(dtype).itemsize  # kv_lora + rope, 3 layers


@pytest.mark.parametrize("tiny_hf", ["q_lora_yarn"], indirect=True)
def test_deepseek_on_data2_tensor2_generates_the_one_device_tokens(tiny_hf):
    """Heads split over tensor, rows over data: the same greedy tokens; the latent cache splits its
    rows over data and is whole on each tensor rank (it has no heads to split)."""
    from jaxtrain import hf
    from jaxtrain.generate import Engine
    from jaxtrain.generate.engine import left_pad
    from jaxtrain.generate.sampling import Sampling
    from jaxtrain.meshes.mesh import MeshConfig, build_mesh
    from jaxtrain.meshes.rules import get_rule_set
    one_device = tiny_hf["engine"].generate(tiny_hf["prompts"], max_new_tokens=12)
    mesh = build_mesh(MeshConfig(data=2, tensor=2), jax.devices()[:4])
    engine = Engine(hf.load(tiny_hf["dir"], mesh=mesh), mesh=mesh, rules=get_rule_set("dp"), bucket=16)
    assert engine.generate(tiny_hf["prompts"], max_new_tokens=12) == one_device
    with engine._rules():
        padded = left_pad(tiny_hf["prompts"] + [[0]], 16)
        _, _, cache = engine._prefill(engine.state, padded.tokens, padded.positions, padded.segment_ids,
                                      jax.random.key(0), max_len=32, sampling=Sampling())
    for name in ("latent", "k_rope"):  # [layers, b, max_len, width]
        spec = tuple(cache["moe_blocks"][name].sharding.spec) + (None,) * 4
        assert spec[:4] == (None, "data", None, None), (name, spec)


@pytest.mark.parametrize("tiny_hf", ["lite_direct_q"], indirect=True)
def test_deepseek_decode_step_forms_no_per_head_context_keys(tiny_hf):
    """The whole model's decode step (every layer, both stacks, sampling) as the engine jits it."""
    from jaxtrain.generate.sampling import Sampling
    engine, batch, max_len = tiny_hf["engine"], 3, 48  # 48: no other width of the tiny model
    cache = jax.eval_shape(lambda: tiny_hf["model"].init_cache(batch, max_len, jnp.float32))
    jaxpr = jax.make_jaxpr(lambda state, cache: engine._decode_fn(
        state, cache, jnp.zeros(batch, jnp.int32), jnp.int32(20), jnp.zeros(batch, jnp.int32), jax.random.key(0),
        sampling=Sampling()))(engine.state, cache)
    shapes = list(jaxpr_shapes(jaxpr.jaxpr))
    assert (batch, HEADS, max_len) in shapes  # a block's scores (one block spans this 48-entry cache)
    per_head_context = [s for s in shapes if max_len in s and HEADS in s and np.prod(s) > batch * max_len * HEADS]
    assert not per_head_context, f"decode materializes per-head values over the context: {per_head_context}"
