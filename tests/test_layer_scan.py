"""The one layer loop (models/layers/layer_scan.py) and a pipeline stage built on it
(models/stage_program.py): a scan with a switch on each step's kind equals a Python loop over the
same layers (outputs, aux rows per kind, gradients; masked steps are no-ops), under every remat
policy; a hybrid stage is ONE scan over its slots whatever the number of runs of one kind in its
slot pattern, and on an uneven split both stages (and both passes of an interleaved split) equal
the model's own layers applied one by one."""
import dataclasses

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import assert_trees_close
from jaxtrain.meshes.pipeline_split import plan_stages
from jaxtrain.models.layers.layer_scan import scan_layers
from jaxtrain.models.layers.pattern_stack import layer_of, pattern_slots, read_indices
from jaxtrain.models.stage_program import StageProgram, layer_sequence, layer_stacks
from test_nemotron_h import TINY_NEMOTRON_H

pytestmark = [pytest.mark.slow]  # compiles a tiny hybrid model's stage

D = 6


# -- the loop itself, on three toy kinds of layer (pure jnp) -------------------------------------
def dense(x, w):
    y = jnp.tanh(x @ w["w"]) + x
    return y, {"sum": jnp.sum(y)}


def gated(x, w):
    y = x * w["a"] + jnp.sin(x @ w["b"])
    return y, {"mean": jnp.mean(y), "first": y[0, :3]}


def mlp(x, w):
    return x + jax.nn.relu(x @ w["up"]) @ w["down"], {}


LAYERS = [dense, gated, mlp]
KINDS = [0, 1, 1, 2, 0, 1, 2, 0, 0]  # runs of one kind of length 1 and 2
KEEP = np.array([1, 1, 0, 1, 1, 1, 0, 1, 1], bool)  # two masked steps (padding slots)


def toy_stacks(seed=0):
    rng = np.random.default_rng(seed)
    n = [KINDS.count(k) for k in range(3)]
    r = lambda *shape: jnp.asarray(0.4 * rng.standard_normal(shape), jnp.float32)
    return ({"w": r(n[0], D, D)}, {"a": r(n[1], D), "b": r(n[1], D, D)},
            {"up": r(n[2], D, 2 * D), "down": r(n[2], 2 * D, D)})


def loop_reference(stacks, x):
    """Each step's layer statically sliced, in step order; masked steps skipped with zero aux."""
    slots = pattern_slots(KINDS)
    per_kind = {k: [] for k in range(3)}
    for (kind, index), keep in zip(slots, KEEP):
        y, aux = LAYERS[kind](x, jax.tree.map(lambda a: a[index], stacks[kind]))
        x = y if keep else x
        per_kind[kind].append(aux if keep else jax.tree.map(jnp.zeros_like, aux))
    return x, [jax.tree.map(lambda *a: jnp.stack(a), *per_kind[k]) for k in range(3)]


def scanned(stacks, x, remat):
    weights_at = lambda read: tuple(jax.tree.map(lambda a: a[read[k]], s) for k, s in enumerate(stacks))
    return scan_layers(LAYERS, x, read_indices(pattern_slots(KINDS), range(3)), weights_at,
                       kind_ids=KINDS, keep=jnp.asarray(KEEP), remat=remat)


def loss_of(run):
    def loss(stacks, x):
        y, aux = run(stacks, x)
        return jnp.sum(y ** 2) + jnp.sum(aux[0]["sum"]) + 3 * jnp.sum(aux[1]["first"]) + jnp.sum(aux[1]["mean"])
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


@pytest.fixture(scope="module")
def toy():
    stacks, x = toy_stacks(), jnp.asarray(np.random.default_rng(1).standard_normal((3, D)), jnp.float32)
    return stacks, x, jax.jit(loop_reference)(stacks, x), loss_of(loop_reference)(stacks, x)


