"""LoRA on DeepSeek-V2 (MLA, dense and shared-expert MLPs, routed experts) and Nemotron-H (Mamba-2
in/out projections, attention, experts) against Hugging Face peft on the transformers model: the
same adapter values trained by AdamW on the same batches give the same losses and adapters; the
base never moves. Routed experts carry one A/B pair per expert (peft's `target_parameters` on the
stacked expert tensors); projections transformers fuses (kv_a_proj_with_mqa, in_proj, gate_up_proj)
share one A, as peft's one adapter on the fused module does."""
from __future__ import annotations

import dataclasses
import re
from unittest import mock

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from helpers import assert_finite, with_train
from hf_tiny_models import save_tiny_deepseek_v2
from jaxtrain import hf
from jaxtrain.training.parallel_plan import ParallelPlan
from jaxtrain.training.train_setup import build_train_setup
from jaxtrain.models.lora import LoraConfig, with_lora
from test_lora import OPT, STEPS, _batch

pytestmark = [pytest.mark.slow]

RANK, ALPHA = 4, 8.0
BATCH, SEQ = 8, 16
TRAIN = with_train(steps=STEPS, global_batch=BATCH, seq_len=SEQ)

# DeepSeek-V2: our target -> (peft target_modules entry or target_parameters entry)
DEEPSEEK_TARGETS = ("q", "kv_a", "kv_b", "o", "gate", "up", "down", "shared_gate", "shared_up", "shared_down",
                    "experts_gate_up", "experts_down")
DEEPSEEK_MODULES = ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DEEPSEEK_PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]


def _peft_model(directory: str, modules, parameters):
    import peft
    import torch
    import transformers

    from peft.utils import transformers_weight_conversion

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                              attn_implementation="eager")
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, bias="none", target_modules=modules,
                             target_parameters=parameters or None)
    # For MoE model types peft rewrites gate_proj/up_proj/down_proj module targets into the stacked
    # expert tensors (rank and alpha doubled for gate_up_proj): its reading of adapters trained on
    # per-expert Linear layers. Here each named module is meant as named, the experts through
    # target_parameters.
    # peft refuses out_proj on Mamba models (CUDA fast paths read its weight directly); on the CPU
    # transformers calls the module, adapter included, so the reference holds.
    with mock.patch.object(transformers_weight_conversion, "_MODEL_TO_CONVERSION_PATTERN", {}), \
            mock.patch("peft.tuners.tuners_utils._check_lora_target_modules_mamba", lambda *args: None):
        return peft.get_peft_model(model, config)


def _adapted(model) -> dict:
    """{(layer, name): module} of every adapted module; `name` is the module's path within its
    decoder layer, or for a wrapped expert tensor the tensor's (`mlp.experts.gate_up_proj`)."""
    from peft.tuners.lora.layer import ParamWrapper

    out = {}
    for name, module in model.named_modules():
        found = re.search(r"layers\.(\d+)\.(.+)$", name)
        if not found or not hasattr(module, "lora_A") or "default" not in module.lora_A:
            continue
        inner = re.sub(r"(\.base_layer)+", "", found.group(2))
        if isinstance(module, ParamWrapper):
            inner = f"{inner}.{module.parameter_name}"
        out[int(found.group(1)), inner] = module
    return out


def _peft_values(model) -> dict:
    return {k: (m.lora_A["default"].weight.detach().numpy().copy(), m.lora_B["default"].weight.detach().numpy().copy())
            for k, m in _adapted(model).items()}


def _peft_run(directory: str, modules, parameters, adapters: dict, vocab: int):
    """(losses, adapters after the steps, the first step's adapter gradients) from peft + torch
    AdamW, starting from `adapters`; gradients as {key: (grad of lora_A, grad of lora_B)}."""
    import torch

    model = _peft_model(directory, modules, parameters)
    adapted = _adapted(model)
    assert set(adapted) == set(adapters)
    with torch.no_grad():
        for key, module in adapted.items():
            module.lora_A["default"].weight.copy_(torch.from_numpy(adapters[key][0]))
            module.lora_B["default"].weight.copy_(torch.from_numpy(adapters[key][1]))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == 2 * len(adapters)  # peft froze the base
    optimizer = torch.optim.AdamW(trainable, lr=OPT.learning_rate, betas=(OPT.b1, OPT.b2), eps=OPT.eps,
                                  weight_decay=OPT.weight_decay)
    losses = []
    for i in range(STEPS):
        batch = _batch(i, vocab)
        logits = model(input_ids=torch.from_numpy(batch["inputs"]).long()).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab),
                                                 torch.from_numpy(batch["targets"]).long().reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        if i == 0:
            first = {k: (m.lora_A["default"].weight.grad.numpy().copy(), m.lora_B["default"].weight.grad.numpy().copy())
                     for k, m in adapted.items()}
        optimizer.step()
        losses.append(loss.item())
    return np.array(losses), _peft_values(model), first


