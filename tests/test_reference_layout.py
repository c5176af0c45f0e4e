"""The mission's reference layout end to end, on 16 simulated devices, for a DeepSeek-V2-Lite-shaped
and a Nemotron-3-Nano-shaped model (configs/*_reference_layout.gin: every layer and component of
the real models, widths reduced): pipeline=2 x data=2 x context=2 x tensor=2 for attention and the
dense parts, experts folded over data x context (EP 4) with tensor as expert data parallel (EDP 2),
FSDP, the sequence split over context in the load-balanced order.

Each config is read from its gin file and trained by the Trainer (the CLI's code path: real data,
Orbax checkpoints with the data iterator) from one canonical set of parameters, written as a
parameters-only checkpoint at step 0 (so no run compiles the initializers):
  (a) 20 steps in the reference layout, every loss finite, checkpointing at step 10;
  (b) its first 3 losses equal a 1-device run's (pipeline=1, every axis 1), and each of its first
      3 steps equals one 1-device step from the same state (the reference run's checkpoint of the
      step before): parameters after steps 1, 2 and 3;
  (c) its step-10 checkpoint resumes on 1 device and on data=16 with the uninterrupted run's
      losses for steps 11-13 and its parameters after step 11.
Parameters are compared one step from the same state, not after several steps apart: see
SEEDS for why a top-k router makes the latter a comparison of float noise. The reference run
stops (saving) after each compared step and resumes, so its parameters and checkpoints there can
be read in canonical form. The 1-device Trainer serves (b) and then (c) (one compile): its
workdir's checkpoints are replaced by the reference run's before each run, and a Trainer resumes
from a workdir's latest checkpoint. The Nemotron case is opt-in (JAXTRAIN_SLOW_TESTS=1, see
SLOW): it alone takes ~6 min.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil

import gin
import jax
import numpy as np
import pytest

from jaxtrain.checkpoints.checkpointer import Checkpointer
from jaxtrain.training.config import load_experiment, parse_gin
from jaxtrain.training.trainer import Trainer
from helpers import assert_finite
from jaxtrain.meshes.mesh import MeshConfig
from pipeline_helpers import PIPELINE_OPT, initial_params

# ~20 minutes on two cores: its own target, `make test-reference` (CI runs it after the suite).
pytestmark = [pytest.mark.slow, pytest.mark.reference_layout]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, SAVE_AT, RESUMED = 20, 10, 3
FIRST_STEPS = (1, 2, RESUMED)  # each compared one step from the reference run's state before it
COMPARED = (*FIRST_STEPS, SAVE_AT + 1)  # steps after which parameters are compared
# Parameters after a few Adam steps (lr 1e-2, eps 1e-5: PIPELINE_OPT): every weight moves ~lr per
# step, so a layout bug (a wrong shard, a lost gradient term) moves weights by ~1e-2; another
# reduction order changes the gradient in its last bits, which eps 1e-5 keeps proportional. The
# tolerance is 1% of one step's update, as in tests/test_parallel_equivalence.py.
PARAM_RTOL, PARAM_ATOL = 1e-4, 1e-4

# Top-k routing is discontinuous, and a layout's other reduction order moves a router score by about
# one float32 ulp: a token whose k-th and (k+1)-th selection scores are that close can be routed to
# another expert. That token's contribution then moves between two experts' gradients (a real
# difference, ~1e-5 here), Adam (sign-like on small gradients) turns it into ~lr-sized parameter
# differences, and the correction bias (which follows the load) carries it into later steps. With
# Nemotron's sigmoid scores in [0.5, 1) (ulp 6e-8) over 128 experts, 512 tokens and 23 MoE layers,
# such near-ties are common: seed 0's step 1 holds one (MoE layer 7, token 63, experts 126 / 88,
# 1 ulp apart), and after 3 steps ~6e4 parameters differed by up to 1.2e-2, while each step from
# the SAME state (the reference layout's step 1 or 2 params and moments, one step on one device)
# matched it to 2.2e-7 (2026-12-03). So each config's seed is one whose compared first steps hold
# no near-tie: its smallest gap between the top_k-th and next selection score on one device,
# steps 1-3 (scores recorded by wrapping models.layers.moe.route): Nemotron seed 5 10, 10 and 4
# ulps (seeds 0-11: only 2 and 5 have none under 4); DeepSeek seed 0 passes as measured (5.4e-6
# at step 3). Even without a near-tie, Adam (eps 1e-5) turns rounding of near-eps gradients into
# ~1e-5 parameter differences within two steps, which move router scores by far more than an ulp:
# seed 5 apart for 3 steps still ended 2.35e-4 apart (step 3) and 1.46e-4 (steps 11-13), while one
# step from the same state agrees to <= 4.3e-7 (pipeline=1 x data2 x context2 x tensor2, seed 5).
# Hence the comparisons below are one step each. Another seed, other data or another width may
# need checking again.
SEEDS = {"deepseek_v2_lite_reference_layout": 0, "nemotron3_nano_reference_layout": 5}
# Nemotron's case: its pipelined program compiles in ~11 s (remat full: the kinds loop,
# models/stage_program.stage_loop; ~2 min run by run under remat none, before 2026-12-06), and its
# steps on 16 simulated devices are the rest (~9 s each): beyond the suite's budget. Opt in with
# JAXTRAIN_SLOW_TESTS=1 (make test-reference does).
SLOW = pytest.mark.skipif(not os.environ.get("JAXTRAIN_SLOW_TESTS"),
                          reason="~5 min (20 pipelined steps of the 52-layer program): set JAXTRAIN_SLOW_TESTS=1")
CONFIGS = [
    "deepseek_v2_lite_reference_layout",
    pytest.param("nemotron3_nano_reference_layout", marks=SLOW),
]


def load_config(name: str):
    """The Experiment configs/<name>.gin describes (gin's global state cleared before and after)."""
    gin.clear_config()
    try:
        with contextlib.chdir(REPO):  # includes are relative to the repository root
            parse_gin([os.path.join("configs", f"{name}.gin")], [])
            exp = load_experiment()
    finally:
        gin.clear_config()
    # The tests' Adam (eps 1e-5: see tests/pipeline_helpers.py); no eval before STEPS; step 10 kept
    # among the stops' checkpoints (3, 10, 13, 20).
    return dataclasses.replace(exp, optimizer=PIPELINE_OPT,
                               checkpoint=dataclasses.replace(exp.checkpoint, checkpoint_every=SAVE_AT, keep_checkpoints=8),
                               observe=dataclasses.replace(exp.observe, log_every=STEPS, eval_every=0))


def write_initial_checkpoint(exp, directory, seed: int) -> None:
    """Canonical parameters (host numpy, as in tests/pipeline_helpers.py) as a parameters-only
    checkpoint at step 0: a Trainer restores them and starts its optimizer state fresh."""
    params = jax.device_put(initial_params(exp.model, seed), jax.devices()[0])
    checkpointer = Checkpointer(str(directory), async_save=False)
    checkpointer.save(0, {"params": params})
    checkpointer.close()


def copy_checkpoint(source_workdir, step: int, workdir) -> None:
    shutil.copytree(os.path.join(source_workdir, "checkpoints", str(step)),
                    os.path.join(workdir, "checkpoints", str(step)))


def losses_of(history) -> tuple[list[int], np.ndarray]:
    return [h["step"] for h in history], np.array([h["loss"] for h in history])


def assert_losses_close(actual, expected, rtol=1e-5):
    # assert_allclose takes NaN == NaN: both sides must be finite first.
    assert np.isfinite(actual).all() and np.isfinite(expected).all(), (actual, expected)
    np.testing.assert_allclose(actual, expected, rtol=rtol)


def canonical_params(trainer) -> dict:
    """The parameters the trainer's last run ended with, as checkpoints hold them, on the host."""
    return jax.device_get(trainer.canonical({"params": trainer.final_state.params})["params"])


def assert_params_close(actual: dict, expected: dict, what: str) -> None:
    """Leafwise within PARAM_RTOL/ATOL, both sides finite first; prints the largest difference."""
    assert_finite(actual, what)
    assert_finite(expected, f"{what} (reference)")
    leaves = jax.tree_util.tree_leaves_with_path(actual)
    expected_leaves = jax.tree.leaves(expected)
    assert len(leaves) == len(expected_leaves) > 0, (len(leaves), len(expected_leaves))
    worst = max(float(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)).max())
                for (_, x), y in zip(leaves, expected_leaves))
    print(f"{what}: largest parameter difference {worst:.3g}")
    for (path, x), y in zip(leaves, expected_leaves):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=PARAM_RTOL, atol=PARAM_ATOL,
                                   err_msg=f"{what}{jax.tree_util.keystr(path)}")


