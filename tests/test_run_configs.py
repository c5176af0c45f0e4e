"""TrainConfig split by concern: old-style bindings (saved config.gin files) still load, each
value in its new home, with one warning line; every bundled config loads without one; the loss
settings (LossConfig) reach the step's loss on every gradient strategy. And the
sharding audit where users train: the Trainer prints it at start, and
ObserveConfig.max_replicated stops a run above the bound (exit 2) before anything is written."""
import glob
import os

import gin
import jax
import numpy as np
import pytest

from helpers import TINY_LLAMA, TINY_LLAMA_BYTES, TINY_OPT, bundled_config_files, random_packed_batch
from jaxtrain.api import Run
from jaxtrain.cli import train as train_cli
from jaxtrain.data.packing import DataConfig
from jaxtrain.resilience.nonfinite import Halt, Skip
from jaxtrain.training.config import Experiment, TrainConfig, load_experiment, parse_gin
from jaxtrain.generate.loading import canonical_model
from jaxtrain.training.device_groups import DeviceGroups
from jaxtrain.training.run_configs import CheckpointConfig, LossConfig, ObserveConfig, ResilienceConfig
from jaxtrain.training.trainer import Trainer
from jaxtrain.meshes.mesh import MeshConfig
from jaxtrain.meshes.sharding_audit import ShardingAuditError

pytestmark = [pytest.mark.fast]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

OLD_STYLE = """
Experiment.model = @LlamaConfig()
TrainConfig.steps = 7
TrainConfig.checkpoint_every = 5
TrainConfig.keep_checkpoints = 2
TrainConfig.nonfinite = @Skip()
TrainConfig.hang_save_s = 99.0
TrainConfig.eval_every = 3
TrainConfig.sample_prompts = ("a", "b")
TrainConfig.z_loss = 0.5
TrainConfig.loss_chunk = 8
"""


def load(text: str = "", files=(), bindings=()):
    gin.clear_config()
    try:
        parse_gin(list(files), [*text.strip().splitlines(), *bindings])
        return load_experiment()
    finally:
        gin.clear_config()


def test_old_style_bindings_go_to_their_new_configurables_with_one_warning_line(capsys):
    exp = load(OLD_STYLE)
    err = capsys.readouterr().err
    want = {("checkpoint", "checkpoint_every"): 5, ("checkpoint", "keep_checkpoints"): 2,
            ("resilience", "nonfinite"): Skip(), ("resilience", "hang_save_s"): 99.0,
            ("observe", "eval_every"): 3, ("observe", "sample_prompts"): ("a", "b"),
            ("loss", "z_loss"): 0.5, ("loss", "loss_chunk"): 8}
    for (part, name), value in want.items():
        assert getattr(getattr(exp, part), name) == value, (part, name)
    assert exp.train == TrainConfig(steps=7)  # the run's shape keeps only its own fields
    assert exp.checkpoint.async_checkpoint and exp.observe.log_every == ObserveConfig().log_every  # unbound: defaults
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("warning: "), err
    for (part, name), _ in want.items():
        new = {"checkpoint": "CheckpointConfig", "resilience": "ResilienceConfig", "observe": "ObserveConfig",
               "loss": "LossConfig"}[part]
        assert f"TrainConfig.{name} is now {new}.{name}" in lines[0]


def test_new_bindings_load_without_a_warning_and_typos_are_named(capsys):
    exp = load("Experiment.model = @LlamaConfig()", bindings=[
        "CheckpointConfig.checkpoint_every = 5", "ResilienceConfig.nonfinite = @Skip()",
        "ObserveConfig.max_replicated = 0.25", "LossConfig.z_loss = 1e-3"])
    assert (exp.checkpoint.checkpoint_every, exp.resilience.nonfinite, exp.observe.max_replicated) == (5, Skip(), 0.25)
    assert exp.loss == LossConfig(z_loss=1e-3)
    assert exp.resilience.hang_save_s == ResilienceConfig().hang_save_s
    assert isinstance(ResilienceConfig().nonfinite, Halt)
    assert "warning" not in capsys.readouterr().err
    with pytest.raises(ValueError, match="TrainConfig has no field 'checkpoint_evry'"):
        load("Experiment.model = @LlamaConfig()\nTrainConfig.checkpoint_evry = 5")
    with pytest.raises(ValueError, match="LossConfig.loss_chunk must be positive, got 0"):
        load("Experiment.model = @LlamaConfig()\nLossConfig.loss_chunk = 0").validate()


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "configs", "*.gin"))),
                         ids=lambda p: os.path.basename(p))
def test_every_bundled_config_loads_without_an_old_binding(path, capsys):
    exp = load(files=bundled_config_files(os.path.basename(path)))
    assert exp.model is not None and isinstance(exp.checkpoint, CheckpointConfig)
    assert "is now" not in capsys.readouterr().err


# -- the sharding audit at the start of a run ----------------------------------------------------
def experiment(max_replicated):
    return Experiment(model=TINY_LLAMA_BYTES, mesh=MeshConfig(data=4), optimizer=TINY_OPT, data=DataConfig(),
                      train=TrainConfig(steps=1, global_batch=8, seq_len=16),
                      observe=ObserveConfig(max_replicated=max_replicated))


def test_trainer_prints_the_audit_and_max_replicated_bounds_it(tmp_path, capsys):
    # rules=dp on data=4 keeps every parameter whole on each of the 4 devices: 3/4 of each
    # device's parameter bytes are copies (independent of the audit's arithmetic).
    devices = jax.devices()[:4]
    trainer = Trainer(experiment(0.76), str(tmp_path / "ok"), devices=devices)
    out = capsys.readouterr().out
    assert "jaxtrain: sharding audit: params" in out and "replicated (75.0%)" in out, out
    assert trainer.sharding_audit.replicated_fraction == pytest.approx(3 / 4)
    with pytest.raises(ShardingAuditError, match=r"75\.0% > tolerance 74\.0%.*ObserveConfig.max_replicated=0.74"):
        Trainer(experiment(0.74), str(tmp_path / "over"), devices=devices)
    assert not (tmp_path / "over").exists()  # stopped before the workdir is touched