def _random_like(values: dict, seed: int) -> dict:
    """Random adapter values in peft's layout, A like peft's init and B nonzero (so both factors
    get gradients from the first step)."""
    rng = np.random.default_rng(seed)
    return {k: (rng.uniform(-1, 1, a.shape).astype(np.float32) / np.sqrt(a.shape[1]),
                0.1 * rng.standard_normal(b.shape).astype(np.float32)) for k, (a, b) in sorted(values.items())}


def _expert_factors(a, b, experts: int):
    """peft's stacked-expert factors (A [rank * E, in], B [out, rank * E], expert e's A rows
    e*rank.., B columns j*E + e) as ours per expert: A [E, in, rank], B [E, rank, out]."""
    a_e = a.reshape(experts, RANK, a.shape[1]).transpose(0, 2, 1)
    b_e = b.reshape(b.shape[0], RANK, experts).transpose(2, 1, 0)
    return a_e, b_e


def _deepseek_ours(base: dict, adapters: dict, config) -> dict:
    """Our parameters: the base with peft's adapters as ours (A = lora_A^T, B = lora_B^T reshaped to
    the kernel's sides), stacked over each stack's layers."""
    params = jax.tree.map(np.array, base)
    h, e = config.heads, config.router.num_experts
    kv, i_e = config.kv_lora_rank, config.expert_mlp
    per_layer = {}
    for (layer, name), (a, b) in adapters.items():
        stack, index = (("dense_blocks", layer) if layer < config.first_k_dense
                        else ("moe_blocks", layer - config.first_k_dense))

        def put(path, value, stack=stack, index=index):
            per_layer.setdefault((stack, path), {})[index] = value

        at, bt = a.T, b.T  # [in, rank], [rank, out]
        if name == "self_attn.q_proj":
            put("attn/q/adapter/a", at), put("attn/q/adapter/b", bt.reshape(RANK, h, -1))
        elif name == "self_attn.kv_a_proj_with_mqa":
            put("attn/adapter_kv_a/a", at)
            put("attn/adapter_kv_a/b/kv_down", bt[:, :kv]), put("attn/adapter_kv_a/b/k_rope", bt[:, kv:])
        elif name == "self_attn.kv_b_proj":
            put("attn/kv_up/adapter/a", at), put("attn/kv_up/adapter/b", bt.reshape(RANK, h, -1))
        elif name == "self_attn.o_proj":
            put("attn/o/adapter/a", at.reshape(h, -1, RANK)), put("attn/o/adapter/b", bt)
        elif name.startswith("mlp.experts."):
            a_e, b_e = _expert_factors(a, b, e)
            if name.endswith("gate_up_proj"):
                put("moe/experts/adapter/gate_up/a", a_e)
                put("moe/experts/adapter/gate_up/b/gate", b_e[..., :i_e])
                put("moe/experts/adapter/gate_up/b/up", b_e[..., i_e:])
            else:
                put("moe/experts/adapter/down/a", a_e), put("moe/experts/adapter/down/b/down", b_e)
        else:  # mlp.{gate,up,down}_proj or mlp.shared_experts.{gate,up,down}_proj
            group = "moe/shared" if "shared_experts" in name else "mlp"
            proj = name.rsplit(".", 1)[1].removesuffix("_proj")
            put(f"{group}/{proj}/adapter/a", at), put(f"{group}/{proj}/adapter/b", bt)
    for (stack, path), by_index in per_layer.items():
        node = params["stacks"][stack]["layers"]
        keys = path.split("/")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = np.stack([by_index[i] for i in range(len(by_index))])
    return params


