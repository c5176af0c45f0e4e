"""Pipeline layout math (no compiles): splits, the common slot pattern, padding, bubbles, and
the clear errors for bad splits and microbatch counts."""
import dataclasses

import numpy as np
import pytest

from jaxtrain.training.config import Experiment, TrainConfig
from jaxtrain.training.run_configs import ObserveConfig
from jaxtrain.data.packing import DataConfig
from jaxtrain.pipeline.config import PipelineConfig
from jaxtrain.training.trainer import Trainer
from helpers import TINY_LLAMA_BYTES, TINY_OPT
from jaxtrain.meshes.mesh import MeshConfig
from jaxtrain.meshes.pipeline_schedules import GPipe, Interleaved
from jaxtrain.meshes.pipeline_split import balanced_counts, chunk_counts, common_supersequence, plan_stages

pytestmark = [pytest.mark.fast]


def test_balanced_split_of_equal_layers_puts_the_extra_layer_first():
    assert balanced_counts([1.0] * 27, 2) == (14, 13)
    assert balanced_counts([1.0] * 27, 4) == (7, 7, 7, 6)
    assert balanced_counts([4.0, 1, 1, 1, 1], 2) == (1, 4)  # a heavy first layer gets a stage to itself


def test_deepseek_split_pads_only_the_dense_slot():
    """1 dense + 26 MoE layers, 14/13: both stages run [dense, moe x 13]; stage 1 pads the dense slot."""
    sequence = [("dense", 0)] + [("moe", i) for i in range(26)]
    plan = plan_stages(sequence, 2, 1, (14, 13))
    assert plan.pattern == ("dense",) + ("moe",) * 13
    assert plan.runs() == (("dense", 0, 1), ("moe", 0, 13))
    assert plan.padding() == {"dense": [0, 1], "moe": [0, 0]}
    assert plan.index["moe"][1, 0].tolist() == list(range(13, 26))
    # 7/7/7/6 as 4 stages, or as 2 stages x 2 passes (interleaved): chunk c on stage c mod 2
    four = plan_stages(sequence, 4, 1, (7, 7, 7, 6))
    assert four.padding() == {"dense": [0, 1, 1, 1], "moe": [1, 0, 0, 1]}  # slots: dense 1, moe 7
    two = plan_stages(sequence, 2, 2, (7, 7, 7, 6))
    assert two.index["moe"][0].tolist() == [[0, 1, 2, 3, 4, 5, -1], [13, 14, 15, 16, 17, 18, 19]]
    assert two.index["moe"][1].tolist() == [[6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25, -1]]
    for plan in (four, two):  # every layer exactly once
        flat = plan.index["moe"].reshape(-1)
        assert sorted(flat[flat >= 0].tolist()) == list(range(26))
        assert sorted(plan.canonical_positions("moe").tolist()) == sorted(np.nonzero(flat >= 0)[0].tolist())


def test_hybrid_pattern_stages_share_one_slot_pattern():
    pattern = list("MEMEMAME" * 2)  # mamba / moe / attention, Nemotron-H-like
    counts = {}
    sequence = []
    for kind in pattern:
        sequence.append((kind, counts.get(kind, 0)))
        counts[kind] = counts.get(kind, 0) + 1
    plan = plan_stages(sequence, 2, 1, (9, 7))
    for stage, piece in enumerate(["MEMEMAMEM", "EMEMAME"]):
        it = iter(plan.pattern)
        assert all(kind in it for kind in piece)  # each stage's kinds are a subsequence of the pattern
    assert len(plan.pattern) <= 10
    assert common_supersequence("ABCA", "BCAB") in (list("ABCAB"),)


def test_bubble_fractions():
    assert GPipe().bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert Interleaved(2).bubble_fraction(4, 4) == pytest.approx(3 / 11)
    assert GPipe().bubble_fraction(2, 16) == pytest.approx(1 / 17)


@pytest.mark.parametrize("given, message", [
    ((3, 2), "sums to 5 but the model has 6 layers"),
    ((6, 0), "leaves pipeline chunk(s) [1] empty"),
    ((2, 2, 2), "names 3 chunks but the layout has 2"),
])
def test_bad_split_is_a_clear_error(given, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        chunk_counts([1.0] * 6, 2, given)


def _experiment(pipeline, **train):
    train = TrainConfig(**{**dict(steps=2, global_batch=16, seq_len=16, microbatches=4), **train})
    # a model the corpus's byte tokens fit, so that only the pipeline setting under test is wrong
    return Experiment(model=dataclasses.replace(TINY_LLAMA_BYTES, layers=4),
                      mesh=MeshConfig(pipeline=2, data=4, tensor=2), train=train, data=DataConfig(),
                      optimizer=TINY_OPT, pipeline=pipeline, observe=ObserveConfig(eval_every=0, eval_batches=1))


@pytest.mark.parametrize("pipeline, train, message", [
    (PipelineConfig(stages_layers=(3, 2)), {}, "sums to 5 but the model has 4 layers"),
    (PipelineConfig(stages_layers=(4, 0)), {}, "empty"),
    (PipelineConfig(schedule=Interleaved(2), stages_layers=(2, 2)), {}, "names 2 chunks but the layout has 4"),
    (PipelineConfig(), dict(global_batch=16, microbatches=3), "not divisible by microbatches=3"),
    (PipelineConfig(schedule=Interleaved(2)), dict(microbatches=1), "microbatches=1 < pipeline=2"),
])
def test_bad_pipeline_config_fails_before_anything_is_written(tmp_path, pipeline, train, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Trainer(_experiment(pipeline, **train), str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("gin_file, counts", [
    ("configs/deepseek_v2_lite_pipeline.gin", (14, 13)),
    ("configs/deepseek_v2_tiny_pipeline.gin", (14, 13)),
    ("configs/nemotron3_nano_pipeline.gin", None),
])
def test_reference_pipeline_configs_plan_their_stages(gin_file, counts):
    """The reference layouts parse and plan (nothing compiled): DeepSeek 14/13 over pipeline 2 x
    tensor 2 x data 4 with folded experts (EP 4 over data, EDP 2 over tensor); Nemotron-3-Nano
    split by cost over 2 stages."""
    import gin

    from jaxtrain.training.config import load_experiment, parse_gin
    from jaxtrain.meshes.experts import resolve_layout
    from jaxtrain.meshes.mesh import build_mesh
    from jaxtrain.meshes.rules import get_rule_set

    gin.clear_config()
    try:
        parse_gin([gin_file], [])
        exp = load_experiment()
    finally:
        gin.clear_config()
    plan = exp.pipeline.plan(exp.model, exp.mesh.pipeline)
    layers = exp.model.layers if hasattr(exp.model, "layers") else len(exp.model.pattern)
    assert exp.mesh.pipeline == 2 and sum(plan.counts) == layers
    if counts is not None:
        assert plan.counts == counts and (exp.mesh.tensor, exp.mesh.data) == (2, 4)
        mesh = build_mesh(exp.mesh)
        stage_tokens = (exp.train.global_batch // exp.train.microbatches, exp.train.seq_len, exp.model.embed)
        layout = resolve_layout(mesh, get_rule_set(exp.train.rules), stage_tokens, exp.model.router.num_experts,
                                exp.model.expert_mlp)
        assert (layout.ep_axes, layout.ep_size, layout.edp_axes, layout.edp_size) == (("data",), 4, ("tensor",), 2)

