"""The layout planner's parts on tiny models (no compiles): state bytes against the run's own
shardings on a real mesh, the layers' residuals, link classes, shares for mixed groups, the
cluster description's errors, the CLI. Predicted against compiled memory at full size is
tests/test_planner_full_size.py."""
from __future__ import annotations

import dataclasses
import itertools
import json

import gin
import numpy as np
import pytest

from jaxtrain.cli import plan as plan_cli
from jaxtrain.planner.candidates import candidates
from jaxtrain.planner.cluster import Cluster, ClusterError
from jaxtrain.planner.layer_profile import profile_model
from jaxtrain.planner.links import INTER, INTRA, LinkTable, axis_link
from jaxtrain.planner.mixed import balance
from jaxtrain.planner.planner import NoLayoutFits, Planner, Workload, require_fit
from jaxtrain.training.config import TrainConfig, load_experiment, parse_gin
from jaxtrain.training.optim import OptimizerConfig
from jaxtrain.training.parallel_plan import ParallelPlan
from jaxtrain.training.train_setup import build_train_setup
from jaxtrain.meshes.sharding_audit import audit_sharding

from helpers import TINY_LLAMA

pytestmark = [pytest.mark.fast]


def _model(gin_file: str):
    gin.clear_config()
    try:
        parse_gin([gin_file], [])
        return load_experiment().model
    finally:
        gin.clear_config()


@pytest.fixture(scope="module")
def models():
    return {"llama": TINY_LLAMA, "deepseek": _model("configs/deepseek_v2_tiny.gin"),
            "nemotron_h": _model("configs/nemotron_h_tiny.gin")}


def _planner(model, devices=16, device="H100", **workload):
    group = Cluster.from_args(cluster=None, device=device, devices=devices).groups[0]
    w = Workload(model, **{"global_batch": 16, "seq_len": 32, "loss_chunk": 16, **workload})
    return Planner(w, group, LinkTable(group.spec.intra_node_gbps, group.spec.inter_node_gbps))


# ---- state bytes: the planner's abstract arithmetic against the run's real shardings ----------

@pytest.mark.slow  # a model-size compile or a whole run: out of the edit-test lane
@pytest.mark.parametrize("family,spec", [
    ("llama", "data=16,rules=dp"),
    ("llama", "data=4,tensor=4,rules=fsdp"),
    ("llama", "data=8,tensor=2,rules=zero1+opt_host"),
    ("llama", "pipeline=2,data=4,tensor=2,rules=fsdp,microbatches=2"),
    ("deepseek", "data=2,context=2,expert=2,tensor=2,rules=fsdp+experts_folded"),
    ("deepseek", "data=4,expert=4,rules=zero1+expert_tp"),
    ("deepseek", "pipeline=2,data=2,context=2,tensor=2,rules=fsdp+experts_folded,microbatches=2"),
    ("nemotron_h", "data=8,tensor=2,rules=fsdp_sp"),
])
def test_state_bytes_equal_the_runs_own_shardings(models, family, spec):
    model = models[family]
    plan = ParallelPlan.parse(spec)
    setup = build_train_setup(model, plan, TrainConfig(global_batch=16, seq_len=32), OptimizerConfig())
    params = audit_sharding(setup.state.abstract.params, name="params")
    opt = audit_sharding(setup.state.abstract.opt_state, name="opt")
    planned = _planner(model).state(dataclasses.replace(plan, remat="none"))
    assert planned.params == params.bytes_per_device > 0
    assert planned.optimizer == opt.bytes_per_device
    assert planned.optimizer_host == opt.host_bytes_per_device
    assert ("opt_host" in spec) == (planned.optimizer_host > 0)


# ---- what the layers keep for the backward pass --------------------------------------------

