"""LoRA adapters (models/lora.py) against Hugging Face peft on the transformers model: the same
adapter values trained by AdamW on the same batches give the same losses and adapters, on one
device and on 16; the base never moves, gets no gradient and no optimizer state."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import assert_finite, train_losses, with_train
from hf_tiny_models import save_tiny_llama
from jaxtrain import hf
from jaxtrain.training.optim import OptimizerConfig
from jaxtrain.training.parallel_plan import ParallelPlan
from jaxtrain.training.train_setup import build_train_setup
from jaxtrain.meshes.mesh import MeshConfig
from jaxtrain.models.llama import LlamaConfig
from jaxtrain.models.lora import LoraConfig, with_lora

pytestmark = [pytest.mark.slow]

# our target -> (module group in a Llama block, the transformers module name)
TARGETS = {"q": ("attn", "self_attn.q_proj"), "k": ("attn", "self_attn.k_proj"), "v": ("attn", "self_attn.v_proj"),
           "o": ("attn", "self_attn.o_proj"), "gate": ("mlp", "mlp.gate_proj"), "up": ("mlp", "mlp.up_proj"),
           "down": ("mlp", "mlp.down_proj")}
RANK, ALPHA = 4, 8.0
LORA = LoraConfig(rank=RANK, alpha=ALPHA, targets=tuple(TARGETS))
# constant learning rate, no clipping: both sides run plain AdamW with decoupled weight decay
OPT = OptimizerConfig(learning_rate=1e-2, warmup_steps=0, decay="constant", b1=0.9, b2=0.95, eps=1e-8,
                      weight_decay=0.1, clip_norm=None)
STEPS, BATCH, SEQ = 6, 8, 16
TRAIN = with_train(steps=STEPS, global_batch=BATCH, seq_len=SEQ)
TINY = LlamaConfig(vocab_size=96, embed=32, layers=2, heads=4, kv_heads=2, mlp=64)


def _batch(i: int, vocab: int) -> dict:
    rng = np.random.default_rng(1000 + i)
    return dict(inputs=rng.integers(0, vocab, (BATCH, SEQ), dtype=np.int32),
                targets=rng.integers(0, vocab, (BATCH, SEQ), dtype=np.int32),
                segment_ids=np.ones((BATCH, SEQ), np.int32),
                positions=np.broadcast_to(np.arange(SEQ, dtype=np.int32), (BATCH, SEQ)).copy(),
                loss_mask=np.ones((BATCH, SEQ), np.float32))


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """A tiny random HF Llama, its config and parameters as ours, and random adapter values in
    peft's layout ({(layer, target): (lora_A [rank, in], lora_B [out, rank])}), B nonzero so both
    factors get gradients from the first step."""
    directory = save_tiny_llama(tmp_path_factory.mktemp("lora_llama"), seed=5, vocab_size=97, hidden_size=32,
                                intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2)
    _, config = hf.read_config(directory)
    base_params = jax.device_get(nnx.to_pure_dict(nnx.state(hf.load(directory))))
    rng = np.random.default_rng(7)
    layer = base_params["stacks"]["blocks"]["layers"]
    adapters = {}
    for target, (group, _) in TARGETS.items():
        kernel = layer[group][target]["kernel"]  # [layers, in..., out...]
        n_in = 2 if target == "o" else 1
        fan_in, fan_out = int(np.prod(kernel.shape[1:1 + n_in])), int(np.prod(kernel.shape[1 + n_in:]))
        for i in range(config.layers):
            adapters[i, target] = (rng.uniform(-1, 1, (RANK, fan_in)).astype(np.float32) / np.sqrt(fan_in),
                                   0.1 * rng.standard_normal((fan_out, RANK)).astype(np.float32))
    return directory, config, base_params, adapters


def _ours(base_params: dict, adapters: dict, layers: int) -> dict:
    """Our parameters: the base with each target's adapter stacked over layers (A = lora_A^T,
    B = lora_B^T, each reshaped to the kernel's input / output dimensions)."""
    params = jax.tree.map(np.array, base_params)
    layer = params["stacks"]["blocks"]["layers"]
    for target, (group, _) in TARGETS.items():
        kernel = layer[group][target]["kernel"]
        n_in = 2 if target == "o" else 1
        in_shape, out_shape = kernel.shape[1:1 + n_in], kernel.shape[1 + n_in:]
        a = np.stack([adapters[i, target][0].T.reshape(*in_shape, RANK) for i in range(layers)])
        b = np.stack([adapters[i, target][1].T.reshape(RANK, *out_shape) for i in range(layers)])
        layer[group][target]["adapter"] = {"a": a, "b": b}
    return params