def _without_adapters(tree):
    if not isinstance(tree, dict):
        return tree
    return {k: _without_adapters(v) for k, v in tree.items() if not k.startswith("adapter")}


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    directory = save_tiny_deepseek_v2(tmp_path_factory.mktemp("lora_deepseek"), seed=3, num_hidden_layers=2)
    _, config = hf.read_config(directory)
    config = dataclasses.replace(config, router=dataclasses.replace(config.router, aux_loss_weight=0.0,
                                                                    z_loss_weight=0.0))
    base = jax.device_get(nnx.to_pure_dict(nnx.state(hf.load(directory))))
    adapters = _random_like(_peft_values(_peft_model(directory, DEEPSEEK_MODULES, DEEPSEEK_PARAMETERS)), seed=11)
    reference = _peft_run(directory, DEEPSEEK_MODULES, DEEPSEEK_PARAMETERS, adapters, config.vocab_size)
    return config, base, adapters, reference


def _train(cfg, spec: str, init: dict, vocab: int):
    """(losses, params after the steps, the first step's gradients {path: array} of the adapters)
    of our train step from `init`, laid out by `spec` (a layout string) on the devices it needs."""
    plan = ParallelPlan.parse(spec)
    devices = jax.devices()[:plan.device_count()]
    setup = build_train_setup(cfg, plan, TRAIN, OPT, devices)
    state = setup.state_from_params(init)
    losses = []
    for i in range(STEPS):
        state, metrics = setup.train_step(state, setup.device_batch(_batch(i, vocab)))
        losses.append(float(metrics["loss"]))
        if i == 0:  # Adam's first moment after one step from zero is (1 - b1) x the gradient
            moments = setup.state.to_disk({"opt_state": state.opt_state})["opt_state"]  # canonical stacks
            first = {k: v / (1 - OPT.b1) for k, v in _leaves(
                jax.device_get(optax.tree_utils.tree_get(moments, "mu"))).items()}
    return np.array(losses), jax.device_get(setup.state.to_disk({"params": state.params})["params"]), first


def _leaves(tree) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _check_trajectory(ours: tuple, reference: tuple, ours_before: dict, base: dict, to_ours):
    """`ours`: _train's result; `reference`: _peft_run's; `to_ours`: peft's adapter tree as our
    parameters."""
    losses, params, first = ours
    ref_losses, ref_adapters, ref_first = reference
    assert_finite(ref_losses, "peft losses")
    want_first = {k: v for k, v in _leaves(to_ours(ref_first)).items() if "adapter" in k}
    assert set(first) == set(want_first)
    # The tight check: the first step's gradients, relative to each tensor's largest (float32
    # sums in another order differ far below this).
    for key, want in want_first.items():
        np.testing.assert_allclose(first[key], want, rtol=0, atol=1e-5 * np.abs(want).max(), err_msg=key)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # Adam moves an entry by lr * m / (sqrt(v) + eps): about lr whatever its gradient's size. An
    # entry whose gradient is tiny (within a few eps) moves by lr * g / (|g| + eps) on the first
    # step, so a rounding difference far inside the gradient check above still shifts it by a
    # part of a step that no later step undoes (a Mamba scan summed in another order than
    # torch's: 1.1e-3 of a step per step seen). The values after the steps are therefore held to
    # 2e-3 of a step per step, which a wrong gradient or update rule exceeds at once.
    atol = 2e-3 * OPT.learning_rate * STEPS
    got, before = _leaves(params), _leaves(ours_before)
    for key, want in _leaves(to_ours(ref_adapters)).items():
        if "adapter" not in key:
            continue
        np.testing.assert_allclose(got[key], want, rtol=0, atol=atol, err_msg=key)
        assert np.abs(want - before[key]).max() > 100 * atol, f"{key} did not train"
    for (path, b), after in zip(jax.tree_util.tree_leaves_with_path(base),
                                jax.tree.leaves(_without_adapters(params))):
        np.testing.assert_array_equal(np.asarray(after), np.asarray(b), err_msg=jax.tree_util.keystr(path))


# one device; 8 experts over expert=4 (tokens over data x expert), heads over tensor, FSDP over
# data; the dense layer and the MoE layer on two pipeline stages, two microbatches streaming; two
# device groups taking 6 and 2 rows of each batch
DEEPSEEK_LAYOUTS = {"one_device": "data=1",
                    "data2_expert4_tensor2": "data=2,expert=4,tensor=2,rules=fsdp",
                    "pipeline2_data2_expert2_tensor2": "pipeline=2,data=2,expert=2,tensor=2,rules=fsdp,microbatches=2",
                    "groups6_2_data2_tensor2": "data=2,tensor=2,rules=fsdp,microbatches=4,groups=6/2"}


# the device groups run in `make test-extended` (the suite's budget)
@pytest.mark.parametrize("layout", [pytest.param(name, marks=[pytest.mark.extended] if name.startswith("groups") else [])
                                    for name in DEEPSEEK_LAYOUTS])