@pytest.mark.parametrize("family", ["llama", "deepseek", "nemotron_h"])
def test_remat_full_keeps_only_each_layers_inputs_and_the_policies_are_ordered(models, family):
    model = models[family]
    profile = profile_model(dataclasses.replace(model, remat="none"))
    itemsize = np.dtype(getattr(model, "dtype", "float32")).itemsize
    for kind in profile.kinds:
        full = kind.residuals["full"]
        # the residual stream, and the positions and segment ids where the layer reads them
        stream = profile.embed * itemsize
        assert sum(r.token_bytes for r in full) in (stream, stream + 4, stream + 8), kind.kind
        assert sum(r.fixed_bytes for r in full) < 1024  # constants such as RoPE's frequencies, no weights
        per_token = {p: sum(r.token_bytes for r in kind.residuals[p]) for p in ("none", "dots_no_batch", "full")}
        assert per_token["none"] > per_token["dots_no_batch"] > per_token["full"], (kind.kind, per_token)
        # without remat a bf16 model keeps its weights cast for the matmuls: about a copy of the layer
        assert sum(r.fixed_bytes for r in kind.residuals["none"]) <= kind.param_bytes
    assert profile.non_layer_params + sum(k.params * k.count for k in profile.kinds) == model.param_count()
    experts = [k for k in profile.kinds if k.top_k]
    assert (family == "llama") == (not experts)


# ---- links and shares -------------------------------------------------------------------------

def test_an_axis_crosses_nodes_when_its_devices_span_more_than_one():
    sizes = dict(pipeline=1, data=2, context=1, expert=1, tensor=8)
    assert axis_link("tensor", sizes, 8) == INTRA and axis_link("data", sizes, 8) == INTER
    sizes = dict(pipeline=2, data=2, context=1, expert=1, tensor=4)
    assert axis_link("data", sizes, 8) == INTRA and axis_link("pipeline", sizes, 8) == INTER


def test_measured_links_take_the_largest_messages_bus_bandwidth(tmp_path):
    mesh = dict(pipeline=1, data=2, context=1, expert=1, tensor=8)
    rows = [dict(mesh=mesh, axes="tensor", op="all_reduce", bytes=2**20, busbw_GBps=40.0),
            dict(mesh=mesh, axes="tensor", op="all_reduce", bytes=2**28, busbw_GBps=360.0),
            dict(mesh=mesh, axes="data", op="all_gather", bytes=2**28, busbw_GBps=41.0),
            dict(mesh=mesh, axes="data+tensor", op="all_reduce", bytes=2**26, busbw_GBps=30.0)]
    path = tmp_path / "links.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    links = LinkTable(450, 50).with_measurements(str(path), devices_per_node=8)
    assert links.gbps[INTRA] == 360.0 and links.gbps[INTER] == 41.0
    assert links.seconds(INTER, 41e9) == pytest.approx(1.0)  # measured figures are used as they are
    path.write_text('{"axes": "data"}\n')
    with pytest.raises(ValueError, match=r"links.jsonl:1: not a collectives-bench row"):
        LinkTable(450, 50).with_measurements(str(path), devices_per_node=8)


@pytest.mark.parametrize("seed", range(6))
def test_balanced_shares_are_the_best_split(seed):
    rng = np.random.default_rng(seed)
    groups = int(rng.integers(2, 4))
    seconds = tuple(rng.uniform(0.1, 1.0, groups))
    total = int(rng.integers(groups, 12))
    best = min((s for s in itertools.product(range(1, total + 1), repeat=groups) if sum(s) == total),
               key=lambda s: max(m * t for m, t in zip(s, seconds)))
    shares = balance(total, seconds)
    assert sum(shares) == total and min(shares) >= 1
    assert max(m * t for m, t in zip(shares, seconds)) == pytest.approx(max(m * t for m, t in zip(best, seconds)))


# ---- the cluster description ------------------------------------------------------------------

@pytest.mark.parametrize("description,message", [
    ({"groups": []}, "'groups' must be a non-empty list"),
    ({"groups": [{"kind": "H100"}]}, "group 0: missing 'devices'"),
    ({"groups": [{"devices": 8}]}, "group 0: missing 'kind'"),
    ({"groups": [{"kind": "H100", "devices": 12}]}, "12 devices are not whole nodes of 8"),
    ({"groups": [{"kind": "TPU v9", "devices": 8, "memory_gib": 64}]},
     "kind 'TPU v9' is not built in, so it needs every figure; missing peak_tflops"),
    ({"groups": [{"kind": "H100", "devices": 8, "peak_tflops": -1}]}, "'peak_tflops' must be a positive number"),
    ({"groups": [{"kind": "H100", "devices": 8, "hbm": 80}]}, "unknown field(s) ['hbm']"),
    ({"groups": [{"kind": "H100", "devices": 8}, {"kind": "H100", "devices": 8}]}, "group names must differ"),
    ({"groups": [{"kind": "H100", "devices": 8}], "links": "nowhere.jsonl"}, "links file"),
])
def test_bad_cluster_descriptions_name_the_group_and_field(tmp_path, description, message):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(description))
    with pytest.raises(ClusterError) as err:
        Cluster.from_args(cluster=str(path), device=None, devices=None)
    assert message in str(err.value)


