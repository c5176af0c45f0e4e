"""The planner's memory claims on models it was not fitted on.

Model shapes are drawn at random from a small grid (dense and MoE, MLA and GQA attention,
depths, widths, experts, top-k, bf16 and float32), each planned for 16 H100s, and layouts are
drawn from the planner's own ranking (its first and one more of its top 40); each is compiled
(compile only, on the 16 simulated CPU devices) through the path `--verify` uses, and the
planner's CPU prediction must hold: arguments within 3%, temp within 25% of XLA's. A layout
where XLA's partitioner replicates a value it cannot reshard ("involuntary full
rematerialization", a sharding bug, not a memory term) is reported and its temp not compared.

The seeds are fixed (CI is deterministic) and printed; each draw is its own test. The 8 draws
compile 16 layouts (about 10 minutes on two busy cores): the `full_size` lane
(`make test-full-size`); the default suite compiles one.
Also here: `--verify` ranks a layout whose compiled peak exceeds its claim below the others.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from jaxtrain.cli import plan as plan_cli
from jaxtrain.planner.candidates import candidates
from jaxtrain.planner.cluster import Cluster
from jaxtrain.planner.links import LinkTable
from jaxtrain.planner.memory_model import CPU
from jaxtrain.planner.planner import Planner, Workload
from jaxtrain.planner.verify import compiled_memory
from jaxtrain.training.config import Experiment, TrainConfig
from jaxtrain.training.optim import OptimizerConfig
from jaxtrain.models.deepseek import DeepSeekConfig
from jaxtrain.models.layers.router import RouterConfig
from jaxtrain.models.llama import LlamaConfig
from jaxtrain.models.nemotron_h import NemotronHConfig

pytestmark = [pytest.mark.slow]

SEED = 2212
GIB = 2 ** 30
TRAIN = TrainConfig(global_batch=16, seq_len=4096)
LOSS_CHUNK = 1024  # LossConfig's default, which the compiled runs use
H100_X16 = Cluster.from_args(cluster=None, device="H100", devices=16).groups[0]
FAMILIES = ("llama", "deepseek_moe", "deepseek_dense", "nemotron_moe")


def draw_model(rng):
    """A model shape from the grid: Llama (GQA, dense), DeepSeek (MLA, MoE or dense), Nemotron-H
    attention + MoE layers (GQA, MoE). Widths as in the models the planner plans (compile-only:
    the compile time hardly depends on them), few layers."""
    family = FAMILIES[int(rng.integers(len(FAMILIES)))]
    embed = int(rng.choice([1024, 2048]))
    dtype = str(rng.choice(["bfloat16", "float32"]))
    layers = int(rng.choice([2, 3, 4]))
    router = RouterConfig(num_experts=int(rng.choice([8, 16, 32])), top_k=int(rng.choice([2, 4, 6])))
    expert_mlp = int(rng.choice([512, 1024]))
    if family == "llama":
        return LlamaConfig(vocab_size=32768, embed=embed, layers=layers, heads=16, kv_heads=int(rng.choice([2, 4, 8])),
                           mlp=int(rng.choice([3, 4])) * embed, dtype=dtype)
    if family.startswith("deepseek"):
        return DeepSeekConfig(vocab_size=32768, embed=embed, layers=layers,
                              first_k_dense=layers if family == "deepseek_dense" else 1, heads=16,
                              kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                              mlp=4 * embed, expert_mlp=expert_mlp, shared_experts=2, router=router, dtype=dtype)
    return NemotronHConfig(vocab_size=32768, embed=embed, pattern=("attention", "moe") * max(layers // 2, 1), heads=16,
                           kv_heads=int(rng.choice([2, 4])), head_dim=128, mlp=3 * embed, expert_mlp=expert_mlp,
                           shared_expert_mlp=2 * expert_mlp, router=router, dtype=dtype)


def drawn_layouts(model, rng, picks: int):
    """(planner, evaluations): the planner's first layout for `model` on 16 H100s and
    `picks - 1` more drawn from its top 40 (remat none or full: the two ends of the policies)."""
    planner = Planner(Workload(model, TRAIN.global_batch, TRAIN.seq_len, LOSS_CHUNK), H100_X16,
                      LinkTable(H100_X16.spec.intra_node_gbps, H100_X16.spec.inter_node_gbps))
    ranked = planner.rank(candidates(16, devices_per_node=8, layers=planner.layers, seq_len=TRAIN.seq_len,
                                     global_batch=TRAIN.global_batch, has_experts=planner.has_experts,
                                     remats=("none", "full"), host_optimizer=False))
    others = rng.choice(np.arange(1, min(40, len(ranked))), size=picks - 1, replace=False)
    return planner, [ranked[0]] + [ranked[int(i)] for i in sorted(others)]


def measure(draw: int, picks: int) -> list[dict]:
    """Draw `draw` (seeded SEED + draw): the model, `picks` of its layouts, and for each the
    planner's CPU prediction beside XLA's compiled figures."""
    rng = np.random.default_rng(SEED + draw)
    model = draw_model(rng)
    planner, picked = drawn_layouts(model, rng, picks)
    print(f"\nplanner property draw {draw} (seed {SEED + draw}): {model}")
    rows = []
    for e in picked:
        predicted = planner.memory(e.candidate, planner.state(e.candidate), CPU)
        compiled = compiled_memory(Experiment(model=model, train=TRAIN, optimizer=OptimizerConfig()), e.candidate)
        row = {"model": model, "label": e.candidate.label(), "args": predicted.arguments / GIB,
               "temp": predicted.temp / GIB, **compiled}
        rows.append(row)
        if "error" not in compiled:
            print(f"{type(model).__name__}(embed={model.embed}, {model.dtype}, {planner.layers} layers"
                  f"{', experts' if planner.has_experts else ''}) {row['label']}: args {row['args']:.3f} / "
                  f"{compiled['argument_gb']:.3f} GiB, temp {row['temp']:.3f} / {compiled['temp_gb']:.3f}"
                  f" ({row['temp'] / compiled['temp_gb'] - 1:+.1%})"
                  f"{'  [XLA: involuntary full rematerialization]' if compiled['involuntary_remat'] else ''}")
    return rows


# Layouts the model is known to miss, by a part of their label: reported, their temp not
# compared (arguments still are). None of the drawn layouts is one now: expert tensor
# parallelism's miss was the MoE backward's [slots, embed] scatter buffers on XLA:CPU
# (memory_model.Platform.slot_backward_copies). The one miss once known outside the draws held
# widened float32 dot operands: test_draw_6_at_dp_holds_since_its_dots_multiply_bf16.
KNOWN_MISSES: dict[str, str] = {}


def known_miss(label: str) -> str | None:
    return next((why for part, why in KNOWN_MISSES.items() if part in label), None)


def check(rows: list[dict]) -> None:
    for row in rows:
        assert "error" not in row, (row["label"], row["error"])  # a ranked layout must compile
        assert np.isfinite([row["argument_gb"], row["temp_gb"]]).all() and row["temp_gb"] > 0, row
        args_error = row["args"] / row["argument_gb"] - 1
        assert abs(args_error) <= 0.03, (row["model"], row["label"], row["args"], row["argument_gb"])
        if row["involuntary_remat"]:
            continue  # XLA replicated a value: a sharding bug to fix, not a term of the model
        if known_miss(row["label"]):
            print(f"known miss, temp not compared: {row['label']}: {known_miss(row['label'])}")
            continue
        temp_error = row["temp"] / row["temp_gb"] - 1
        assert abs(temp_error) <= 0.25, (row["model"], row["label"], row["temp"], row["temp_gb"])


DRAWS = 8
SMOKE_DRAW = 0  # the draw the default suite compiles (its first layout only)


def test_the_draws_cover_dense_and_moe_mla_and_gqa():
    """What the property ranges over (no compiles): the models of the DRAWS draws."""
    models = [draw_model(np.random.default_rng(SEED + i)) for i in range(DRAWS)]
    moe = [m for m in models if isinstance(m, NemotronHConfig) or (isinstance(m, DeepSeekConfig) and m.moe_layers)]
    assert any(isinstance(m, DeepSeekConfig) for m in moe), models  # MLA + MoE
    assert any(isinstance(m, NemotronHConfig) for m in moe), models  # GQA + MoE
    assert any(isinstance(m, LlamaConfig) for m in models), models  # GQA, dense


@pytest.mark.full_size
@pytest.mark.parametrize("draw", range(DRAWS))
def test_memory_claims_hold_on_drawn_models_and_layouts(draw):
    check(measure(draw, picks=2))


@pytest.mark.full_size
def test_the_issues_moe_pipeline_without_remat():
    """The MoE the issue found the planner 38-62% under on: DeepSeek-style (MLA, 32 experts
    top-4, sequence 4096: configs/gpu_moe_4k.gin) with 4 layers, a pipeline over expert
    parallelism without remat, where every MoE layer keeps the rows its exchange received for
    every tick a microbatch is in flight (the drawn models, 1-3 MoE layers at EP 2-4, barely
    feel that term; here it is half the temp)."""
    import gin

    from jaxtrain.training.config import load_experiment, parse_gin
    from jaxtrain.training.parallel_plan import ParallelPlan

    gin.clear_config()
    try:
        parse_gin(["configs/gpu_moe_4k.gin"], ["DeepSeekConfig.layers=4", "TrainConfig.global_batch=32"])
        exp = load_experiment()
    finally:
        gin.clear_config()
    t = exp.train
    planner = Planner(Workload(exp.model, t.global_batch, t.seq_len, exp.loss.loss_chunk, exp.optimizer), H100_X16,
                      LinkTable(H100_X16.spec.intra_node_gbps, H100_X16.spec.inter_node_gbps))
    candidate = exp.plan.with_spec("pipeline=2,data=8,rules=zero1+experts_folded,microbatches=4,remat=none")
    predicted = planner.memory(candidate, planner.state(candidate), CPU)
    compiled = compiled_memory(exp, candidate)
    row = {"model": exp.model, "label": candidate.label(), "args": predicted.arguments / GIB,
           "temp": predicted.temp / GIB, **compiled}
    print(f"issue MoE {row['label']}: temp {row['temp']:.2f} / {compiled.get('temp_gb', float('nan')):.2f} GiB")
    assert not compiled.get("involuntary_remat"), "this layout compiled without XLA's replication when chosen"
    check([row])


def _draw_6_at(global_batch: int, layout: str, remat: str) -> tuple[float, dict]:
    """Draw 6's model (Nemotron-H, bf16, 32 experts top-4) at `global_batch`: the planner's CPU
    temp (GiB) and XLA's compiled figures for `layout`."""
    from jaxtrain.training.parallel_plan import ParallelPlan

    model = draw_model(np.random.default_rng(SEED + 6))
    train = TrainConfig(global_batch=global_batch, seq_len=TRAIN.seq_len)
    planner = Planner(Workload(model, train.global_batch, train.seq_len, LOSS_CHUNK), H100_X16,
                      LinkTable(H100_X16.spec.intra_node_gbps, H100_X16.spec.inter_node_gbps))
    candidate = ParallelPlan.parse(layout).with_spec(f"remat={remat}")
    predicted = planner.memory(candidate, planner.state(candidate), CPU)
    compiled = compiled_memory(Experiment(model=model, train=train, optimizer=OptimizerConfig()), candidate)
    assert "error" not in compiled and np.isfinite(compiled["temp_gb"]) and compiled["temp_gb"] > 0, compiled
    print(f"draw 6, batch {global_batch}, {candidate.label()}: temp {predicted.temp / GIB:.3f} / "
          f"{compiled['temp_gb']:.3f} GiB")
    return predicted.temp / GIB, compiled