def _peft_run(directory: str, adapters: dict, vocab: int):
    """(losses, {(layer, target): (lora_A, lora_B)} after the steps) from peft + torch AdamW."""
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                              attn_implementation="eager")
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, bias="none",
        target_modules=sorted({name.split(".")[-1] for _, name in TARGETS.values()})))
    by_hf_name = {name: target for target, (_, name) in TARGETS.items()}
    modules = {}
    for name, module in model.named_modules():
        found = re.search(r"layers\.(\d+)\.(\w+\.\w+)$", name)
        if found and hasattr(module, "lora_A"):
            key = (int(found.group(1)), by_hf_name[found.group(2)])
            modules[key] = module
            with torch.no_grad():
                module.lora_A["default"].weight.copy_(torch.from_numpy(adapters[key][0]))
                module.lora_B["default"].weight.copy_(torch.from_numpy(adapters[key][1]))
    assert set(modules) == set(adapters)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == 2 * len(adapters)  # peft froze the base
    optimizer = torch.optim.AdamW(trainable, lr=OPT.learning_rate, betas=(OPT.b1, OPT.b2), eps=OPT.eps,
                                  weight_decay=OPT.weight_decay)
    losses = []
    for i in range(STEPS):
        batch = _batch(i, vocab)
        logits = model(input_ids=torch.from_numpy(batch["inputs"]).long()).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), torch.from_numpy(batch["targets"]).long()
                                                 .reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    trained = {k: (m.lora_A["default"].weight.detach().numpy().copy(), m.lora_B["default"].weight.detach().numpy().copy())
               for k, m in modules.items()}
    return np.array(losses), trained


@pytest.fixture(scope="module")
def reference(case):
    directory, config, _, adapters = case
    return _peft_run(directory, adapters, config.vocab_size)


@pytest.mark.parametrize("layout", ["one_device", "fsdp_data4_tensor2_expert2"])
def test_trajectory_matches_peft(case, reference, layout):
    directory, config, base_params, adapters = case
    ref_losses, ref_adapters = reference
    cfg = with_lora(config, LORA)
    init = _ours(base_params, adapters, config.layers)
    if layout == "one_device":
        mesh, rules, devices = MeshConfig(), "dp", jax.devices()[:1]
    else:
        mesh, rules, devices = MeshConfig(data=4, tensor=2, expert=2), "fsdp", jax.devices()
    losses, params = train_losses(mesh, model=cfg, train=TRAIN, opt=OPT, rules=rules, devices=devices,
                                  steps=STEPS, init_params=init, batch_fn=lambda i: _batch(i, config.vocab_size))
    assert_finite(ref_losses, "peft losses")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    ours_after = _ours(base_params, ref_adapters, config.layers)
    layer, ref_layer = params["stacks"]["blocks"]["layers"], ours_after["stacks"]["blocks"]["layers"]
    for target, (group, _) in TARGETS.items():
        for factor in ("a", "b"):
            got, want = layer[group][target]["adapter"][factor], ref_layer[group][target]["adapter"][factor]
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=f"{target}/{factor}")
            moved = np.abs(want - init["stacks"]["blocks"]["layers"][group][target]["adapter"][factor]).max()
            assert moved > 1e-3, f"{target}/{factor} did not train"
    # the base is bitwise what it was
    for (path, before), after in zip(jax.tree_util.tree_leaves_with_path(base_params),
                                     jax.tree.leaves(_without_adapters(params))):
        np.testing.assert_array_equal(np.asarray(after), np.asarray(before), err_msg=jax.tree_util.keystr(path))


def _without_adapters(tree):
    if not isinstance(tree, dict):
        return tree
    return {k: _without_adapters(v) for k, v in tree.items() if k != "adapter"}


