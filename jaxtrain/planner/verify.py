"""Compile a planned layout (compile only: nothing is allocated) and read XLA's memory figures,
for `--verify` and the planner's accuracy tests."""
from __future__ import annotations

import dataclasses

from jaxtrain.planner.candidates import Candidate
from jaxtrain.planner.memory_model import CPU, GPU


def compiling_platform():
    """The memory model's Platform for the backend jax compiles for here."""
    import jax
    return CPU if jax.devices()[0].platform == "cpu" else GPU


def compiled_memory(experiment, candidate: Candidate) -> dict:
    """{"argument_gb", "temp_gb", "compile_s"} (GiB) of the candidate's train step, or {"error"}."""
    from jaxtrain.cli.bench import bench_layout

    exp = dataclasses.replace(experiment, model=dataclasses.replace(experiment.model, remat=candidate.remat))
    try:
        result = bench_layout(exp, candidate.plan, steps=0, compile_only=True)
    except Exception as e:  # a layout the planner ranked must compile: report, do not hide
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    return {k: result[k] for k in ("argument_gb", "temp_gb", "compile_s")}
