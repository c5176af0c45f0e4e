"""Data parallelism over device groups with uneven batch shares (jaxtrain/training/device_groups.py,
group_step.py): two groups of 4 devices taking 12 and 4 rows of each 16-row batch, in microbatches
of 4 rows (3 and 1 microbatches), train exactly as one program with 4 microbatches on the whole
batch — losses, every metric and the parameters — under FSDP x tensor parallel within the groups
and for a MoE model with expert parallelism (whose aux loss is per microbatch). Checkpoints move
between runs with and without groups; two processes, a group each, equal one process; bad shares
are errors before anything compiles."""
import dataclasses
import json

import gin
import jax
import numpy as np
import pytest
from flax import nnx

from helpers import TINY_LLAMA, assert_finite, assert_trees_close, random_packed_batch
from jaxtrain.api import Run
from jaxtrain.cli import eval as eval_cli
from jaxtrain.cli.launch import DEFAULT_GIN
from jaxtrain.data.packing import make_train_iterator, tokenize_text_stream
from jaxtrain.data.tokenizer import load_tokenizer
from jaxtrain.generate.loading import load_workdir
from jaxtrain.training.config import TrainConfig, load_experiment, parse_gin
from jaxtrain.training.device_groups import DeviceGroups, one_mesh_program
from jaxtrain.training.parallel_plan import ParallelPlan
from jaxtrain.models.deepseek import DeepSeekConfig
from jaxtrain.models.layers.router import RouterConfig
from pipeline_helpers import PIPELINE_OPT, initial_params
from ports import reserved_port
from processes import start_train_processes, wait_for

pytestmark = [pytest.mark.slow]

TRAIN = TrainConfig(steps=4, global_batch=16, seq_len=16)
SHARES = DeviceGroups(rows=(12, 4))
# One MoE layer after a dense one; the correction bias makes the update use the summed routing
# statistics too (after_update), the aux loss its per-microbatch normalization.
TINY_MOE = DeepSeekConfig(
    vocab_size=96, embed=32, layers=2, first_k_dense=1, heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=4, v_head_dim=8, mlp=64, expert_mlp=16, shared_experts=1,
    router=RouterConfig(num_experts=8, top_k=2, n_group=4, topk_group=2, aux_loss_weight=0.1, z_loss_weight=1e-3,
                        correction_bias=True))

# Adam turns a float32 rounding difference in a near-zero gradient into up to a whole step
# (lr 1e-2): a thousandth of a step is rounding, a wrong share weighting moves whole steps.
PARAMS_ATOL = 1e-5


def batch(i, vocab):
    return random_packed_batch(100 + i, TRAIN.global_batch, TRAIN.seq_len, vocab)


def one_program_and_groups(model, plan):
    """(run on the first 4 devices, run over two groups of 4: devices 0-3 and 4-7), same start."""
    params0 = initial_params(model, seed=1)
    one = Run.create(model, plan, train=TRAIN, optimizer=PIPELINE_OPT, params=params0)
    groups = Run.create(model, plan, train=TRAIN, optimizer=PIPELINE_OPT, params=params0, groups=SHARES,
                        devices=jax.devices()[:8])
    assert [m.devices.size for m in groups.setup.layout.meshes] == [4, 4]
    assert groups.setup.shares.microbatches == (3, 1)
    return one, groups


def assert_same_metrics(got: list[dict], want: list[dict]):
    assert_finite((got, want), "metrics")
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for key in w:
            np.testing.assert_allclose(g[key], w[key], rtol=1e-5, atol=1e-7, err_msg=key)


def test_uneven_groups_train_as_one_program_and_share_checkpoints(tmp_path):
    model = TINY_LLAMA
    one, groups = one_program_and_groups(model, "data=2,tensor=2,rules=fsdp,microbatches=4")
    want, got = [], []
    for run, metrics, where in ((one, want, "one"), (groups, got, "groups")):
        for i in range(3):
            metrics.append(run.step(batch(i, model.vocab_size)))
            if i == 1:
                assert run.save(str(tmp_path / where)) == 2
    assert_same_metrics(got, want)
    assert_trees_close(jax.device_get(groups.params), jax.device_get(one.params), rtol=1e-5, atol=PARAMS_ATOL)
    np.testing.assert_allclose(groups.evaluate(batch(3, model.vocab_size))["loss"],
                               one.evaluate(batch(3, model.vocab_size))["loss"], rtol=1e-6)

    # A checkpoint of either run continues in the other: step 3 again, the same numbers.
    assert groups.restore(str(tmp_path / "one")) == 2 and one.restore(str(tmp_path / "groups")) == 2
    assert_same_metrics([groups.step(batch(2, model.vocab_size)), one.step(batch(2, model.vocab_size))],
                        [want[2], want[2]])


