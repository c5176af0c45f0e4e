"""Host memory (RSS) of a training run on the CPU backend, phase by phase.

    python benchmarks/host_memory.py --gin_file=W/config.gin --gin_file=sft.gin --workdir=W [--steps 2] [--save] [--trim]

Starts as `python -m jaxtrain.train` does (the same gin, the same simulated devices) and builds
its Trainer, then runs the run's phases one after another. For each it prints the process's RSS
at the phase's end, the peak RSS during it (sampled every 5 ms) and the bytes of live jax arrays:

  trainer    the Trainer built: mesh, abstract state, tokenizer, data iterators
  restore    the newest checkpoint in W (or the initialization) and a fresh optimizer state
  batch      the first batch, put on the devices
  trace      the train step traced and lowered
  compile    the train step compiled (its per-device arguments and temp are printed after)
  step N     one step, run to completion
  save       with --save: a checkpoint of the state into a temporary directory, waited for

W is read, never written (the Trainer's restore moves a corrupt newest step aside, as a run
would). On XLA:CPU every simulated device's memory is host memory: a step's peak is about the
process before it plus the step's temp times the devices, and the state (the arguments) is
counted once per device that holds a copy. `--trim` calls glibc's malloc_trim after each step
and reports the RSS again: glibc keeps freed temporaries in its arenas, so RSS between steps stays
near the step's peak without any array holding it. Prints one JSON line at the end.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _status_gib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20
    return float("nan")


class _PeakSampler:
    """The peak RSS since the last `take()`, sampled on a daemon thread."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s, self.peak = interval_s, 0.0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            self.peak = max(self.peak, _status_gib("VmRSS"))
            time.sleep(self.interval_s)

    def take(self) -> float:
        peak, self.peak = max(self.peak, _status_gib("VmRSS")), 0.0
        return peak


def _live_array_gib() -> float:
    """Bytes of every live jax array, each device's copy counted (what XLA:CPU holds in host memory)."""
    import jax
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize * len(a.sharding.addressable_devices)
               for a in jax.live_arrays()) / 2**30


def main(argv=None) -> int:
    from jaxtrain.cli.launch import add_common_flags, start

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_flags(parser)
    parser.add_argument("--workdir", required=True, help="the run's workdir (read only)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--save", action="store_true", help="also save a checkpoint (into a temporary directory)")
    parser.add_argument("--trim", action="store_true", help="malloc_trim after each step and report the RSS again")
    args = parser.parse_args(argv)
    sampler = _PeakSampler()
    start(args)  # gin and the simulated devices, as the train CLI (before jax starts)

    import jax

    from jaxtrain.checkpoints.checkpointer import Checkpointer
    from jaxtrain.training.config import load_experiment
    from jaxtrain.training.trainer import Trainer

    rows = []

    def mark(phase: str, **extra):
        row = {"phase": phase, "rss_gib": round(_status_gib("VmRSS"), 3), "peak_gib": round(sampler.take(), 3),
               "live_arrays_gib": round(_live_array_gib(), 3), **extra}
        rows.append(row)
        more = "".join(f"  {k} {v}" for k, v in extra.items())
        print(f"{phase:10s} RSS {row['rss_gib']:6.2f} GiB  peak {row['peak_gib']:6.2f}  live arrays "
              f"{row['live_arrays_gib']:6.2f}{more}", flush=True)

    mark("start")
    trainer = Trainer(load_experiment(), args.workdir)
    mark("trainer")
    checkpointer = Checkpointer(os.path.join(trainer.workdir, "checkpoints"))
    state, _ = trainer.restore_or_init(checkpointer)
    checkpointer.close()
    jax.block_until_ready(state)
    mark("restore")
    batch = trainer.setup.batch_from_process_rows(next(trainer.train_iter))
    mark("batch")
    lowered = trainer.setup.train_step.lower(state, batch)
    mark("trace")
    compiled = lowered.compile()
    memory = compiled.memory_analysis()
    per_device = {"argument_gib": round(memory.argument_size_in_bytes / 2**30, 3),
                  "alias_gib": round(memory.alias_size_in_bytes / 2**30, 3),
                  "temp_gib": round(memory.temp_size_in_bytes / 2**30, 3)}
    mark("compile", devices=trainer.mesh.size, per_device=per_device)
    for step in range(1, args.steps + 1):
        state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        mark(f"step {step}", loss=round(float(metrics["loss"]), 4))
        if args.trim:
            import ctypes
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            mark("trimmed")
        batch = trainer.setup.batch_from_process_rows(next(trainer.train_iter))
    if args.save:
        with tempfile.TemporaryDirectory(prefix="host_memory_") as directory:
            saver = Checkpointer(directory)
            saver.save(args.steps, trainer.canonical(state), trainer.train_iter)
            saver.wait()
            saver.close()
            mark("save")
    print(json.dumps({"peak_gib": round(_status_gib("VmHWM"), 3), "phases": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
