"""ParallelPlan: one object for the layout, from a spec string or from gin, checked once; one
grammar (jaxtrain/training/plan_keys.py) that every reader of a layout string uses."""
import dataclasses
import os
import random
import subprocess
import sys

import gin
import pytest

from jaxtrain.training.config import Experiment, TrainConfig
from jaxtrain.training.parallel_plan import ParallelPlan
from jaxtrain.pipeline.config import PipelineConfig
from jaxtrain.meshes.context_layout import AllGatherKV, ContextParallel, Contiguous, LatentKV, LoadBalanced, RingKV
from jaxtrain.training import plan_keys
from jaxtrain.meshes.mesh_config import AXES, MeshConfig
from jaxtrain.meshes.pipeline_schedules import GPipe, Interleaved
from jaxtrain.models.llama import LlamaConfig
from jaxtrain.models.mamba2 import Mamba2Config

pytestmark = [pytest.mark.fast]

SPEC = "pipeline=2,data=2,context=2,tensor=2,rules=fsdp+experts_folded,split=14/13,microbatches=4"


def test_spec_string_sets_every_field_and_round_trips():
    plan = ParallelPlan.parse(SPEC + ",schedule=interleaved3,kv=allgather,order=contiguous,stage_remat=layer,stage_loop=kinds")
    assert plan.mesh == MeshConfig(pipeline=2, data=2, context=2, expert=1, tensor=2)
    assert (plan.rules, plan.microbatches) == ("fsdp+experts_folded", 4)
    assert plan.pipeline == PipelineConfig(schedule=Interleaved(3), stages_layers=(14, 13), remat="layer", stage_loop="kinds")
    assert plan.context_parallel.kv_exchange == AllGatherKV() and plan.context_parallel.layout == Contiguous()
    assert ParallelPlan.parse(plan.spec()) == plan


def test_spec_applies_over_a_plan_and_naming_an_axis_fixes_the_whole_mesh():
    base = ParallelPlan(mesh=MeshConfig(data=-1, tensor=4), rules="zero1", microbatches=2)
    assert base.with_spec("microbatches=8") == dataclasses.replace(base, microbatches=8)  # mesh kept
    changed = base.with_spec("data=8,tensor=2")
    assert changed.mesh.sizes() == dict(pipeline=1, data=8, context=1, expert=1, tensor=2)
    assert changed.rules == "zero1"
    assert ParallelPlan.parse("schedule=gpipe").pipeline.schedule == GPipe()
    # the device count the CLI sizes simulated devices by, before jax starts: every group's
    assert ParallelPlan.parse("data=8,tensor=2,rules=fsdp").device_count() == 16
    assert ParallelPlan.parse("data=4,groups=12/4").device_count() == 8
    assert ParallelPlan(mesh=MeshConfig(data=-1, tensor=2)).with_spec("rules=fsdp").device_count() == 2


