"""ParallelPlan: one object for the layout, from a spec string or from gin, checked once."""
import dataclasses

import pytest

from jaxtrain.training.config import Experiment, TrainConfig
from jaxtrain.training.parallel_plan import ParallelPlan
from jaxtrain.pipeline.config import PipelineConfig
from meshes.context_layout import AllGatherKV, Contiguous
from meshes.mesh_config import MeshConfig, spec_axis_sizes
from meshes.pipeline_schedules import GPipe, Interleaved
from models.llama import LlamaConfig

SPEC = "pipeline=2,data=2,context=2,tensor=2,rules=fsdp+experts_folded,split=14/13,microbatches=4"


def test_spec_string_sets_every_field_and_round_trips():
    plan = ParallelPlan.parse(SPEC + ",schedule=interleaved3,kv=allgather,order=contiguous,stage_remat=layer")
    assert plan.mesh == MeshConfig(pipeline=2, data=2, context=2, expert=1, tensor=2)
    assert (plan.rules, plan.microbatches) == ("fsdp+experts_folded", 4)
    assert plan.pipeline == PipelineConfig(schedule=Interleaved(3), stages_layers=(14, 13), remat="layer")
    assert plan.context_parallel.kv_exchange == AllGatherKV() and plan.context_parallel.layout == Contiguous()
    again = ParallelPlan.parse(plan.spec())
    assert (again.mesh, again.rules, again.microbatches, again.pipeline.schedule, again.pipeline.stages_layers) == \
        (plan.mesh, plan.rules, plan.microbatches, plan.pipeline.schedule, plan.pipeline.stages_layers)


def test_spec_applies_over_a_plan_and_naming_an_axis_fixes_the_whole_mesh():
    base = ParallelPlan(mesh=MeshConfig(data=-1, tensor=4), rules="zero1", microbatches=2)
    assert base.with_spec("microbatches=8") == dataclasses.replace(base, microbatches=8)  # mesh kept
    changed = base.with_spec("data=8,tensor=2")
    assert changed.mesh.sizes() == dict(pipeline=1, data=8, context=1, expert=1, tensor=2)
    assert changed.rules == "zero1"
    assert ParallelPlan.parse("schedule=gpipe").pipeline.schedule == GPipe()
    assert spec_axis_sizes("data=8,tensor=2,rules=fsdp") == dict(pipeline=1, data=8, context=1, expert=1, tensor=2)
    assert spec_axis_sizes("rules=fsdp") == {}


@pytest.mark.parametrize("spec, message", [
    ("data=2,wombat=3", "unknown key 'wombat'"),
    ("data=two", "'data=two'"),
    ("rules=fsdp+nope", "unknown rule overlay 'nope'"),
    ("rules=ddp", "unknown rule table 'ddp'"),
    ("schedule=1f1b", "unknown schedule '1f1b'"),
    ("kv=mesh", "kv='mesh': choose one of ring|allgather"),
    ("data", "'data' is not key=value"),
])
def test_bad_specs_name_the_part(spec, message):
    with pytest.raises(ValueError, match=message.replace("|", r"\|").replace("+", r"\+")):
        ParallelPlan.parse(spec)


def test_from_experiment_reads_the_gin_fields_and_the_layout_string_on_top():
    exp = Experiment(model=LlamaConfig(), mesh=MeshConfig(data=4, tensor=2),
                     train=TrainConfig(rules="fsdp", microbatches=2), pipeline=PipelineConfig(stages_layers=(3, 1)))
    plan = ParallelPlan.from_experiment(exp)
    assert (plan.mesh, plan.rules, plan.microbatches, plan.pipeline.stages_layers) == \
        (MeshConfig(data=4, tensor=2), "fsdp", 2, (3, 1))
    layered = ParallelPlan.from_experiment(dataclasses.replace(exp, layout="pipeline=2,data=8,microbatches=4"))
    assert layered.mesh.sizes() == dict(pipeline=2, data=8, context=1, expert=1, tensor=1)
    assert (layered.rules, layered.microbatches, layered.pipeline.stages_layers) == ("fsdp", 4, (3, 1))


MESH = dict(pipeline=1, data=4, context=2, expert=1, tensor=2)


@pytest.mark.parametrize("plan, batch, seq, message", [
    (ParallelPlan(microbatches=3), 8, 16, "global_batch=8 is not divisible by microbatches=3"),
    (ParallelPlan(microbatches=4), 8, 16, "2 rows per microbatch is not divisible by the data-parallel size 4"),
    (ParallelPlan(), 8, 15, "seq_len=15 is not divisible by the context axis size 2"),
    (ParallelPlan(), 8, 14, "TrainConfig.seq_len=14"),  # 14 / (2 ranks x 2 balanced chunks)
])
def test_validate_names_what_does_not_fit(plan, batch, seq, message):
    with pytest.raises(ValueError, match=message):
        plan.validate(LlamaConfig(), global_batch=batch, seq_len=seq, mesh_shape=MESH)


def test_validate_checks_the_pipeline_schedule_against_microbatches():
    plan = ParallelPlan.parse("pipeline=2,data=4,microbatches=1")
    with pytest.raises(ValueError, match="microbatches=1 < pipeline=2"):
        plan.validate(LlamaConfig(), global_batch=8, seq_len=16, mesh_shape=dict(MESH, pipeline=2, context=1))
