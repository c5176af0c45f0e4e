"""Multi-head latent attention and YaRN against transformers' DeepSeek-V2 (fp32, random weights)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.meshes.mesh import MeshConfig, build_mesh
from jaxtrain.meshes.rules import get_rule_set, use_rules
from jaxtrain.models.layers.mla import MultiHeadLatentAttention, mla_softmax_scale
from jaxtrain.models.layers.rope import NoScaling, YarnScaling, rope_attention_factor

torch = pytest.importorskip("torch")
from transformers import DeepseekV2Config  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_ds  # noqa: E402

pytestmark = [pytest.mark.fast]

EMBED, HEADS, KV_LORA, NOPE, ROPE, V = 32, 4, 16, 8, 8, 6
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 1.0}  # mscale != all_dim: af != 1
DEFAULT = {"rope_type": "default", "rope_theta": 10000.0}


def assert_rel_close(ours, theirs, rel=1e-4):
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    np.testing.assert_allclose(ours, theirs, rtol=rel, atol=rel * np.abs(theirs).max())


def hf_config(q_lora_rank, rope, attention_bias=False):
    cfg = DeepseekV2Config(hidden_size=EMBED, num_attention_heads=HEADS, q_lora_rank=q_lora_rank,
                           kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V,
                           rope_parameters=dict(rope), max_position_embeddings=256, attention_bias=attention_bias)
    cfg._attn_implementation = "eager"
    return cfg


def scaling_from(rope):
    if rope["rope_type"] == "default":
        return NoScaling()
    return YarnScaling(factor=rope["factor"], original_max_position=rope["original_max_position_embeddings"],
                       beta_fast=rope["beta_fast"], beta_slow=rope["beta_slow"], mscale=rope.get("mscale", 0.0),
                       mscale_all_dim=rope.get("mscale_all_dim", 0.0))


def build_mla(q_lora_rank, scaling, use_bias=False, seed=0):
    return MultiHeadLatentAttention(
        EMBED, HEADS, q_lora_rank=q_lora_rank, kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
        v_head_dim=V, inv_freq=scaling.inv_freq(ROPE, 10000.0), softmax_scale=mla_softmax_scale(NOPE + ROPE, scaling),
        rope_attention_factor=rope_attention_factor(scaling), rngs=nnx.Rngs(seed), use_bias=use_bias,
        dtype=jnp.float32)


def copy_hf_weights(ours: MultiHeadLatentAttention, theirs) -> None:
    """HF Linear weights are [out, in]; ours [in, out] with heads split out. kv_a_proj_with_mqa
    holds our kv_down (first kv_lora rows) and k_rope (the rest)."""
    w = {k: v.detach().numpy() for k, v in theirs.state_dict().items()}
    params = nnx.to_pure_dict(nnx.state(ours, nnx.Param))
    if "q_proj.weight" in w:
        params["q"]["kernel"] = w["q_proj.weight"].T.reshape(EMBED, HEADS, NOPE + ROPE)
    else:
        params["q_down"]["kernel"] = w["q_a_proj.weight"].T
        params["q_norm"]["scale"] = w["q_a_layernorm.weight"]
        params["q_up"]["kernel"] = w["q_b_proj.weight"].T.reshape(-1, HEADS, NOPE + ROPE)
        if "q_a_proj.bias" in w:
            params["q_down"]["bias"] = w["q_a_proj.bias"]
    kv_a = w["kv_a_proj_with_mqa.weight"]
    params["kv_down"]["kernel"], params["k_rope"]["kernel"] = kv_a[:KV_LORA].T, kv_a[KV_LORA:].T
    if "kv_a_proj_with_mqa.bias" in w:
        bias = w["kv_a_proj_with_mqa.bias"]
        params["kv_down"]["bias"], params["k_rope"]["bias"] = bias[:KV_LORA], bias[KV_LORA:]
        params["o"]["bias"] = w["o_proj.bias"]
    params["kv_norm"]["scale"] = w["kv_a_layernorm.weight"]
    params["kv_up"]["kernel"] = w["kv_b_proj.weight"].T.reshape(KV_LORA, HEADS, NOPE + V)
    params["o"]["kernel"] = w["o_proj.weight"].T.reshape(HEADS, V, EMBED)
    state = nnx.state(ours, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    nnx.update(ours, state)


def run_hf(attn, cfg, x, positions):
    rotary = hf_ds.DeepseekV2RotaryEmbedding(cfg)
    x_t, pos_t = torch.from_numpy(x), torch.from_numpy(positions.astype(np.int64))
    length = x.shape[1]
    causal = torch.triu(torch.full((length, length), float("-inf")), diagonal=1)[None, None]
    with torch.no_grad():
        out, _ = attn(x_t, attention_mask=causal, position_embeddings=rotary(x_t, pos_t))
    return out.numpy()


@pytest.mark.parametrize("q_lora_rank,rope,bias", [
    (None, DEFAULT, False), (12, DEFAULT, True), (None, YARN, False), (12, YARN, False),
], ids=["direct-q", "q-lora-bias", "direct-q-yarn", "q-lora-yarn"])
def test_matches_transformers_attention(q_lora_rank, rope, bias):
    cfg = hf_config(q_lora_rank, rope, bias)
    torch.manual_seed(0)
    theirs = hf_ds.DeepseekV2Attention(cfg, layer_idx=0).eval()
    with torch.no_grad():  # norms start at 1: make their scales matter
        for norm in (theirs.kv_a_layernorm, theirs.q_a_layernorm):
            if norm is not None:
                norm.weight.uniform_(0.5, 1.5)
        for p in theirs.parameters():  # torch's default init is small; widen so rope/softmax differences show
            p.mul_(3.0)
    ours = build_mla(q_lora_rank, scaling_from(rope), use_bias=bias)
    copy_hf_weights(ours, theirs)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 10, EMBED)).astype(np.float32)
    positions = (np.arange(10)[None] + np.array([[0], [90]])).astype(np.int32)  # row 2 past the original context
    expected = run_hf(theirs, cfg, x, positions)
    graphdef, state = nnx.split(ours)
    got = jax.jit(lambda *args: nnx.merge(graphdef, state)(*args))(x, positions, np.ones((2, 10), np.int32))
    assert_rel_close(got, expected)


def test_packed_row_equals_documents_run_alone():
    graphdef, state = nnx.split(build_mla(12, scaling_from(YARN), seed=3))
    mla = jax.jit(lambda *args: nnx.merge(graphdef, state)(*args))
    rng = np.random.default_rng(1)
    lengths = [4, 7, 3]
    x = rng.standard_normal((1, sum(lengths), EMBED)).astype(np.float32)
    segment_ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)]).astype(np.int32)[None]
    positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)[None]
    packed = np.asarray(mla(jnp.asarray(x), jnp.asarray(positions), jnp.asarray(segment_ids)))
    start = 0
    for n in lengths:
        doc = jnp.asarray(x[:, start:start + n])
        alone = mla(doc, jnp.arange(n, dtype=jnp.int32)[None], jnp.ones((1, n), jnp.int32))
        np.testing.assert_allclose(packed[:, start:start + n], np.asarray(alone), rtol=1e-5, atol=1e-6)
        start += n


def test_same_result_sharded_over_heads():
    mla = build_mla(None, NoScaling(), seed=4)
    graphdef, state = nnx.split(mla)
    x = jax.random.normal(jax.random.key(0), (4, 8, EMBED))
    positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (4, 8))
    segments = jnp.ones((4, 8), jnp.int32)

    def forward(state, x):
        return nnx.merge(graphdef, state)(x, positions, segments)

    single = jax.jit(forward)(state, x)
    mesh = build_mesh(MeshConfig(data=4, tensor=4))
    with use_rules(mesh, get_rule_set("dp")):
        sharded = jax.jit(forward)(state, x)
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(single), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rope", [
    {"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
     "mscale": 0.707, "mscale_all_dim": 0.707},  # DeepSeek-V2's own settings
    {"factor": 8.0, "original_max_position_embeddings": 2048, "mscale": 1.0, "mscale_all_dim": 0.5},
    {"factor": 4.0, "original_max_position_embeddings": 512, "beta_fast": 16, "beta_slow": 2},
    {"factor": 4.0, "original_max_position_embeddings": 512, "mscale_all_dim": 1.0},  # mscale unset
    {"factor": 16.0, "original_max_position_embeddings": 4096, "truncate": False, "attention_factor": 1.3},
])
def test_yarn_matches_transformers(rope):
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, **rope}
    cfg = DeepseekV2Config(hidden_size=256, num_attention_heads=2, qk_rope_head_dim=64, rope_parameters=dict(rope),
                           max_position_embeddings=int(rope["factor"] * rope["original_max_position_embeddings"]))
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    ours = YarnScaling(factor=rope["factor"], original_max_position=rope["original_max_position_embeddings"],
                       beta_fast=rope.get("beta_fast", 32.0), beta_slow=rope.get("beta_slow", 1.0),
                       mscale=rope.get("mscale", 0.0), mscale_all_dim=rope.get("mscale_all_dim", 0.0),
                       attention_factor_override=rope.get("attention_factor"), truncate=rope.get("truncate", True))
    np.testing.assert_allclose(ours.inv_freq(64, 10000.0), inv_freq.numpy(), rtol=1e-6)
    assert ours.attention_factor() == pytest.approx(attention_factor, rel=1e-6)
    assert mla_softmax_scale(192, ours) == pytest.approx(hf_ds.yarn_apply_mscale(rope, 192 ** -0.5), rel=1e-6)