@pytest.mark.parametrize("spec, message", [
    ("data=2,wombat=3", "unknown key 'wombat': use one of pipeline, data"),
    ("data=two", "'data=two': 'two' is not an integer"),
    ("dcn=2/1", "give one factor per mesh axis"),
    ("split=14/0", "0 must be positive"),
    ("microbatches=0", "0 must be positive"),
    ("attention=flash", "attention='flash': choose one of materialized|"),
    ("schedule=gpipe2", "gpipe takes no virtual-stage count"),
    ("groups=12/x", "'x' is not an integer"),
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
                     train=TrainConfig(rules="fsdp", microbatches=2),
                     pipeline=PipelineConfig(stages_layers=(3, 1), stage_loop="kinds"))
    plan = ParallelPlan.from_experiment(exp)
    assert plan.pipeline == exp.pipeline  # every PipelineConfig field reaches the plan
    assert (plan.mesh, plan.rules, plan.microbatches) == (MeshConfig(data=4, tensor=2), "fsdp", 2)
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
    with pytest.raises(ValueError, match="stage_loop='scan'"):
        ParallelPlan.parse("pipeline=2,data=4,microbatches=2,stage_loop=scan").validate(
            LlamaConfig(), global_batch=8, seq_len=16, mesh_shape=dict(MESH, pipeline=2, context=1))


# ---- one grammar: every field round-trips, and every reader uses it -------------------------

RULES = ("dp", "zero1", "fsdp", "dp_sp", "fsdp_sp", "fsdp+experts_folded", "zero1+expert_tp+opt_host",
         "fsdp_sp+experts_folded+expert_tp", "fsdp+opt_host")


def _random_plan(rng: random.Random) -> ParallelPlan:
    """A plan with every field drawn (None and empty values included)."""
    sizes = {a: rng.choice((1, 2, 3, 4, 8)) for a in AXES}
    if rng.random() < 0.2:
        sizes[rng.choice(AXES)] = -1
    pick = lambda *options: rng.choice(options)  # noqa: E731
    return ParallelPlan(
        mesh=MeshConfig(**sizes, dcn=pick(None, tuple(rng.choice((1, 2)) for _ in AXES))),
        rules=rng.choice(RULES), microbatches=rng.randint(1, 64),
        schedule=pick(GPipe(), Interleaved(rng.randint(2, 6))),
        split=pick(None, tuple(rng.randint(1, 40) for _ in range(rng.randint(1, 8)))),
        stage_remat=pick("none", "layer", "stage"), stage_loop=pick("auto", "runs", "switched", "kinds"),
        context_parallel=ContextParallel(layout=pick(LoadBalanced(), Contiguous()),
                                         kv_exchange=pick(RingKV(), AllGatherKV(), LatentKV())),
        remat=pick(None, "none", "dots_no_batch", "full", "offload_dots"),
        attention=pick(None, *plan_keys.ATTENTION), groups=pick((), tuple(rng.randint(1, 64) for _ in range(3))))


def test_spec_is_lossless_for_plans_drawn_over_every_field():
    rng = random.Random(25)
    drawn = [_random_plan(rng) for _ in range(300)]
    # every field of the plan (and of its nested values) has a key, and the draws vary each
    nested = {"mesh": MeshConfig, "context_parallel": ContextParallel}
    fields = {f"{f.name}.{g.name}" if f.name in nested else f.name for f in dataclasses.fields(ParallelPlan)
              for g in (dataclasses.fields(nested[f.name]) if f.name in nested else [None])}
    assert {k.field for k in plan_keys.KEYS} == fields
    assert all(len({str(plan_keys.get(p, f)) for p in drawn}) > 1 for f in fields), "the draws must vary every field"
    for plan in drawn:
        assert ParallelPlan.parse(plan.spec()) == plan, plan.spec()
        # the spec names every field, so over any other plan it still gives this one
        assert _random_plan(rng).with_spec(plan.spec()) == plan, plan.spec()
        assert ParallelPlan.parse(plan.label()) == plan, plan.label()  # the short form too


def test_the_plan_module_imports_no_jax():
    """The CLI parses a layout before jax's backend starts, to size the simulated devices: the
    module and every key but `rules` need no jax; checking a rule table's name imports
    meshes/rules.py (jax) but starts no backend, so the device count set after it still holds."""
    code = ("import os, sys; from jaxtrain.training.parallel_plan import ParallelPlan; "
            "p = ParallelPlan.parse('pipeline=2,data=4,schedule=interleaved2,split=2/2/2/2,order=contiguous,"
            "kv=allgather,remat=full,attention=blockwise,groups=8/8,dcn=1/2/1/1/1,microbatches=4'); "
            "print(p.device_count(), 'jax' in sys.modules); "
            "assert ParallelPlan.parse(p.spec()) == p; "
            "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=%d' % p.device_count(); "
            "import jax; print(jax.device_count())")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.path.dirname(
        os.path.dirname(os.path.abspath(__file__))), env={**env, "PYTHONPATH": ".", "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["16", "False", "16"]


def test_model_overrides_apply_where_the_model_is_built():
    model = LlamaConfig(remat="none")
    plan = ParallelPlan.parse("data=2,remat=full,attention=pallas_interpret")
    built = plan.apply_to_model(model)
    assert built.remat == "full" and type(built.attention).__name__ == "PallasAttention" and built.attention.interpret
    assert ParallelPlan.parse("data=2").apply_to_model(model) is model  # None: the config's own

    with pytest.raises(ValueError, match="Mamba2Config has no attention setting"):
        plan.apply_to_model(Mamba2Config())


def test_load_experiment_keeps_the_plan_it_validated():
    gin.clear_config()
    try:
        gin.parse_config(["Experiment.model = @LlamaConfig()", "MeshConfig.data = 4", "DeviceGroups.rows = (12, 4)",
                          'Experiment.layout = "data=2,tensor=2,remat=full,microbatches=4"'])
        from jaxtrain.training.config import load_experiment
        exp = load_experiment()
    finally:
        gin.clear_config()
    assert exp.plan is exp.plan  # built once, by load_experiment; the Trainer reads this one
    assert exp.plan == ParallelPlan.from_experiment(exp)
    assert (exp.plan.mesh.sizes(), exp.plan.groups, exp.plan.remat, exp.plan.microbatches) == \
        (dict(pipeline=1, data=2, context=1, expert=1, tensor=2), (12, 4), "full", 4)
    assert dataclasses.replace(exp, layout="data=4").plan.mesh.data == 4  # a changed Experiment: its own plan


def test_readme_documents_every_layout_key():
    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    assert plan_keys.markdown_table() in readme, "regenerate the README's layout-key table from plan_keys.markdown_table()"


@pytest.mark.parametrize("bindings, devices", [
    (["MeshConfig.data = 4", 'Experiment.layout = "rules=fsdp,remat=full"'], 4),  # no axis named: gin's mesh
    (["MeshConfig.data = 4", 'Experiment.layout = "data=2,tensor=4"'], 8),
    (["MeshConfig.data = 4", "DeviceGroups.rows = (12, 4)"], 8),  # the mesh is one group's
    (["MeshConfig.data = 2", 'Experiment.layout = "data=4,groups=8/4/4"'], 12),
])
def test_the_cli_sizes_simulated_devices_by_the_plan_before_jax_starts(tmp_path, monkeypatch, bindings, devices):
    from jaxtrain.cli import launch

    config = tmp_path / "run.gin"
    config.write_text("\n".join(bindings) + "\n")
    monkeypatch.setenv("XLA_FLAGS", "")
    launch.simulate_devices_if_needed([str(config)], [], 1)
    assert os.environ["XLA_FLAGS"] == f"--xla_force_host_platform_device_count={devices}"


def test_bench_layouts_carry_the_model_overrides():
    from jaxtrain.cli.bench import apply_layout

    base = Experiment(model=LlamaConfig(remat="none"), mesh=MeshConfig(data=4), train=TrainConfig())
    exp, plan = apply_layout(base, "data=2,tensor=2,attention=blockwise,remat=full")
    assert plan == ParallelPlan.parse("data=2,tensor=2,attention=blockwise,remat=full")
    assert exp.model.remat == "full" and type(exp.model.attention).__name__ == "BlockwiseAttention"
    with pytest.raises(ValueError, match="groups= is not benchmarked"):
        apply_layout(base, "data=2,groups=4/4")