def test_zero_b_starts_as_the_base():
    """Freshly initialized adapters (B = 0) leave every logit bitwise equal to the base model's."""
    cfg = with_lora(TINY, LoraConfig(rank=RANK, alpha=ALPHA, targets=tuple(TARGETS)))
    key = jax.random.key(3)
    base, adapted = TINY.build(nnx.Rngs(params=key)), cfg.build(nnx.Rngs(params=key))
    adapted_params = nnx.to_pure_dict(nnx.state(adapted))
    np.testing.assert_equal(jax.device_get(nnx.to_pure_dict(nnx.state(base))),
                            jax.device_get(_without_adapters(adapted_params)))
    q = adapted_params["stacks"]["blocks"]["layers"]["attn"]["q"]["adapter"]
    assert not np.asarray(q["b"]).any() and np.asarray(q["a"]).std() > 0
    bound = 1 / np.sqrt(TINY.embed)  # peft's kaiming-uniform(a=sqrt(5)) over fan_in = embed
    assert np.abs(q["a"]).max() <= bound and np.abs(q["a"]).max() > 0.9 * bound
    tokens = np.random.default_rng(0).integers(0, TINY.vocab_size, (2, 16)).astype(np.int32)
    logits = [np.asarray(jax.jit(lambda s, t, g=g: nnx.merge(g, s)(t))(s, tokens))
              for g, s in (nnx.split(base), nnx.split(adapted))]
    assert_finite(logits)
    np.testing.assert_array_equal(logits[1], logits[0])


def test_base_gets_no_gradient_and_no_optimizer_state():
    cfg = with_lora(TINY, LoraConfig(rank=RANK, alpha=ALPHA, targets=("q", "v", "down")))
    plan = ParallelPlan(mesh=MeshConfig(data=2, tensor=2), rules="fsdp")
    setup = build_train_setup(cfg, plan, TRAIN, OPT, jax.devices()[:4])
    abstract = setup.state.abstract
    adapter_paths = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(abstract.params)
                     if "adapter" in jax.tree_util.keystr(p)}
    adapter_size = sum(x.size for p, x in jax.tree_util.tree_leaves_with_path(abstract.params)
                       if jax.tree_util.keystr(p) in adapter_paths)
    assert len(adapter_paths) == 3 * 2 and adapter_size == cfg.adapter_count()
    # Adam's two moments of the adapters and scalar counts: nothing the size of a base weight
    opt_leaves = jax.tree_util.tree_leaves_with_path(abstract.opt_state)
    arrays = [(jax.tree_util.keystr(p), x) for p, x in opt_leaves if x.ndim > 0]
    assert all("adapter" in path for path, _ in arrays), [p for p, _ in arrays if "adapter" not in p]
    assert sum(x.size for _, x in arrays) == 2 * adapter_size
    assert sum(x.size for _, x in opt_leaves) - 2 * adapter_size <= 4
    # the gradient strategy differentiates the adapters only
    batch = setup.abstract_batch(TRAIN.global_batch, TRAIN.seq_len)
    grads, _, _ = jax.eval_shape(setup.gradients, abstract.params, batch, jnp.float32(1.0))
    grad_paths = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(grads)}
    assert grad_paths == adapter_paths
    assert sum(x.size for x in jax.tree.leaves(grads)) == adapter_size
    # and the sharding of each factor follows the weight it adapts: A's embed over the FSDP
    # axes like the kernel's, B's heads over tensor like the kernel's; FSDP stores the rank over
    # the axes the factor's other names leave free (A's: tensor, B's: data), so every factor is
    # split over all four devices, and Adam's moments are laid out like the factors
    q = setup.state.shardings.params["stacks"]["blocks"]["layers"]["attn"]["q"]
    assert q["kernel"].spec[1] == q["adapter"]["a"].spec[1] == "data"
    assert q["kernel"].spec[2] == q["adapter"]["b"].spec[2] == "tensor"
    assert q["adapter"]["a"].spec[2] == "tensor" and q["adapter"]["b"].spec[1] == "data"
    for tree in (setup.state.shardings.params, setup.state.shardings.opt_state):
        for path, sharding in jax.tree_util.tree_leaves_with_path(tree):
            if "adapter" in jax.tree_util.keystr(path):
                assert {"data", "tensor"} <= set(jax.tree.leaves(tuple(sharding.spec))), jax.tree_util.keystr(path)


