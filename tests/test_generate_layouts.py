"""Generation on the layouts training runs on (issue 24): sequence-parallel rule tables and device
groups give the one-device greedy tokens through `Run.generate` (the path samples during training
take too: an Engine on the run's mesh and rules); a context-parallel layout is refused by name
before anything compiles."""
from __future__ import annotations

import jax
import pytest

from jaxtrain.api import Run
from jaxtrain.generate import Engine, count_compiles
from jaxtrain.generate.loading import canonical_model
from jaxtrain.training.config import TrainConfig
from jaxtrain.training.device_groups import DeviceGroups
from jaxtrain.models.llama import LlamaConfig

pytestmark = [pytest.mark.slow]

CFG = LlamaConfig(vocab_size=64, embed=32, layers=2, heads=4, kv_heads=2, mlp=48)
TRAIN = TrainConfig(global_batch=4, seq_len=16, steps=2)
PROMPTS = [[3, 9, 27, 4], [11, 2], [5, 6, 7, 8, 9, 10, 11]]
NEW = 9


@pytest.fixture(scope="module")
def one_device():
    """The greedy tokens of the run's parameters on one device, outside any mesh."""
    params = jax.device_get(Run.create(CFG, "data=1", train=TRAIN, seed=1).params)
    return Engine(canonical_model(CFG, params), bucket=16).generate(PROMPTS, max_new_tokens=NEW)


@pytest.mark.parametrize("spec,groups", [("data=2,tensor=2,rules=dp_sp", None),
                                         ("data=2,tensor=2,rules=fsdp_sp", None),
                                         ("data=2,tensor=2,microbatches=2", (2, 2))],
                         ids=["dp_sp", "fsdp_sp", "device-groups"])
def test_layout_generates_the_one_device_tokens(one_device, spec, groups):
    """Sequence parallelism splits the residual's length over tensor, which one decoded token
    cannot divide: decode runs with the token axis whole (weights and caches as the rules say)."""
    run = Run.create(CFG, spec, train=TRAIN, seed=1, groups=DeviceGroups(rows=groups) if groups else None)
    assert run.generate(PROMPTS, max_new_tokens=NEW) == one_device


def test_context_parallel_layout_is_refused_before_compiling():
    run = Run.create(CFG, "data=2,context=2", train=TRAIN, seed=1)
    with count_compiles() as compiled:
        with pytest.raises(ValueError, match=r"generation does not run under context parallelism \(context=2"):
            run.generate(PROMPTS, max_new_tokens=NEW)
    assert not compiled["_prefill_fn"] and not compiled["_decode_fn"]