@pytest.fixture(scope="module", params=CONFIGS)
def run(request, tmp_path_factory):
    """Per config: the reference-layout run (20 steps, checkpoint at 10) and its workdirs."""
    name = request.param
    exp = load_config(name)
    root = tmp_path_factory.mktemp(name)
    write_initial_checkpoint(exp, root / "initial", SEEDS[name])

    def workdir(label: str, step: int = 0, source=None):
        """A new workdir holding the initial checkpoint, or `source`'s checkpoint `step`."""
        path = root / label
        if source is None:
            shutil.copytree(root / "initial" / "0", path / "checkpoints" / "0")
        else:
            copy_checkpoint(source, step, path)
        return str(path)

    reference = workdir("reference_layout")
    trainer = Trainer(exp, reference)
    history, params = [], {}
    for stop in (*COMPARED, STEPS):  # each stop saves; the next run resumes from that checkpoint
        history += trainer.run(stop_after=stop)
        if stop in COMPARED:
            params[stop] = canonical_params(trainer)
    assert dict(trainer.mesh.shape) == dict(pipeline=2, data=2, context=2, expert=1, tensor=2)
    return dict(name=name, exp=exp, workdir=workdir, reference=reference, history=history, trainer=trainer,
                params=params)


def start_from(run, step: int, workdir) -> None:
    """`workdir`'s checkpoints replaced by the reference run's checkpoint `step` (parameters,
    moments and data position), so that the workdir's Trainer resumes from exactly its state."""
    shutil.rmtree(os.path.join(workdir, "checkpoints"))
    copy_checkpoint(run["reference"], step, workdir)