@pytest.mark.parametrize("remat", ["none", "full", "dots"])
def test_switched_scan_equals_a_python_loop(toy, remat):
    stacks, x, (ref_y, ref_aux), (ref_loss, ref_grads) = toy
    y, aux = jax.jit(scanned, static_argnums=2)(stacks, x, remat)
    assert_trees_close((y, aux), (ref_y, ref_aux), rtol=1e-6, atol=1e-6)
    assert [a["sum"].shape[0] for a in aux[:1]] == [KINDS.count(0)]  # rows of its own kind only
    loss, grads = loss_of(lambda s, x: scanned(s, x, remat))(stacks, x)
    assert np.abs(grads[0][2]["up"]).max() > 0  # the mlp layer that ran gets a gradient ...
    np.testing.assert_array_equal(grads[0][2]["up"][1], 0.0)  # ... the masked one none
    assert_trees_close((loss, grads), (ref_loss, ref_grads), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("remat", ["none", "dots"])
def test_the_backward_keeps_no_copy_of_the_weights_each_step_sliced(toy, remat):
    stacks, x, _, _ = toy
    _, backward = jax.vjp(lambda s, x: scanned(s, x, remat), stacks, x)
    kept = {tuple(r.shape) for r in jax.tree.leaves(backward)}  # the residuals the backward holds
    per_step_copies = {(len(KINDS),) + w.shape[1:] for s in stacks for w in jax.tree.leaves(s)}
    assert (len(KINDS), 3, D) in kept or remat != "none"  # under `none` the activations are kept ...
    assert not kept & per_step_copies, kept  # ... but never one layer's weights per step


def test_one_kind_scans_its_weights_as_the_scan_input(toy):
    stacks, x, _, _ = toy
    only = stacks[0]
    y, (aux,) = jax.jit(lambda s, x: scan_layers([dense], x, s))(only, x)
    ref = x
    for i in range(only["w"].shape[0]):
        ref, _ = dense(ref, {"w": only["w"][i]})
    assert_trees_close(y, ref, rtol=1e-6, atol=1e-6)
    assert aux["sum"].shape == (only["w"].shape[0],)


# -- a pipeline stage of a hybrid model ------------------------------------------------------------
# Kinds alternate (7 runs of one kind in 8 layers): run by run, a stage was one scan per run.
HYBRID = dataclasses.replace(TINY_NEMOTRON_H, pattern=("mamba", "moe", "mamba", "attention", "moe", "mlp",
                                                       "mamba", "moe"))
BATCH, LENGTH = 2, 12


@pytest.fixture(scope="module")
def hybrid():
    abstract = nnx.eval_shape(lambda: HYBRID.build(nnx.Rngs(0)))  # built under jit: faster than eagerly
    model = nnx.merge(nnx.graphdef(abstract), jax.jit(lambda: nnx.state(HYBRID.build(nnx.Rngs(0))))())
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((BATCH, LENGTH, HYBRID.embed)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(LENGTH), (BATCH, LENGTH))
    segments = jnp.asarray([[1] * 7 + [2] * 5, [1] * 12])  # packed: a second document in row 0
    return model, (x, positions, segments)


def stage_inputs(model, plan, stage: int):
    """Stage `stage`'s weights [passes, slots, ...] (padding slots zero, as the pipeline layout
    lays them out) and validity, per kind."""
    stacks = {kind: nnx.to_pure_dict(nnx.state(s.layers)) for kind, s in layer_stacks(model).items()}
    params, valid = {}, {}
    for kind in plan.kinds:
        index = plan.index[kind][stage]  # [passes, slots]
        mask = index >= 0
        params[kind] = jax.tree.map(
            lambda a: jnp.where(mask.reshape(mask.shape + (1,) * (a.ndim - 1)), a[np.maximum(index, 0)], 0), stacks[kind])
        valid[kind] = jnp.asarray(mask)
    return params, valid


def chunk_reference(model, plan, chunk: int, inputs):
    """The chunk's layers of the model applied one by one with the canonical weights."""
    x, positions, segments = inputs
    stacks = layer_stacks(model)
    bounds = np.cumsum((0,) + plan.counts)
    aux = {}
    for kind, index in layer_sequence(model)[bounds[chunk]:bounds[chunk + 1]]:
        graphdef, state = nnx.split(stacks[kind].layers)
        x, out = nnx.merge(graphdef, layer_of(state, index))(x, positions, segments)
        aux.setdefault(kind, []).append(out)
    return x, aux


def switches(jaxpr, branches: int) -> int:
    """Switches over `branches` kinds in `jaxpr`, outside any scan nested in it."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "cond" and len(eqn.params["branches"]) == branches
        if eqn.primitive.name != "scan":
            count += sum(switches(sub, branches) for sub in jax.extend.core.jaxprs_in_params(eqn.params))
    return count


def scans_with_switch(jaxpr, branches: int) -> list[int]:
    """Lengths of every scan (at any depth) whose body switches over `branches` kinds."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan" and switches(eqn.params["jaxpr"].jaxpr, branches):
            found.append(eqn.params["length"])
        found += [n for sub in jax.extend.core.jaxprs_in_params(eqn.params) for n in scans_with_switch(sub, branches)]
    return found


def test_a_hybrid_stage_is_one_scan_over_its_slots(hybrid):
    model, (x, positions, segments) = hybrid
    plan = plan_stages(layer_sequence(model), stages=2, repeats=1, counts=(5, 3))
    runs, kinds = len(plan.runs()), len(plan.kinds)
    assert runs >= 5 and runs > kinds, plan.runs()  # alternating kinds: many runs of one kind
    program = StageProgram(model, plan.pattern, passes=1, loop="switched")
    params, valid = stage_inputs(model, plan, 0)

    def loss(params, x):
        y, aux = program(params, valid, 0, x, positions, segments)
        return jnp.sum(y ** 2)

    forward = jax.make_jaxpr(lambda p, x: program(p, valid, 0, x, positions, segments))(params, x).jaxpr
    top = [e for e in forward.eqns if e.primitive.name == "scan"]
    assert [e.params["length"] for e in top] == [len(plan.pattern)], [e.params["length"] for e in top]
    assert scans_with_switch(forward, kinds) == [len(plan.pattern)]
    # under autodiff: the forward scan and its transpose, nothing per run
    assert scans_with_switch(jax.make_jaxpr(jax.grad(loss))(params, x).jaxpr, kinds) == [len(plan.pattern)] * 2


@pytest.mark.parametrize("loop", ["runs", "switched"])
@pytest.mark.parametrize("repeats,counts", [(1, (5, 3)), (2, (3, 1, 2, 2))], ids=["gpipe_5_3", "interleaved_3_1_2_2"])
def test_every_stage_of_an_uneven_split_equals_its_layers_one_by_one(hybrid, repeats, counts, loop):
    model, inputs = hybrid
    plan = plan_stages(layer_sequence(model), stages=2, repeats=repeats, counts=counts)
    assert sum(sum(p) for p in plan.padding().values()) > 0  # padding slots in play
    program = StageProgram(model, plan.pattern, passes=repeats, loop=loop)
    run = jax.jit(lambda params, valid, repeat: program(params, valid, repeat, *inputs))
    for stage in range(2):
        params, valid = stage_inputs(model, plan, stage)
        for repeat in range(repeats):
            y, aux = run(params, valid, repeat)
            ref_y, ref_aux = jax.jit(lambda: chunk_reference(model, plan, repeat * 2 + stage, inputs))()
            assert_trees_close(y, ref_y, rtol=1e-5, atol=1e-6)
            for kind, rows in ref_aux.items():  # the kind's valid slots, in slot order
                mine = np.flatnonzero(plan.valid(kind)[stage, repeat])
                assert_trees_close(jax.tree.map(lambda a: a[mine], aux[kind]),
                                   jax.tree.map(lambda *a: jnp.stack(a), *rows), rtol=1e-5, atol=1e-6)
            for kind in plan.kinds:  # padding slots report nothing
                pad = np.flatnonzero(~plan.valid(kind)[stage, repeat])
                for leaf in jax.tree.leaves(aux[kind]):
                    np.testing.assert_array_equal(np.asarray(leaf)[pad], 0)


def residual_bytes(fn, *args) -> int:
    """Bytes of what the backward pass of `fn` holds (the leaves of its vjp), counted from the trace."""
    kept = jax.eval_shape(lambda *a: jax.tree.leaves(jax.vjp(fn, *a)[1]), *args)
    return sum(int(np.prod(leaf.shape)) * leaf.dtype.itemsize for leaf in kept)


def test_a_switched_stage_keeps_run_by_runs_residuals_only_under_remat_full(hybrid):
    """What the two loops keep for the backward pass, counted on the traced program (no mesh): under
    remat `full` each slot keeps its input either way, so the switch holds what run by run holds;
    under `none` a switch keeps every branch's residuals at every slot (why training scans such
    a stage run by run). XLA's compiled temp of a pipelined step can still differ (docs/pipeline.md,
    pipeline section: the compiled loop of a sharded step keeps more); this pins the traced part."""
    model, (x, positions, segments) = hybrid
    plan = plan_stages(layer_sequence(model), stages=2, repeats=1, counts=(5, 3))
    params, valid = stage_inputs(model, plan, 0)
    kept = {}
    for remat, loop in [("layer", "runs"), ("layer", "switched"), ("none", "runs"), ("none", "switched")]:
        program = StageProgram(model, plan.pattern, passes=1, remat=remat, loop=loop)
        kept[remat, loop] = residual_bytes(lambda p, x: program(p, valid, 0, x, positions, segments), params, x)
    assert kept["layer", "switched"] <= 1.01 * kept["layer", "runs"], kept  # remat full: the same
    assert kept["none", "switched"] >= 1.5 * kept["none", "runs"], kept  # every kind's residuals per slot



@pytest.mark.extended  # two pipelined train steps compiled: ~1 min on two cores
def test_a_pipelined_switched_stage_holds_about_what_run_by_run_holds(monkeypatch):
    """XLA's temp of the pipelined train step of an alternating hybrid under remat full, compiled
    with each loop: the plain switched stage within 15% of run by run (`stage_loop` chooses the
    kinds loop there now: tests/test_kind_residuals.py).
    Untied, a step's slice indices were constants, and the tick loop hoisted every kind's weight
    slices for every slot, and what derives from them, out of its body (width 256: 0.099 against
    0.065 GiB; 0.072 tied)."""
    from jaxtrain.pipeline.config import PipelineConfig
    from jaxtrain.training.config import TrainConfig
    from jaxtrain.training.optim import OptimizerConfig
    from jaxtrain.training.parallel_plan import ParallelPlan
    from jaxtrain.training.train_setup import build_train_setup

    model = dataclasses.replace(HYBRID, embed=128, heads=8, head_dim=16, mlp=256, expert_mlp=64, shared_expert_mlp=64,
                                remat="full")
    train = TrainConfig(global_batch=32, seq_len=64)
    temp = {}
    for loop in ("runs", "switched"):
        plan = ParallelPlan.parse("pipeline=2,data=8,microbatches=4").with_pipeline(
            PipelineConfig(stages_layers=(5, 3), stage_loop=loop))
        setup = build_train_setup(model, plan, train, OptimizerConfig())
        traced = setup.train_step.trace(setup.state.abstract, setup.abstract_batch(32, 64))
        assert bool(scans_with_switch(traced.jaxpr.jaxpr, 4)) == (loop == "switched")  # the loop asked for
        temp[loop] = traced.lower().compile().memory_analysis().temp_size_in_bytes
    assert temp["switched"] <= 1.15 * temp["runs"], temp
