"""Compile a planned layout (compile only: nothing is allocated) and read XLA's memory figures,
for `--verify` and the planner's accuracy tests; re-rank the planner's top layouts by what
compiling them showed.

A layout whose compiled peak exceeds the memory the planner claimed for it (on the platform
that compiled it) is not ranked first: `rerank_verified` moves it below every layout not shown
to break its claim, marked with the compiled figure, and the next verified one leads.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile

from jaxtrain.planner.memory_model import CPU, GPU

GIB = 2 ** 30
# XLA's SPMD partitioner, when it cannot reshard a value and replicates it instead: the
# compiled program then holds memory no layout model predicts (a sharding bug to fix, not a
# term to model).
INVOLUNTARY_REMAT = "Involuntary full rematerialization"


def compiling_platform():
    """The memory model's Platform for the backend jax compiles for here."""
    import jax
    return CPU if jax.devices()[0].platform == "cpu" else GPU


@contextlib.contextmanager
def _captured_stderr():
    """Everything written to file descriptor 2 (XLA's C++ warnings as well as Python's) while
    inside, as a list holding one string once the block ends; it is written on to stderr too."""
    out: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode(errors="replace")
            out.append(text)
            if text:
                sys.stderr.write(text)
                sys.stderr.flush()


def compiled_memory(experiment, candidate) -> dict:
    """{"argument_gb", "temp_gb", "compile_s", "involuntary_remat"} (GiB; whether XLA warned
    that it replicated a value it could not reshard) of the candidate's train step, or
    {"error"}. `candidate`: a ParallelPlan (its remat and attention overrides applied to the model)."""
    from jaxtrain.planner.layout_bench import bench_layout

    with _captured_stderr() as log:
        try:
            exp = dataclasses.replace(experiment, model=candidate.apply_to_model(experiment.model))
            result = bench_layout(exp, candidate, steps=0, compile_only=True)
        except Exception as e:  # a layout the planner ranked must compile: report, do not hide
            result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    if "error" in result:
        return result
    out = {k: result[k] for k in ("argument_gb", "temp_gb", "compile_s")}
    out["involuntary_remat"] = INVOLUNTARY_REMAT in log[0]
    return out


@dataclasses.dataclass(frozen=True)
class Verified:
    """One compiled layout: the planner's prediction for the compiling platform, XLA's figures
    (GiB, or {"error"}) and the claim the prediction makes (GiB)."""
    evaluation: object  # planner.Evaluation
    predicted: object  # memory_model.MemoryEstimate on the compiling platform
    compiled: dict
    claim_gb: float

    @property
    def peak_gb(self) -> float:
        return self.compiled["argument_gb"] + self.compiled["temp_gb"] if "error" not in self.compiled else float("inf")

    @property
    def holds_claim(self) -> bool:
        return "error" not in self.compiled and self.peak_gb <= self.claim_gb

    def verdict(self) -> str:
        if "error" in self.compiled:
            return f"compile failed: {self.compiled['error']}"
        if not self.holds_claim:
            return f"does not hold its claim: compiled {self.peak_gb:.2f} GiB > claim {self.claim_gb:.2f} GiB"
        return "holds its claim"


def verify_top(ranked: list, planner, k: int, compile_fn, platform=None) -> list[Verified]:
    """The top `k` of `ranked` compiled by `compile_fn(candidate)` (compiled_memory's dict),
    each with the planner's prediction and claim for `platform` (the compiling one)."""
    platform = platform or compiling_platform()
    out = []
    for e in ranked[:k]:
        predicted = planner.memory(e.candidate, planner.state(e.candidate), platform)
        out.append(Verified(e, predicted, compile_fn(e.candidate), predicted.peak * (1 + planner.margin) / GIB))
    return out


def rerank_verified(ranked: list, verified: list[Verified]) -> list:
    """`ranked` with each verified layout that does not hold its claim (or did not compile)
    moved to the end, in their order: those that held, then those not compiled, keep theirs."""
    broken = {id(v.evaluation) for v in verified if not v.holds_claim}
    return [e for e in ranked if id(e) not in broken] + [e for e in ranked if id(e) in broken]