def test_train_cli_stops_above_max_replicated_with_exit_2_before_writing(tmp_path, capsys):
    workdir = tmp_path / "run"
    tiny = ["LlamaConfig.embed=32", "LlamaConfig.layers=2", "LlamaConfig.mlp=64", "LlamaConfig.heads=4",
            "LlamaConfig.kv_heads=2", "TrainConfig.seq_len=32", "MeshConfig.data=8", "ObserveConfig.max_replicated=0.5"]
    gin.clear_config()
    try:
        with pytest.raises(SystemExit) as exit_info:
            train_cli.main([f"--workdir={workdir}", *[f"--gin_param={b}" for b in tiny]])
    finally:
        gin.clear_config()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert err.strip().startswith("error: params:") and "ObserveConfig.max_replicated=0.5" in err, err
    assert not (workdir / "checkpoints").exists() and not (workdir / "config.gin").exists()


# -- the loss settings reach the loss ---------------------------------------------------------
Z_LOSS = 0.05


def reference_sums(model_cfg, params, batch) -> tuple[float, float]:
    """(token-mean cross-entropy, token-mean Z_LOSS * logsumexp(logits)^2) over the loss mask, in
    float64 numpy from the unsharded model's logits (no chunking, no mesh)."""
    logits = np.asarray(canonical_model(model_cfg, params)(batch["inputs"], batch["positions"], batch["segment_ids"]),
                        np.float64)
    top = logits.max(-1, keepdims=True)
    log_z = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[..., 0]
    nll = log_z - np.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
    mask = batch["loss_mask"]
    return (nll * mask).sum() / mask.sum(), (Z_LOSS * log_z ** 2 * mask).sum() / mask.sum()


def first_step_metrics(setup, batch) -> tuple[dict, dict]:
    """(the train step's metrics on `batch` from seed 0, the canonical parameters it started from)."""
    state = setup.state.init(0)
    params = jax.device_get(setup.state.to_disk({"params": state.params})["params"])
    _, metrics = setup.train_step(state, setup.device_batch(batch))
    return {k: float(v) for k, v in jax.device_get(metrics).items()}, params


def check_z_loss(metrics, model_cfg, params, batch):
    nll, z = reference_sums(model_cfg, params, batch)
    assert np.isfinite([metrics["loss"], metrics["z_loss"], nll, z]).all(), (metrics, nll, z)
    assert z > 1e-3  # the term is not negligible, so a dropped weight shows
    np.testing.assert_allclose(metrics["loss"], nll, rtol=2e-5)  # the z-loss is not part of the cross-entropy
    np.testing.assert_allclose(metrics["z_loss"], z, rtol=2e-5)


@pytest.mark.slow  # a model-size compile or a whole run: out of the edit-test lane
def test_gin_loss_bindings_reach_the_trainers_loss(tmp_path):
    """LossConfig.z_loss bound in gin: the Trainer's step reports exactly the independent z-loss term;
    LossConfig.loss_chunk bound in gin: its chunks are what the step cuts the sequence into."""
    tiny = ["LlamaConfig.vocab_size=272", "LlamaConfig.embed=32", "LlamaConfig.layers=2", "LlamaConfig.mlp=64",
            "LlamaConfig.heads=4", "LlamaConfig.kv_heads=4", "MeshConfig.data=4", "TrainConfig.global_batch=8",
            "TrainConfig.seq_len=16"]
    exp = load("Experiment.model = @LlamaConfig()", bindings=[*tiny, f"LossConfig.z_loss={Z_LOSS}",
                                                              "LossConfig.loss_chunk=8"])
    assert exp.loss == LossConfig(z_loss=Z_LOSS, loss_chunk=8) and exp.model == TINY_LLAMA_BYTES
    trainer = Trainer(exp, str(tmp_path / "run"), devices=jax.devices()[:4])
    batch = random_packed_batch(7, 8, 16, exp.model.vocab_size)
    metrics, params = first_step_metrics(trainer.setup, batch)
    check_z_loss(metrics, exp.model, params, batch)
    odd = load("Experiment.model = @LlamaConfig()", bindings=[*tiny, "LossConfig.loss_chunk=5"])
    with pytest.raises(ValueError, match="not a multiple of the loss chunk 5"):
        first_step_metrics(Trainer(odd, str(tmp_path / "odd"), devices=jax.devices()[:4]).setup, batch)


@pytest.mark.slow  # a model-size compile or a whole run: out of the edit-test lane
@pytest.mark.parametrize("layout,groups", [("pipeline=2,data=2,microbatches=2", None),
                                           ("data=2,microbatches=2", (8, 8))], ids=["pipeline", "device-groups"])
def test_loss_config_reaches_every_gradient_strategy(layout, groups):
    """Run.create(..., loss=LossConfig(z_loss=...)): the pipelined and the device-group gradients
    report the independent z-loss term too (the plain one: the Trainer test above)."""
    run = Run.create(TINY_LLAMA, layout, train=TrainConfig(global_batch=16, seq_len=16), optimizer=TINY_OPT,
                     groups=DeviceGroups(rows=groups) if groups else None, loss=LossConfig(z_loss=Z_LOSS, loss_chunk=8))
    batch = random_packed_batch(8, 16, 16, TINY_LLAMA.vocab_size)
    metrics, params = first_step_metrics(run.setup, batch)
    check_z_loss(metrics, TINY_LLAMA, params, batch)