@pytest.mark.parametrize("rules", ["fsdp", "zero1", "dp"])
def test_planner_counts_what_a_lora_run_holds(rules):
    """The planner's state bytes (jaxtrain/planner/state_bytes.py) of a LoRA run equal what its
    placed state holds per device: the frozen base as parameters only, Adam moments for the
    adapters only, laid out like them."""
    from jaxtrain.planner.state_bytes import state_bytes, state_shapes
    from jaxtrain.meshes.rules import get_rule_set

    cfg = with_lora(TINY, LoraConfig(rank=RANK, alpha=ALPHA, targets=tuple(TARGETS)))
    mesh = MeshConfig(data=4, tensor=2)
    setup = build_train_setup(cfg, ParallelPlan(mesh=mesh, rules=rules), TRAIN, OPT, jax.devices()[:8])

    def held(tree, shardings):
        return sum(np.dtype(x.dtype).itemsize * int(np.prod(s.shard_shape(x.shape)))
                   for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))

    abstract, shardings = setup.state.abstract, setup.state.shardings
    planned = state_bytes(state_shapes(cfg, setup.tx), mesh.sizes(), get_rule_set(rules))
    assert planned.params == held(abstract.params, shardings.params) > 0
    assert planned.optimizer == held(abstract.opt_state, shardings.opt_state) > 0
    adapter_bytes = 4 * cfg.adapter_count()
    assert planned.optimizer < 2 * adapter_bytes + 64  # two moments of the adapters at most, and counts


@pytest.mark.parametrize("make, message", [
    (lambda: LoraConfig(rank=0), r"LoraConfig\.rank must be a positive integer, got 0"),
    (lambda: LoraConfig(rank=-2), r"LoraConfig\.rank must be a positive integer, got -2"),
    (lambda: LoraConfig(alpha=0.0), r"LoraConfig\.alpha must be positive, got 0\.0"),
    (lambda: LoraConfig(init="xavier"), r"LoraConfig\.init='xavier': choose one of kaiming, gaussian"),
    (lambda: with_lora(TINY, LoraConfig(targets=("q_proj",))),
     r"unknown target 'q_proj' for model family 'llama' \(choose from q, k, v, o, gate, up, down\)"),
])
def test_bad_config_is_one_line(make, message):
    with pytest.raises(ValueError, match=message) as raised:
        make()
    assert "\n" not in str(raised.value)


def test_family_without_targets_is_an_error():
    from jaxtrain.models.mamba2 import Mamba2Config
    with pytest.raises(ValueError, match=r"model family 'mamba2' declares no adapter targets"):
        with_lora(Mamba2Config(), LoraConfig())


def test_accumulated_microbatches_match_one_batch():
    """Gradient accumulation differentiates the adapters alone as well: two microbatches give the
    one-batch losses and adapters."""
    cfg = with_lora(TINY, LoraConfig(rank=RANK, alpha=ALPHA, targets=("k", "o", "up")))
    init = jax.device_get(nnx.to_pure_dict(nnx.state(cfg.build(nnx.Rngs(params=jax.random.key(1))))))
    layer = init["stacks"]["blocks"]["layers"]
    for group, target in (("attn", "k"), ("attn", "o"), ("mlp", "up")):  # B nonzero: every factor trains
        b = layer[group][target]["adapter"]["b"]
        layer[group][target]["adapter"]["b"] = 0.1 * np.random.default_rng(2).standard_normal(b.shape).astype(b.dtype)
    runs = [train_losses(MeshConfig(), model=cfg, train=with_train(steps=3, global_batch=8, seq_len=SEQ,
                                                                    microbatches=m),
                         opt=OPT, devices=jax.devices()[:1], steps=3, init_params=init) for m in (1, 2)]
    np.testing.assert_allclose(runs[1][0], runs[0][0], rtol=1e-5)
    for (path, one), two in zip(jax.tree_util.tree_leaves_with_path(runs[0][1]), jax.tree.leaves(runs[1][1])):
        np.testing.assert_allclose(two, one, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))