@pytest.mark.extended  # ~40 s; the uneven dense groups above and test_run_configs' device-groups case stay in the suite
def test_moe_groups_train_as_one_program():
    """Expert parallelism within each group; the aux loss is a mean per microbatch, averaged over
    the 4 microbatches of both groups."""
    one, groups = one_program_and_groups(TINY_MOE, "data=2,expert=2,microbatches=4")
    want = [one.step(batch(i, TINY_MOE.vocab_size)) for i in range(3)]
    got = [groups.step(batch(i, TINY_MOE.vocab_size)) for i in range(3)]
    aux_losses = [key for key in got[0] if key.endswith("/aux_loss")]
    assert aux_losses and all(got[0][key] > 0 for key in aux_losses), got[0]
    assert_same_metrics(got, want)
    assert_trees_close(jax.device_get(groups.params), jax.device_get(one.params), rtol=1e-5, atol=PARAMS_ATOL)


TWO_PROCESS_BINDINGS = [
    "LlamaConfig.embed=32", "LlamaConfig.layers=2", "LlamaConfig.mlp=64", "LlamaConfig.heads=4",
    "LlamaConfig.kv_heads=2", "TrainConfig.seq_len=32", "TrainConfig.global_batch=16", "TrainConfig.steps=3",
    "ObserveConfig.eval_every=0", "ObserveConfig.eval_batches=1", "CheckpointConfig.checkpoint_every=0",
    "Experiment.layout='data=4,microbatches=4'", "DeviceGroups.rows=(12, 4)"]


@pytest.mark.multiprocess
@pytest.mark.end_to_end
@pytest.mark.extended  # its one-process twins above stay in the suite
def test_one_group_per_process_trains_as_one_process(tmp_path, capsys):
    """The CLI in two processes of 4 devices (gin DeviceGroups.rows: process 0's group takes 12 rows,
    process 1's 4) against one process running the plain plan on the same corpus batches: the
    losses, the parameters its final checkpoint restores into a run without groups, and the eval
    CLI on its workdir."""
    with reserved_port() as port:
        procs = start_train_processes(tmp_path, TWO_PROCESS_BINDINGS, port, xla_flags=(
            "--xla_force_host_platform_device_count=4"))
        try:  # the reference runs meanwhile, on this process's devices
            gin.clear_config()
            parse_gin([DEFAULT_GIN], TWO_PROCESS_BINDINGS)
            try:
                exp = load_experiment()
            finally:
                gin.clear_config()
            t = exp.train
            assert exp.groups == SHARES
            one = Run.create(exp.model, ParallelPlan.from_experiment(exp), train=t, optimizer=exp.optimizer,
                             seed=t.seed)
            data = make_train_iterator(exp.data, seq_len=t.seq_len, global_batch=t.global_batch, seed=t.seed)
            want = [one.step(next(data))["loss"] for _ in range(t.steps)]
        finally:
            outputs = wait_for(procs)
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    assert "2 device groups of 4 devices, rows (12, 4)" in outputs[0]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    got = [r["loss"] for r in rows if r["kind"] == "train"]
    assert np.isfinite(want).all() and np.isfinite(got).all(), (want, got)
    np.testing.assert_allclose(got, want, rtol=1e-5)

    want_params = jax.device_get(one.params)
    assert one.restore(str(tmp_path / "checkpoints")) == t.steps
    assert_trees_close(jax.device_get(one.params), want_params, rtol=1e-5, atol=PARAMS_ATOL)

    # The eval CLI reads the workdir's config (groups and all) and scores on the first group's devices.
    text = tmp_path / "text.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
                    "must be in want of a wife." * 4)
    try:
        assert eval_cli.main([f"--workdir={tmp_path}", f"--data={text}"]) == 0
    finally:
        gin.clear_config()
    scored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    want_eval = eval_cli.evaluate_stream(one.setup, one.state.params, tokenize_text_stream(text, "bytes"),
                                         seq_len=t.seq_len, stride=t.seq_len // 2, batch_size=t.global_batch,
                                         pad_id=load_tokenizer("bytes").pad_id)
    assert scored["checkpoint_step"] == t.steps and scored["tokens"] == want_eval["tokens"]
    np.testing.assert_allclose(scored["loss"], want_eval["loss"], rtol=1e-5)