def test_devices_that_do_not_add_up_are_refused(tmp_path):
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps({"groups": [{"name": "a", "kind": "H100", "devices": 8},
                                           {"name": "b", "kind": "RTX PRO 6000", "devices": 8}]}))
    with pytest.raises(ClusterError, match="--devices 24 does not match the 16 devices"):
        Cluster.from_args(cluster=str(path), device=None, devices=24)
    with pytest.raises(ClusterError, match="needs --devices N"):
        Cluster.from_args(cluster=None, device="H100", devices=None)
    with pytest.raises(ValueError, match="unknown device kind 'H300'"):
        Cluster.from_args(cluster=None, device="H300", devices=8)
    cluster = Cluster.from_args(cluster=str(path), device=None, devices=16)
    assert cluster.mixed and cluster.devices == 16


# ---- planning -------------------------------------------------------------------------------

@pytest.mark.slow  # a model-size compile or a whole run: out of the edit-test lane
def test_a_model_that_fits_no_layout_is_told_how_far_it_is():
    from jaxtrain.models.llama import LlamaConfig
    # ~31 B parameters: float32 parameters and their gradients alone are ~124 GB per A100 of two
    # (even with the moments in host memory; Llama-3-8B fits since the update holds one copy, not three)
    big = LlamaConfig(vocab_size=128256, embed=4096, layers=128, heads=32, kv_heads=8, mlp=14336, dtype="bfloat16")
    planner = _planner(big, devices=2, device="A100", global_batch=8, seq_len=4096, loss_chunk=1024)
    ranked = planner.rank(candidates(2, devices_per_node=8, layers=128, seq_len=4096, global_batch=8,
                                     has_experts=False))
    assert ranked and not any(e.fits for e in ranked)
    with pytest.raises(NoLayoutFits) as err:
        require_fit(ranked, planner)
    text = str(err.value)
    assert "no layout fits A100's memory: the smallest" in text and "GiB usable" in text
    best = ranked[0]
    assert f"({best.claimed_bytes / planner.budget:.2f}x)" in text and best.claimed_bytes > planner.budget


@pytest.mark.slow  # a model-size compile or a whole run: out of the edit-test lane
def test_ranked_layouts_fit_and_are_fastest_first(models):
    planner = _planner(models["deepseek"])
    ranked = planner.rank(candidates(16, devices_per_node=8, layers=planner.layers, seq_len=32, global_batch=16,
                                     has_experts=True, remats=("full",), host_optimizer=False))
    fitting = [e for e in ranked if e.fits]
    assert fitting and all(e.claimed_bytes <= planner.budget for e in fitting)
    times = [e.time.total for e in fitting]
    assert times == sorted(times)
    assert not any(e.fits for e in ranked[len(fitting):])
    # layouts a run refuses are not ranked: heads=4 cannot split over tensor=8
    assert all(e.candidate.mesh.tensor <= 4 for e in ranked)
    assert any("heads" in reason or "divisible" in reason for reason in planner.refused)


@pytest.mark.slow  # a model-size compile or a whole run: out of the edit-test lane
def test_cli_prints_the_table_and_the_gin_bindings(tmp_path, capsys):
    out_json = tmp_path / "ranked.jsonl"
    assert plan_cli.main(["--gin_file=configs/default.gin", "--device", "H100", "--devices", "8", "--top", "4",
                          "--remat", "full", f"--json={out_json}"]) == 0
    out = capsys.readouterr().out
    assert "layouts can run" in out and "tok/s/dev" in out
    assert 'Experiment.layout = "pipeline=' in out and ',remat=full,' in out  # remat: part of the plan
    records = [json.loads(line) for line in out_json.read_text().splitlines()]
    best = records[0]
    assert best["fits"] and best["layout"] in out
    parts = best["params_gib"] + best["optimizer_gib"]
    assert parts < best["arguments_gib"] < best["peak_gib"] < best["claimed_gib"]
    assert [r["step_s"] for r in records if r["fits"]] == sorted(r["step_s"] for r in records if r["fits"])


