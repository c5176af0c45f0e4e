"""The longest row of the long-context table (benchmarks/RESULTS.md, docs/long-context.md), compile only: the default Llama
(configs/default.gin, remat full) on 4,194,304 tokens over context=16, blockwise attention with
the K/V ring, as `benchmarks/context_tables.sh` benches it. XLA:CPU's temp per device must stay
under 15.5 GiB (the bench prints it as "GB", divided by 2**30), inside the 16 GiB the table
claims that length fits in.

What this holds in place: the ring backward (meshes/ring_attention.py) runs all its steps inside
one loop. With its last step peeled off the loop, that step's kernel call sits beside the
recomputed forward's in the layer's computation, XLA merges their query blocks and zero-filled
buffers, and they stay alive through the MLP's backward, the step's peak, past the bound.
One full-size compile, about 2 min on two cores: `make test-full-size`.
"""
from __future__ import annotations

import gin
import pytest

from jaxtrain.cli.bench import apply_layout, layout_devices
from jaxtrain.training.config import load_experiment, parse_gin
from jaxtrain.training.train_setup import build_train_setup

pytestmark = [pytest.mark.slow, pytest.mark.full_size]

TOKENS = 4_194_304
LAYOUT = "context=16,attention=blockwise,kv=ring"
BOUND_GIB = 15.5


def test_four_million_tokens_of_the_default_llama_fit_under_the_bound_at_context_16():
    gin.clear_config()
    try:
        parse_gin(["configs/default.gin"], ["TrainConfig.global_batch = 1", 'LlamaConfig.remat = "full"',
                                            f"TrainConfig.seq_len = {TOKENS}"])
        exp, plan = apply_layout(load_experiment(), LAYOUT)
    finally:
        gin.clear_config()
    assert plan.mesh.sizes()["context"] == 16 and exp.model.runtime().remat == "full"
    t = exp.train
    setup = build_train_setup(exp.model, plan, t, exp.optimizer, layout_devices(plan), loss=exp.loss)
    lowered = setup.train_step.lower(setup.state.abstract, setup.abstract_batch(t.global_batch, t.seq_len))
    temp_gib = lowered.compile().memory_analysis().temp_size_in_bytes / 2**30
    assert temp_gib < BOUND_GIB, f"temp {temp_gib:.3f} GiB per device at {TOKENS} tokens, context=16"