def test_deepseek_trajectory_matches_peft(deepseek, layout):
    config, base, adapters, reference = deepseek
    cfg = with_lora(config, LoraConfig(rank=RANK, alpha=ALPHA, targets=DEEPSEEK_TARGETS))
    init = _deepseek_ours(base, adapters, config)
    ours = _train(cfg, DEEPSEEK_LAYOUTS[layout], init, config.vocab_size)
    _check_trajectory(ours, reference, init, base, lambda adapters: _deepseek_ours(base, adapters, config))


def test_mla_latent_path_and_decode_apply_the_kv_b_adapter():
    """MLA's latent attention and its absorbed decode use kv_up's weight rather than calling it:
    with an adapter on kv_b (kv_up) both must use kernel + scale * A @ B. Reference: the same MLA
    without an adapter, its kv_up kernel merged by hand, on the per-head (materialized) path."""
    import jax.numpy as jnp

    from jaxtrain.models.layers.attention_impl import BlockwiseAttention, MaterializedAttention
    from jaxtrain.models.lora import add_adapters
    from test_generate_mla import (BATCH, EMBED, MAX_LEN, NEW, PROMPT, VALID_FROM, assert_rel_close, build_mla,
                                   generation_fns, left_padded)

    lora = LoraConfig(rank=RANK, alpha=ALPHA, targets=("kv_b",))
    adapted = add_adapters(build_mla(None, BlockwiseAttention(), seed=4), lora, {"kv_b": "kv_up"}, nnx.Rngs(5))
    rng = np.random.default_rng(6)
    a = rng.standard_normal(adapted.kv_up.adapter.a.shape).astype(np.float32)
    b = rng.standard_normal(adapted.kv_up.adapter.b.shape).astype(np.float32)
    adapted.kv_up.adapter.a[...], adapted.kv_up.adapter.b[...] = jnp.asarray(a), jnp.asarray(b)
    merged = build_mla(None, MaterializedAttention(), seed=4)
    kernel = np.asarray(merged.kv_up.kernel[...])
    merged.kv_up.kernel[...] = jnp.asarray(kernel + lora.scale * np.tensordot(a, b, axes=1))

    total = PROMPT + NEW
    x = rng.standard_normal((BATCH, total, EMBED)).astype(np.float32)
    positions, segment_ids = left_padded(total)
    real = segment_ids.astype(bool)
    expected = np.asarray(generation_fns(merged)[0](x, positions, segment_ids))
    forward, prefill, decode = generation_fns(adapted)
    assert_rel_close(np.asarray(forward(x, positions, segment_ids))[real], expected[real])
    cache = adapted.init_cache(BATCH, MAX_LEN, jnp.float32)
    _, cache = prefill(x[:, :PROMPT], positions[:, :PROMPT], segment_ids[:, :PROMPT], cache)
    for t in range(PROMPT, total):
        out, cache = decode(x[:, t:t + 1], positions[:, t:t + 1], cache, jnp.int32(t), VALID_FROM)
        assert_rel_close(out[:, 0], expected[:, t])


# Nemotron-H: every target of the family's table but the latent projections (the tiny model has none)
NEMOTRON_TARGETS = ("in_proj", "out_proj", "q", "k", "v", "o", "up", "down", "shared_up", "shared_down",
                    "experts_up", "experts_down")