@pytest.mark.parametrize("plan,groups,devices,message", [
    ("data=4,microbatches=4", (12, 3), 8, r"DeviceGroups.rows=\(12, 3\) sum to 15, not TrainConfig.global_batch=16"),
    ("data=4,microbatches=4", (10, 6), 8, r"group 0's 10 rows are not whole microbatches of global_batch=16 / "
                                          r"microbatches=4 = 4 rows"),
    ("data=4,microbatches=8", (12, 4), 8, r"2 rows per microbatch is not divisible by the data-parallel size 4"),
    ("data=4,microbatches=4", (12, 0, 4), 12, r"every group needs a positive number of rows"),
    ("data=-1,microbatches=4", (4, 4, 4, 4), 6, r"6 devices do not make 4 equal groups"),
    ("data=4,microbatches=4", (12, 4), [4, 2], r"device groups differ in size: \[4, 2\]"),
    ("data=4,microbatches=4", (8, 4, 4), [4, 4], r"2 device groups given for DeviceGroups.rows of 3 groups"),
    ("pipeline=2,data=2,microbatches=4", (12, 4), 8, r"pipeline=2 within device groups is not supported"),
], ids=["sum", "whole_microbatches", "data_parallel", "empty_group", "split", "sizes", "count", "pipeline"])
def test_bad_groups_are_named_before_compiling(plan, groups, devices, message):
    all_devices = jax.devices()
    if isinstance(devices, list):  # explicit groups of these sizes
        starts = np.cumsum([0] + devices)
        devices = [all_devices[a:b] for a, b in zip(starts[:-1], starts[1:])]
    else:
        devices = all_devices[:devices]
    with pytest.raises(ValueError, match=message):
        Run.create(TINY_LLAMA, plan, train=TRAIN, optimizer=PIPELINE_OPT, groups=DeviceGroups(rows=groups),
                   devices=devices)


def test_row_shares_are_the_microbatches_of_one_program():
    """Group g's rows, cut by the groups' own split_microbatches, are global microbatches first(g)...:
    microbatch j of the global batch is rows j, j+M, j+2M, ..."""
    shares = DeviceGroups(rows=(12, 4)).shares(global_batch=16, microbatches=4)
    assert shares.microbatches == (3, 1) and shares.total_microbatches == 4
    first = shares.row_indices(0).reshape(4, 3)  # [row within microbatch, the group's microbatch]
    np.testing.assert_array_equal(first.T, [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14]])
    np.testing.assert_array_equal(shares.row_indices(1), [3, 7, 11, 15])
    assert dataclasses.replace(SHARES, rows=(16,)).shares(16, 4).row_indices(0).tolist() == list(range(16))


def test_one_mesh_program_is_the_first_groups_program_and_generation_loads_a_grouped_run(tmp_path):
    """Eval and generation compile one program on one mesh: a plan over device groups gives its
    groups' own layout on the first group's devices (one_mesh_program; the callers never branch on
    the variant), any other plan itself. Generation's load_workdir restores a grouped run's
    checkpoint onto that program: the saved parameters, on devices 0-3, no `groups` axis."""
    plan = ParallelPlan.parse("data=4,microbatches=4")
    grouped = dataclasses.replace(plan, groups=SHARES.rows)
    devices = jax.devices()
    assert one_mesh_program(grouped) == (plan, devices[:4])
    assert one_mesh_program(grouped, [devices[4:8], devices[:4]]) == (plan, devices[4:8])  # groups as given
    assert one_mesh_program(plan) == (plan, devices[:4])  # a fixed mesh: the first devices it needs
    fill = ParallelPlan.parse("data=-1")
    assert one_mesh_program(fill, devices[:8]) == (fill, devices[:8])

    run = Run.create(TINY_LLAMA, grouped, train=TRAIN, optimizer=PIPELINE_OPT, params=initial_params(TINY_LLAMA, 1),
                     devices=devices[:8])
    run.save(str(tmp_path / "checkpoints"))
    model = dataclasses.asdict(TINY_LLAMA)
    gin.clear_config()
    try:
        parse_gin([DEFAULT_GIN], [*(f"LlamaConfig.{k}={model[k]!r}" for k in ("vocab_size", "embed", "layers", "heads",
                                                                            "kv_heads", "mlp")),
                                  "TrainConfig.global_batch=16", "TrainConfig.seq_len=16",
                                  "Experiment.layout='data=4,microbatches=4'", "DeviceGroups.rows=(12, 4)"])
        loaded = load_workdir(str(tmp_path))
    finally:
        gin.clear_config()
    assert list(loaded.mesh.devices.flat) == devices[:4] and "groups" not in loaded.mesh.axis_names
    assert_trees_close(jax.device_get(nnx.to_pure_dict(nnx.state(loaded.model))), jax.device_get(run.params), rtol=0)