@pytest.mark.full_size
def test_expert_tensor_parallel_backward_holds_at_twice_the_batch():
    """Draw 6's expert-tensor-parallel layout (remat full; the draw compiles it at batch 16) at
    batch 32: the MoE backward's [slots, embed] buffers, which no axis splits under expert
    tensor parallelism, double with the batch, and the prediction follows (it was 1.52 / 4.44
    GiB without them)."""
    predicted, compiled = _draw_6_at(32, "data=2,context=2,tensor=4,rules=dp+expert_tp", "full")
    assert not compiled["involuntary_remat"]
    assert abs(predicted / compiled["temp_gb"] - 1) <= 0.25


@pytest.mark.full_size
def test_draw_6_at_dp_holds_since_its_dots_multiply_bf16():
    """Draw 6's model at rules=dp (experts replicated over tensor) with remat full, the one miss
    once known outside the draws: 1.07 predicted / 1.71 GiB XLA, its peak in the forward. Part of
    that peak were float32 copies of bf16 operands: XLA:CPU widened every dot with a bf16 result
    (pallas_kernels/low_precision_dot.py). With the dots on bf16 operands XLA holds 1.39 GiB
    (2026-12-06) and the prediction is within the draws' 25%."""
    predicted, compiled = _draw_6_at(16, "data=2,context=2,tensor=4,rules=dp", "full")
    assert not compiled["involuntary_remat"]
    assert abs(predicted / compiled["temp_gb"] - 1) <= 0.25