@pytest.fixture(scope="module")
def one_device(run):
    """The same experiment on one device (pipeline=1): 3 steps from step 0 (their losses); then one
    step from each of the reference run's states 0, 1 and 2 (its parameters after steps 1-3); then
    the reference run's step-10 checkpoint resumed for 3 steps (parameters after step 11)."""
    exp = dataclasses.replace(run["exp"], mesh=MeshConfig(pipeline=1, data=1, context=1, expert=1, tensor=1))
    workdir = run["workdir"]("one_device")
    trainer = Trainer(exp, workdir, devices=jax.devices()[:1])
    first = trainer.run(stop_after=1)  # step 1 starts from the reference run's state 0 too
    one_step = {1: canonical_params(trainer)}
    first += trainer.run(stop_after=RESUMED)
    for step in FIRST_STEPS[1:]:
        start_from(run, step - 1, workdir)
        trainer.run(stop_after=step)
        one_step[step] = canonical_params(trainer)
    start_from(run, SAVE_AT, workdir)
    resumed = trainer.run(stop_after=SAVE_AT + 1)
    resumed_params = canonical_params(trainer)
    resumed += trainer.run(stop_after=SAVE_AT + RESUMED)
    return first, one_step, resumed, resumed_params


def test_reference_layout_trains(run):
    steps, losses = losses_of(run["history"])
    assert steps == list(range(1, STEPS + 1))
    assert np.isfinite(losses).all(), losses
    assert losses[-5:].mean() < losses[:5].mean(), losses  # it learns
    assert "layers per chunk" in run["trainer"].pipeline_summary
    # routed experts: stages over pipeline, experts over data x context (EP 4), tensor as EDP 2
    experts = {jax.tree_util.keystr(path): sharding.spec for path, sharding
               in jax.tree_util.tree_leaves_with_path(run["trainer"].shardings.params)
               if "'experts'" in jax.tree_util.keystr(path)}
    assert experts and all(spec[0] == "pipeline" and ("data", "context") in spec and "tensor" in spec
                           for spec in experts.values()), experts
    ckpts = sorted(int(p) for p in os.listdir(os.path.join(run["reference"], "checkpoints")))
    assert SAVE_AT in ckpts and STEPS in ckpts, ckpts


def test_first_steps_match_one_device(run, one_device):
    first, one_step, _, _ = one_device
    steps, losses = losses_of(first)
    assert steps == [1, 2, 3]
    # Step 1 agrees to ~1e-7; Adam then turns last-bit differences of the two layouts' reductions
    # into visible ones (the Nemotron case, seed 0: 2.6e-6 at step 2, 3.7e-5 at step 3, 2026-12-03),
    # so step 1 is held to 1e-5 and the rest to the parameters' 1e-4, as the parameters below are.
    actual = losses_of(run["history"])[1][:3]
    assert_losses_close(actual[:1], losses[:1])
    assert_losses_close(actual, losses, rtol=1e-4)
    for step in FIRST_STEPS:
        assert_params_close(one_step[step], run["params"][step],
                            f"{run['name']} 1 device, step {step} from the reference layout's step {step - 1}")


def test_checkpoint_resumes_on_one_device(run, one_device):
    _, _, resumed, resumed_params = one_device
    steps, losses = losses_of(resumed)
    assert steps == list(range(SAVE_AT + 1, SAVE_AT + RESUMED + 1))
    assert_losses_close(losses, losses_of(run["history"])[1][SAVE_AT:SAVE_AT + RESUMED])
    assert_params_close(resumed_params, run["params"][SAVE_AT + 1],
                        f"{run['name']} resumed on 1 device, step {SAVE_AT + 1}")


def test_checkpoint_resumes_on_data16(run):
    exp = dataclasses.replace(run["exp"], mesh=MeshConfig(pipeline=1, data=16, context=1, expert=1, tensor=1))
    workdir = run["workdir"]("data16", SAVE_AT, run["reference"])
    trainer = Trainer(exp, workdir)
    history = trainer.run(stop_after=SAVE_AT + 1)
    params = canonical_params(trainer)
    history += trainer.run(stop_after=SAVE_AT + RESUMED)
    steps, losses = losses_of(history)
    assert steps == list(range(SAVE_AT + 1, SAVE_AT + RESUMED + 1))
    assert_losses_close(losses, losses_of(run["history"])[1][SAVE_AT:SAVE_AT + RESUMED])
    assert_params_close(params, run["params"][SAVE_AT + 1], f"{run['name']} resumed on data=16, step {SAVE_AT + 1}")