@pytest.mark.slow  # a model-size compile or a whole run: out of the edit-test lane
def test_cli_on_a_mixed_cluster_balances_the_shares(tmp_path, capsys):
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps({"groups": [{"name": "fast", "kind": "H100", "devices": 8},
                                           {"name": "slow", "kind": "A100", "devices": 8}]}))
    assert plan_cli.main(["--gin_file=configs/llama3_8b.gin", f"--cluster={path}", "--global_batch", "32",
                          "--remat", "full", "--no_host_offload", "--top", "3"]) == 0
    out = capsys.readouterr().out
    plan = ParallelPlan.parse(json.loads(out.split("Experiment.layout = ")[1].split("\n")[0]))  # the whole plan
    assert sum(plan.groups) == 32 and plan.groups[0] > plan.groups[1]  # the H100s take the larger share
    assert plan.remat == "full"
    assert "pipeline across the groups" in out and "cannot give that stage fewer layers" in out


def test_cli_bad_cluster_is_one_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text("{not json")
    with pytest.raises(SystemExit) as stop:
        plan_cli.main(["--gin_file=configs/default.gin", f"--cluster={path}"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cluster description") and "not valid JSON" in err and "\n" not in err


@pytest.mark.slow  # a model-size compile or a whole run: out of the edit-test lane
def test_shares_follow_a_calibration_run_over_the_time_model(tmp_path):
    """Measured step times (`bench step --json` rows, one per device kind) decide the shares."""
    from jaxtrain.planner.mixed import plan_groups
    cluster_file = tmp_path / "mixed.json"
    cluster_file.write_text(json.dumps({"groups": [{"name": "a", "kind": "H100", "devices": 8},
                                                   {"name": "b", "kind": "H200", "devices": 8}]}))
    cluster = Cluster.load(str(cluster_file))
    workload = Workload(TINY_LLAMA, global_batch=32, seq_len=32, loss_chunk=16)
    links = LinkTable(450, 50)
    predicted = plan_groups(workload, cluster, links, remats=("full",), host_optimizer=False)
    assert not predicted[0].measured
    # H100 and H200 have the same peak FLOP/s: predicted alike, so shared evenly
    assert predicted[0].balanced == predicted[0].even
    rows = [{"device_kind": "NVIDIA H100 80GB HBM3", "step_time_s": 3.0, "global_batch": 8, "seq_len": 1024,
             "layout": "data=8", "microbatches": 1},
            {"device_kind": "NVIDIA H200", "step_time_s": 1.0, "global_batch": 8, "seq_len": 1024,
             "layout": "data=8", "microbatches": 1}]
    calibration = tmp_path / "calibration.jsonl"
    calibration.write_text("\n".join(json.dumps(r) for r in rows))
    measured = plan_groups(workload, cluster, links, remats=("full",), host_optimizer=False,
                           calibration=str(calibration))
    best = measured[0]
    assert best.measured and best.microbatch_seconds[0] == pytest.approx(3 * best.microbatch_seconds[1])
    a, b = best.balanced
    assert b > a and best.step_seconds(best.balanced) < best.step_seconds(best.even)


def test_the_collectives_bench_output_is_read_as_link_figures(tmp_path):
    """Rows written by `python -m jaxtrain.bench collectives --json` on a real (CPU) mesh."""
    from jaxtrain.cli.bench_collectives import run_all, write_json
    from jaxtrain.meshes.mesh import MeshConfig, build_mesh
    mesh = build_mesh(MeshConfig(data=2, tensor=8))
    rows = run_all(mesh, [("tensor",), ("data",)], ["all_reduce"], [4096, 65536], iters=2, repeats=1)
    path = tmp_path / "links.jsonl"
    write_json(rows, str(path), "cpu", dict(mesh.shape))
    links = LinkTable(450, 50).with_measurements(str(path), devices_per_node=8)
    largest = {r["axes"]: r["busbw_GBps"] for r in rows if r["bytes"] == 65536}
    assert links.gbps[INTRA] == largest["tensor"] and links.gbps[INTER] == largest["data"]
    assert links.source == str(path)


@pytest.mark.slow  # a model-size compile or a whole run: out of the edit-test lane
@pytest.mark.parametrize("capacity_factor", [None, 1.5])
def test_expert_exchange_rows_are_what_the_traced_step_receives(models, capacity_factor):
    """The planner's receive-buffer rows of a MoE layer against the all-to-all the step really
    traces (meshes/expert_exchange.py dropless: [EP, slots, d]; meshes/expert_capacity.py:
    [EP, local experts, capacity, d]): EP 4 over data, tensor 2 as expert data parallel."""
    import jax
    from jax.extend.core import ClosedJaxpr, Jaxpr

    from jaxtrain.planner.layer_profile import TokenShape
    from jaxtrain.planner.memory_model import received_rows

    model = models["deepseek"]
    model = dataclasses.replace(model, router=dataclasses.replace(model.router, capacity_factor=capacity_factor))
    plan = ParallelPlan.parse("data=4,tensor=2,rules=fsdp+experts_folded")
    setup = build_train_setup(model, plan, TrainConfig(global_batch=16, seq_len=32), OptimizerConfig(),
                              devices=jax.devices()[:8])
    jaxpr = jax.make_jaxpr(setup.train_step)(setup.state.abstract, setup.abstract_batch(16, 32))

    def all_to_all_rows(j):  # the token buffers: every dimension but the model width
        for eqn in j.eqns:
            shape = eqn.invars[0].aval.shape if eqn.invars else ()
            if eqn.primitive.name == "all_to_all" and len(shape) >= 3 and shape[-1] == model.embed:
                yield int(np.prod(shape[:-1]))
            for value in eqn.params.values():
                for sub in (value if isinstance(value, (tuple, list)) else (value,)):
                    if isinstance(sub, ClosedJaxpr):
                        yield from all_to_all_rows(sub.jaxpr)
                    elif isinstance(sub, Jaxpr):
                        yield from all_to_all_rows(sub)

    traced = set(all_to_all_rows(jaxpr.jaxpr))
    planner = _planner(model)
    candidate = dataclasses.replace(plan, remat="none")
    state = planner.state(candidate)
    moe = next(k for k in planner.profile.kinds if k.top_k)
    assert moe.capacity_factor == capacity_factor
    leaves = [leaf for leaf in state.leaves if tuple(leaf.path[:len(moe.kind)]) == moe.kind]
    rows, ep, etp = received_rows(moe, leaves, plan.mesh.sizes(), TokenShape(rows=16 / 4, length=32, full_length=32))
    assert (ep, etp) == (4, 1) and len(traced) == 1
    # capacity: ceil(cf x slots / experts) per expert, so at most one row more per expert
    assert rows <= traced.pop() <= rows + model.router.num_experts, (traced, rows)


# ---- the time model's numbers: each collective against the ring formula ----------------------

def ring_bus_bytes(op: str, n: int, nbytes: float) -> float:
    """Bytes each device sends for a collective over n devices in a ring (nccl-tests' bus bytes):
    all-reduce = reduce-scatter then all-gather, 2 (n-1) chunks of nbytes / n; all-gather,
    reduce-scatter, all-to-all: n-1 chunks of nbytes / n; a permute: the whole buffer."""
    chunks = {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1, "all_to_all": n - 1}
    return nbytes if op == "permute" else nbytes * chunks[op] / n


INTRA_GBPS, INTER_GBPS = 400.0, 40.0  # measured figures (not the data sheet's): used as they are


def one_leaf_step(leaf_kw: dict, sizes: dict, *, top_k: int = 0, microbatches: int = 2, itemsize: int = 2):
    """The time model on a state of one parameter (the rest of ParamLeaf from `leaf_kw`) and a
    profile of one layer kind (4 layers, width 64, bf16 activations), no compute: 8 rows of 128
    tokens, 8 devices per node."""
    from jaxtrain.planner.layer_profile import LayerKind, ModelProfile
    from jaxtrain.planner.state_bytes import ParamLeaf, StateBytes
    from jaxtrain.planner.time_model import estimate_time

    sizes = dict(pipeline=1, data=1, context=1, expert=1, tensor=1) | sizes
    kind = LayerKind(kind=("stack",), count=4, in_pattern=False, params=0, param_bytes=0, tensor_params=0,
                     top_k=top_k, capacity_factor=None, residuals={})
    profile = ModelProfile(kinds=(kind,), sequence=(("stack",),) * 4, embed=64, vocab=256, compute_itemsize=2,
                           non_layer_params=0)
    leaf = ParamLeaf(**{"path": ("stack", "w"), "shape": (), "itemsize": itemsize, "bytes_per_device": 0,
                        "layer_count": 4, "gather_axes": (), "compute_axes": (), **leaf_kw})
    state = StateBytes(params=0, optimizer=0, optimizer_host=0, leaves=(leaf,), num_params=0)
    links = LinkTable(INTRA_GBPS, INTER_GBPS, source="measured.jsonl")
    return estimate_time(profile, state, policy="none", flops_per_token=0.0, sizes=sizes, global_batch=8,
                         seq_len=128, microbatches=microbatches, peak_flops=1e15, links=links, devices_per_node=8)


MIB = 2**20
GRAD = 2  # float32 gradients of a bf16 parameter: twice its bytes


@pytest.mark.parametrize("case", ["dp_intra", "dp_inter", "zero1", "fsdp", "tensor", "experts"])
def test_collective_seconds_are_the_ring_formula(case):
    """Predicted seconds per collective kind = ring bus bytes / the link's bandwidth, times how
    often the step runs it (2 microbatches; forward + backward, no remat; 4 layers)."""
    replicated = dict(names=("layers", "mlp", "embed_in"), gathered_bytes=MIB, optimizer_bytes_per_device=MIB)
    layer_bytes = 4 * MIB  # the leaf's 4 layers, one device's compute share
    activation = 8 / 2 * 128 * 64 * 2  # rows per microbatch x tokens x width x bf16, one device
    if case in ("dp_intra", "dp_inter"):  # gradients all-reduced over data, once per microbatch
        n, gbps = (8, INTRA_GBPS) if case == "dp_intra" else (16, INTER_GBPS)
        step = one_leaf_step(replicated, dict(data=n))
        activation /= n
        expected = {"gradients": 2 * ring_bus_bytes("all_reduce", n, GRAD * layer_bytes) / (gbps * 1e9)}
    elif case == "zero1":  # gradients reduce-scattered per microbatch, the parameters gathered once
        step = one_leaf_step(dict(replicated, optimizer_bytes_per_device=MIB // 8), dict(data=8))
        expected = {"gradients": (2 * ring_bus_bytes("reduce_scatter", 8, GRAD * layer_bytes)
                                  + ring_bus_bytes("all_gather", 8, layer_bytes)) / (INTRA_GBPS * 1e9)}
    elif case == "fsdp":  # weights gathered forward and backward, per microbatch; across nodes
        step = one_leaf_step(dict(replicated, optimizer_bytes_per_device=MIB // 16, gather_axes=("data",)),
                             dict(data=16))
        expected = {"fsdp": 2 * 2 * ring_bus_bytes("all_gather", 16, layer_bytes) / (INTER_GBPS * 1e9),
                    "gradients": 2 * ring_bus_bytes("reduce_scatter", 16, GRAD * layer_bytes) / (INTER_GBPS * 1e9)}
    elif case == "tensor":  # a row-parallel weight: its output all-reduced per layer, pass, microbatch
        step = one_leaf_step(dict(names=("layers", "mlp", "embed"), gathered_bytes=MIB, optimizer_bytes_per_device=MIB,
                                  compute_axes=("tensor",)), dict(tensor=4))
        expected = {"tensor": 2 * 4 * 2 * ring_bus_bytes("all_reduce", 4, activation) / (INTRA_GBPS * 1e9)}
    else:  # routed experts over data (EP 8): top-2 copies there and back, per layer, pass, microbatch
        step = one_leaf_step(dict(names=("layers", "experts", "expert_embed", "expert_mlp"), gathered_bytes=MIB,
                                  optimizer_bytes_per_device=MIB, compute_axes=("data",)), dict(data=8), top_k=2)
        activation /= 8
        expected = {"experts": 2 * 2 * 4 * 2 * ring_bus_bytes("all_to_all", 8, 2 * activation) / (INTRA_GBPS * 1e9)}
    assert set(step.by_kind) == set(expected), step.by_kind
    for kind, seconds in expected.items():
        assert step.by_kind[kind] == pytest.approx(seconds, rel=1e-12), kind