NEMOTRON_MODULES = ["in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
NEMOTRON_PARAMETERS = ["experts.up_proj", "experts.down_proj"]


def _nemotron_ours(base: dict, adapters: dict, config) -> dict:
    """Our parameters: the base with peft's adapters as ours. HF layer i is layer `i`'s kind's
    next layer in our pattern stack; in_proj's B rows are [z | x | B | C | dt] (one A shared)."""
    params = jax.tree.map(np.array, base)
    ssm, h, kv, hd = config.ssm, config.heads, config.kv_heads, config.head_dim
    inner, gn = ssm.heads * ssm.head_dim, ssm.groups * ssm.state
    kinds = list(config.pattern)
    per_layer = {}
    for (layer, name), (a, b) in adapters.items():
        kind = kinds[layer]
        index = kinds[:layer].count(kind)

        def put(path, value, kind=kind, index=index):
            per_layer.setdefault((kind, path), {})[index] = value

        at, bt = a.T, b.T  # [in, rank], [rank, out]
        if name == "mixer.in_proj":
            put("mixer/adapter_in_proj/a", at)
            rows = {"in_z": (0, inner), "in_x": (inner, 2 * inner), "in_b": (2 * inner, 2 * inner + gn),
                    "in_c": (2 * inner + gn, 2 * inner + 2 * gn), "in_dt": (2 * inner + 2 * gn, None)}
            shapes = {"in_z": (ssm.heads, ssm.head_dim), "in_x": (ssm.heads, ssm.head_dim),
                      "in_b": (ssm.groups, ssm.state), "in_c": (ssm.groups, ssm.state), "in_dt": (ssm.heads,)}
            for proj, (start, stop) in rows.items():
                put(f"mixer/adapter_in_proj/b/{proj}", bt[:, start:stop].reshape(RANK, *shapes[proj]))
        elif name == "mixer.out_proj":
            put("mixer/out/adapter/a", at.reshape(ssm.heads, ssm.head_dim, RANK)), put("mixer/out/adapter/b", bt)
        elif name in ("mixer.q_proj", "mixer.k_proj", "mixer.v_proj"):
            proj = name[len("mixer."):][0]
            put(f"attn/{proj}/adapter/a", at), put(f"attn/{proj}/adapter/b", bt.reshape(RANK, h if proj == "q" else kv, hd))
        elif name == "mixer.o_proj":
            put("attn/o/adapter/a", at.reshape(h, hd, RANK)), put("attn/o/adapter/b", bt)
        elif name.startswith("mixer.experts."):
            proj = name.rsplit(".", 1)[1].removesuffix("_proj")
            a_e, b_e = _expert_factors(a, b, config.router.num_experts)
            put(f"moe/experts/adapter/{proj}/a", a_e), put(f"moe/experts/adapter/{proj}/b/{proj}", b_e)
        else:  # mixer.{up,down}_proj or mixer.shared_experts.{up,down}_proj
            group = "moe/shared" if "shared_experts" in name else "mlp"
            proj = name.rsplit(".", 1)[1].removesuffix("_proj")
            put(f"{group}/{proj}/adapter/a", at), put(f"{group}/{proj}/adapter/b", bt)
    for (kind, path), by_index in per_layer.items():
        node = params["stacks"]["blocks"][kind]["layers"]
        keys = path.split("/")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = np.stack([by_index[i] for i in range(len(by_index))])
    return params


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    from hf_tiny_models import save_tiny_nemotron_h

    directory = save_tiny_nemotron_h(tmp_path_factory.mktemp("lora_nemotron"), seed=5)
    _, config = hf.read_config(directory)
    # a bias that would follow the load in a full fine-tune: the frozen base's must not
    config = dataclasses.replace(config, router=dataclasses.replace(config.router, aux_loss_weight=0.0,
                                                                    z_loss_weight=0.0, bias_update_rate=0.01))
    base = jax.device_get(nnx.to_pure_dict(nnx.state(hf.load(directory))))
    adapters = _random_like(_peft_values(_peft_model(directory, NEMOTRON_MODULES, NEMOTRON_PARAMETERS)), seed=13)
    reference = _peft_run(directory, NEMOTRON_MODULES, NEMOTRON_PARAMETERS, adapters, config.vocab_size)
    return config, base, adapters, reference


# one device; experts over expert=4 and heads over tensor with the Mamba layers' heads split too
NEMOTRON_LAYOUTS = {"one_device": "data=1", "data2_expert4_tensor2": "data=2,expert=4,tensor=2,rules=fsdp"}


# the 16-device layout runs in `make test-extended` (the suite's budget; DeepSeek-V2's keep adapters
# over expert and pipeline layouts in the suite)
@pytest.mark.parametrize("layout", [pytest.param(name, marks=[pytest.mark.extended] if name != "one_device" else [])
                                    for name in NEMOTRON_LAYOUTS])
def test_nemotron_h_trajectory_matches_peft(nemotron, layout):
    """Mamba-2 in_proj (one A over the five projections HF fuses) and out_proj, attention, MLP,
    shared and routed experts; the router's correction bias, a base parameter, stays put."""
    config, base, adapters, reference = nemotron
    assert config.router.correction_bias and config.router.bias_update_rate > 0
    cfg = with_lora(config, LoraConfig(rank=RANK, alpha=ALPHA, targets=NEMOTRON_TARGETS))
    init = _nemotron_ours(base, adapters, config)
    ours = _train(cfg, NEMOTRON_LAYOUTS[layout], init, config.vocab_size)
    _check_trajectory(ours, reference, init, base, lambda adapters: _nemotron_ours(base, adapters, config))
