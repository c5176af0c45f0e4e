"""Compile, and optionally time, one layout of an experiment's train step: the measurement the
bench CLI prints (jaxtrain/cli/bench.py) and the planner's check of its own predictions
(jaxtrain/planner/verify.py) share. A library function, so that the planner does not import a CLI."""
from __future__ import annotations

import statistics
import time


def random_batch(exp) -> dict:
    """One host batch of random tokens at the experiment's batch and length (one document per row)."""
    import numpy as np

    t = exp.train
    rng = np.random.default_rng(0)
    host = {"inputs": rng.integers(0, exp.model.vocab_size, (t.global_batch, t.seq_len), dtype=np.int32),
            "segment_ids": np.ones((t.global_batch, t.seq_len), np.int32),
            "positions": np.broadcast_to(np.arange(t.seq_len, dtype=np.int32), (t.global_batch, t.seq_len)),
            "loss_mask": np.ones((t.global_batch, t.seq_len), np.float32)}
    host["targets"] = np.roll(host["inputs"], -1, axis=1)
    return host


def bench_layout(exp, plan, *, steps: int, compile_only: bool, max_replicated: float | None = None,
                 devices=None) -> dict:
    """`max_replicated`: fail the layout (ValueError) when more than this fraction of a
    device's parameter bytes are replicated copies (MaxText's assert_params_sufficiently_sharded).
    `devices`: the devices of the mesh (default: all)."""
    import jax

    from jaxtrain.meshes.sharding_audit import audit_sharding, check_sufficiently_sharded

    from jaxtrain.observe.flops import model_flops_utilization, peak_flops
    from jaxtrain.observe.hlo_stats import (collective_stats, collectives_by_dtype, compile_with_partitioned_hlo,
                                            compiled_hlo_text, executed_collective_stats)
    from jaxtrain.training.train_setup import build_train_setup

    t = exp.train
    setup = build_train_setup(exp.model, plan, t, exp.optimizer, devices, loss=exp.loss)
    abstract, step = setup.state.abstract, setup.train_step
    abstract_batch = setup.abstract_batch(t.global_batch, t.seq_len)
    audit = audit_sharding(setup.state.abstract.params, name="params")
    if max_replicated is not None:
        check_sufficiently_sharded(audit, max_replicated)
    t0 = time.perf_counter()
    # The partitioned module keeps bf16 collectives bf16 (XLA:CPU widens them afterwards).
    compiled, partitioned = compile_with_partitioned_hlo(step.lower(abstract, abstract_batch))
    out = {"compile_s": time.perf_counter() - t0, "devices": setup.mesh.size,
           "params_replicated_gb": audit.replicated_bytes_per_device / 2**30,
           "sharding_audit": audit.summary()}
    out["params_gb"] = audit.bytes_per_device / 2**30  # the state's share of the arguments, per device
    out["opt_state_gb"] = audit_sharding(abstract.opt_state, name="opt_state").bytes_per_device / 2**30
    mem = compiled.memory_analysis()
    if mem is not None:
        for name in ("argument", "output", "temp", "generated_code"):
            out[f"{name}_gb"] = getattr(mem, f"{name}_size_in_bytes", 0) / 2**30
    hlo = compiled_hlo_text(compiled)  # constants written out: a stage's switch counts exactly
    out["collectives"] = collective_stats(hlo)  # each instruction once
    out["executed"] = executed_collective_stats(hlo)  # each run counted: loop bodies x trips
    out["partitioned"] = collectives_by_dtype(partitioned)  # each instruction once, the program's dtypes
    if hasattr(setup.gradients, "bubble"):
        out["bubble"] = setup.gradients.bubble
    if compile_only:
        return out
    state = setup.state.init(t.seed)
    batch = setup.device_batch(random_batch(exp))
    times = []
    for i in range(steps + 2):  # two warm-up steps
        t1 = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        if i >= 2:
            times.append(time.perf_counter() - t1)
    step_time = statistics.median(times)
    tps = t.global_batch * t.seq_len / step_time
    peak = peak_flops(jax.devices()[0].device_kind, exp.observe.peak_flops_per_device)
    out.update(step_time_s=step_time, tokens_per_sec=tps,
               mfu=model_flops_utilization(exp.model.flops_per_token(t.seq_len), tps, peak, setup.mesh.size))
    return out
