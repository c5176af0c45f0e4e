"""Short training runs for pipeline tests: every layout starts from the same canonical parameters,
handed over as a checkpoint restore would (`from_disk`)."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from helpers import TINY_OPT, assert_finite, random_packed_batch
from jaxtrain.training.parallel_plan import ParallelPlan
from jaxtrain.training.state import abstract_model, map_with_path
from jaxtrain.training.train_setup import build_train_setup

# Adam's first steps move every weight by about lr whatever its gradient's size, so a weight
# whose gradient is ~0 (cancellation) turns last-ulp differences between reduction orders into
# lr-sized differences (seen between *unpipelined* layouts too). A larger eps makes such
# updates proportional to the gradient; a real error still moves weights by ~lr.
PIPELINE_OPT = dataclasses.replace(TINY_OPT, eps=1e-5)


def initial_params(model, seed: int = 0) -> dict:
    """Random canonical parameters of the model's shapes, made on the host with numpy (compiling
    the real initializers costs more than a whole test): norm scales and `D` 1, biases 0, the
    rest N(0, 0.02). Any parameters serve to compare layouts."""
    rng = np.random.default_rng(seed)

    def make(path, x):
        name = path[-1]
        if name in ("scale", "D"):
            return np.ones(x.shape, x.dtype)
        if "bias" in name:
            return np.zeros(x.shape, x.dtype)
        return (0.02 * rng.standard_normal(x.shape)).astype(x.dtype)

    return map_with_path(make, nnx.to_pure_dict(abstract_model(model)[1]))


def run_steps(mesh_cfg, model, train, params0, *, pipeline=None, rules="dp", devices=None, steps: int = 3,
              allow_nonfinite: bool = False):
    """`steps` train steps from `params0` on fresh random batches. Returns (losses, canonical
    params on host, last metrics on host, final in-memory state, the TrainSetup). The losses and
    parameters must be finite (two NaN runs compare equal) unless `allow_nonfinite`."""
    plan = ParallelPlan(mesh=mesh_cfg, rules=rules, microbatches=train.microbatches,
                        context_parallel=train.context_parallel).with_pipeline(pipeline)
    setup = build_train_setup(model, plan, train, PIPELINE_OPT, devices if devices is not None else jax.devices())
    layout, state = setup.state, setup.state_from_params(params0)
    losses = []
    for i in range(steps):
        host = random_packed_batch(100 + i, train.global_batch, train.seq_len, model.vocab_size)
        state, metrics = setup.train_step(state, setup.device_batch(host))
        losses.append(float(metrics["loss"]))
    params = jax.device_get(layout.to_disk({"params": state.params})["params"])
    if not allow_nonfinite:
        assert_finite((losses, params), "run_steps (losses, params)")
    return np.array(losses), params, jax.device_get(metrics), state, setup