def test_memory_claim_holds_on_one_drawn_model():
    """The smoke version of the property for the default suite: one draw, its first layout."""
    check(measure(SMOKE_DRAW, picks=1))


def test_verify_ranks_a_layout_that_exceeds_its_claim_below_the_others(tmp_path, capsys, monkeypatch):
    """The first layout compiles to more than it claims (a stub for XLA): it is not ranked first,
    the verify table says so with the compiled figure, and the gin bindings and JSON lead with
    the next verified layout."""
    import jaxtrain.planner.verify as verify

    compiled = []

    def stub(experiment, candidate):
        compiled.append(candidate.spec())
        temp = 1000.0 if len(compiled) == 1 else 0.001
        return {"argument_gb": 0.001, "temp_gb": temp, "compile_s": 0.0, "involuntary_remat": False}

    monkeypatch.setattr(verify, "compiled_memory", stub)
    out_json = tmp_path / "ranked.jsonl"
    assert plan_cli.main(["--gin_file=configs/default.gin", "--device", "H100", "--devices", "8", "--top", "4",
                          "--remat", "full", "--verify", "2", f"--json={out_json}"]) == 0
    out = capsys.readouterr().out
    assert len(compiled) == 2
    first, second = compiled
    assert "does not hold its claim: compiled 1000.00 GiB" in out and "ranked last" in out
    records = [json.loads(line) for line in out_json.read_text().splitlines()]
    assert first != second and records[0]["layout"] == second and records[-1]["layout"] == first
    assert records[0]["verified"]["holds_claim"] and not records[-1]["verified"]["holds_claim"]
    assert records[-1]["verified"]["temp_gb"] == 1000.0
    best = out.split("# gin bindings of the best three:")[1].split("# 2")[0]
    assert f'Experiment.layout = "{second}"' in best and first not in best


def test_compiled_memory_says_when_xla_replicated_a_value(monkeypatch):
    """XLA's C++ warning (written to file descriptor 2 while compiling) marks the compiled
    figures; a compile without it does not. bench_layout is a stub writing what XLA writes."""
    import os

    import jaxtrain.planner.layout_bench as bench
    from jaxtrain.training.parallel_plan import ParallelPlan

    figures = {"argument_gb": 1.0, "temp_gb": 2.0, "compile_s": 0.1}

    def compile_warning(exp, plan, **kw):
        os.write(2, b"W spmd_partitioner.cc:656] [SPMD] Involuntary full rematerialization. The compiler cannot\n")
        return figures

    experiment = Experiment(model=LlamaConfig(), train=TRAIN, optimizer=OptimizerConfig())
    candidate = ParallelPlan.parse("data=16,rules=dp,remat=none")
    monkeypatch.setattr(bench, "bench_layout", compile_warning)
    assert compiled_memory(experiment, candidate) == {**figures, "involuntary_remat": True}
    monkeypatch.setattr(bench, "bench_layout", lambda exp, plan, **kw: figures)
    assert compiled_memory(experiment, candidate) == {**figures, "involuntary_remat": False}
