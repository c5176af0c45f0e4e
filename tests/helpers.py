"""Shared builders for tests: tiny models, random packed batches, short training runs."""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.extend
import numpy as np
from flax import nnx

from jaxtrain.training.config import TrainConfig
from jaxtrain.training.optim import OptimizerConfig
from jaxtrain.training.parallel_plan import ParallelPlan
from jaxtrain.training.train_setup import build_train_setup
from jaxtrain.meshes.mesh import MeshConfig
from jaxtrain.models.llama import LlamaConfig

TINY_LLAMA = LlamaConfig(vocab_size=96, embed=32, layers=2, heads=4, kv_heads=4, mlp=64)
# For runs on the corpus (the byte tokenizer's 259 ids): a smaller vocabulary would look up
# embeddings out of range and train on NaN. TINY_LLAMA stays for random batches within 96 ids.
TINY_LLAMA_BYTES = dataclasses.replace(TINY_LLAMA, vocab_size=272)
TINY_TRAIN = TrainConfig(steps=3, global_batch=16, seq_len=16)
TINY_OPT = OptimizerConfig(learning_rate=1e-2, warmup_steps=1)


def random_packed_batch(seed: int, batch: int, length: int, vocab: int) -> dict:
    """Rows of 1-3 documents each, with segment ids, per-document positions and a loss mask."""
    rng = np.random.default_rng(seed)
    inputs = rng.integers(0, vocab, (batch, length), dtype=np.int32)
    targets = rng.integers(0, vocab, (batch, length), dtype=np.int32)
    segment_ids = np.zeros((batch, length), np.int32)
    positions = np.zeros((batch, length), np.int32)
    for r in range(batch):
        cuts = sorted(rng.choice(np.arange(1, length), size=rng.integers(0, 3), replace=False))
        bounds = [0, *cuts, length]
        for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            segment_ids[r, a:b] = s + 1
            positions[r, a:b] = np.arange(b - a)
    loss_mask = np.ones((batch, length), np.float32)
    loss_mask[:, -1] = 0.0
    return dict(inputs=inputs, targets=targets, segment_ids=segment_ids, positions=positions, loss_mask=loss_mask)


def train_losses(mesh_cfg: MeshConfig, *, model=TINY_LLAMA, train=TINY_TRAIN, opt=TINY_OPT, rules="dp",
                 devices=None, steps: int = 3, seed: int = 0, with_metrics: bool = False, init_params=None,
                 batch_fn=None, jaxprs: list | None = None, allow_nonfinite: bool = False):
    """Runs `steps` train steps on fresh random batches; returns (losses, final params on host)
    and, with `with_metrics`, the per-step metrics on host. `init_params` (a host tree) replaces
    the seeded initialization, which saves compiling it again for every layout. `batch_fn(i)`
    gives step i's host batch (default: random_packed_batch seeded 100 + i); `jaxprs`, a list,
    receives the train step's jaxpr (traced on the first batch). The losses and parameters must
    be finite (two NaN runs compare equal) unless `allow_nonfinite`."""
    plan = ParallelPlan(mesh=mesh_cfg, rules=rules, microbatches=train.microbatches,
                        context_parallel=train.context_parallel)
    setup = build_train_setup(model, plan, train, opt, devices if devices is not None else jax.devices())
    step_fn = setup.train_step
    state = setup.state.init(seed) if init_params is None else setup.state_from_params(init_params)
    losses, history = [], []
    for i in range(steps):
        host = (batch_fn(i) if batch_fn is not None
                else random_packed_batch(100 + i, train.global_batch, train.seq_len, model.vocab_size))
        batch = setup.device_batch(host)
        if jaxprs is not None and i == 0:
            jaxprs.append(step_fn.trace(state, batch).jaxpr)
        state, metrics = step_fn(state, batch)
        losses.append(float(metrics["loss"]))
        history.append(jax.device_get(metrics))
    result = (np.array(losses), jax.device_get(state.params))
    if not allow_nonfinite:
        assert_finite(result, "train_losses (losses, params)")
    return result + (history,) if with_metrics else result


def initial_params(model, seed: int = 0) -> dict:
    """The seeded initial parameters of `model` on the host (as train_losses would start from)."""
    return jax.device_get(jax.jit(lambda key: nnx.to_pure_dict(nnx.state(model.build(nnx.Rngs(params=key)))))(
        jax.random.key(seed)))


def assert_finite(tree, what: str = "values") -> None:
    """Every leaf finite: np.testing.assert_allclose treats NaN == NaN as equal, so two runs that
    both went NaN would otherwise compare equal."""
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        x = np.asarray(x)
        if not np.isfinite(x).all():
            raise AssertionError(f"{what}{jax.tree_util.keystr(path)}: {np.size(x) - np.isfinite(x).sum()} of "
                                 f"{np.size(x)} values are not finite")


def assert_trees_close(a, b, rtol, atol=0.0):
    """Leafwise allclose of two trees with as many leaves, all finite."""
    assert_finite(a, "first tree")
    assert_finite(b, "second tree")
    leaves_a, leaves_b = jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b), f"{len(leaves_a)} leaves vs {len(leaves_b)}"
    for (path, x), y in zip(leaves_a, leaves_b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol,
                                   err_msg=jax.tree_util.keystr(path))


def with_train(**kw) -> TrainConfig:
    return dataclasses.replace(TINY_TRAIN, **kw)


def jaxpr_shapes(jaxpr):
    """Every equation output's shape in a jaxpr and in the jaxprs nested in its equations."""
    for eqn in jaxpr.eqns:
        yield from (tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from jaxpr_shapes(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from jaxpr_shapes(sub)


# Bundled configs that add to a model's config rather than describe a run (include them after
# one): each with the bundled config the tests load it on.
OVERLAY_CONFIGS = {"lora.gin": "default.gin"}


def bundled_config_files(name: str) -> list[str]:
    """The gin files that load configs/`name` as a run: an overlay after its model's config."""
    configs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    base = OVERLAY_CONFIGS.get(name)
    return ([os.path.join(configs, base)] if base else []) + [os.path.join(configs, name)]


def torch_loss(model, batch) -> float:
    """A torch causal LM's (transformers, peft) masked mean cross-entropy on one of our batches
    (inputs, positions, targets, loss_mask): the reference our first training loss is held to."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor(batch["inputs"], dtype=torch.long),
                       position_ids=torch.as_tensor(batch["positions"], dtype=torch.long)).logits
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.as_tensor(batch["targets"]).long().flatten(),
                                                reduction="none").numpy()
    mask = batch["loss_mask"].reshape(-1)
    return float((nll * mask).sum() / mask.sum())


def transformers_loss(hf_dir, batch) -> float:
    """torch_loss of the transformers model saved in `hf_dir`, in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    return torch_loss(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, local_files_only=True).eval(),
                      batch)
