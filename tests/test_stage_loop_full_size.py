"""Why a pipeline stage whose kinds alternate runs the kinds loop by default under remat `full`,
at full size: Nemotron-3-Nano (its config's remat full) over pipeline=2 x data=8 with FSDP,
compile only. Run by run unrolls the
stage's short runs and XLA hoists their FSDP gathers out of the tick loop, holding the whole
stage's gathered weights for the step (2026-12-04: temp 235.9 GiB against the kinds loop's
42.3; `benchmarks/stage_loop_memory.py` gives the plain switch too). Two full-size compiles,
about 2.5 min on two cores: `make test-full-size`.
"""
from __future__ import annotations

import gin
import pytest

from jaxtrain.training.config import load_experiment, parse_gin
from jaxtrain.training.parallel_plan import ParallelPlan
from jaxtrain.training.train_setup import build_train_setup
from jaxtrain.models.stage_program import stage_loop

pytestmark = [pytest.mark.slow, pytest.mark.full_size]
LAYOUT = "pipeline=2,data=8,microbatches=2,rules=fsdp"


def _temp_bytes(exp, plan) -> int:
    t = exp.train
    setup = build_train_setup(exp.model, plan, t, exp.optimizer, loss=exp.loss)
    compiled = setup.train_step.lower(setup.state.abstract, setup.abstract_batch(t.global_batch, t.seq_len)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_the_default_loop_of_full_size_nano_holds_a_fraction_of_run_by_run():
    gin.clear_config()
    try:
        parse_gin(["configs/nemotron3_nano_pipeline.gin"], [])
        exp = load_experiment()
    finally:
        gin.clear_config()
    plan = ParallelPlan.from_experiment(exp).with_spec(LAYOUT)
    assert plan.stage_loop == "auto" and exp.model.remat == "full"
    assert stage_loop(plan.pipeline.plan(exp.model, 2).pattern, "full") == "kinds"  # what the run gets
    temp = {loop: _temp_bytes(exp, plan.with_spec(f"stage_loop={loop}")) for loop in ("auto", "runs")}
    assert temp["auto"] <= 0.5 * temp["runs"], {k: v / 2**30 for k, v in temp.items()}
