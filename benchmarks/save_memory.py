"""A pipelined save's device memory, compile only: the canonical tree built for a checkpoint
against the training-time state, per device.

    python benchmarks/save_memory.py [--gin_file=configs/nemotron3_nano_pipeline.gin] [--repo DIR]

`--repo` measures another checkout's code (e.g. a `git worktree` of an older commit) with this
script. Prints one JSON line: `state_gib` (stage-layout params + optimizer state per device) and
`save_peak_gib`, the device bytes held while the canonical tree is formed:

  whole regroup (the code before streamed saves): the state + the jitted regroup's device
    outputs (the canonical tree) + its temp;
  streamed (jaxtrain/pipeline/streamed_save.py): the state + the largest per-layer, per-leaf
    program's outputs + temp (its outputs move to host memory and are dropped before the next).

Sets its own simulated device count: run it as a script.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gin_file", action="append", default=[])
    parser.add_argument("--gin_param", action="append", default=[])
    parser.add_argument("--repo", default=os.getcwd())
    args = parser.parse_args(argv)
    os.chdir(args.repo)
    sys.path.insert(0, args.repo)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=16").strip()
    import jax

    from jaxtrain.training.config import load_experiment, parse_gin
    from jaxtrain.training.parallel_plan import ParallelPlan
    from jaxtrain.training.train_setup import build_train_setup

    parse_gin(args.gin_file or ["configs/nemotron3_nano_pipeline.gin"], args.gin_param)
    exp = load_experiment()
    plan = getattr(exp, "plan", None) or ParallelPlan.from_experiment(exp)
    setup = build_train_setup(exp.model, plan, exp.train, exp.optimizer)
    staged = setup.state
    abstract = staged.abstract.checkpoint_items() if hasattr(staged.abstract, "checkpoint_items") else staged.abstract
    items = {k: abstract[k] for k in ("params", "opt_state")}
    per_device = lambda tree: sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                                  for x in jax.tree.leaves(tree))
    state = per_device(items)
    streamed = getattr(staged, "_streamed", None)
    if streamed is None:  # the whole-tree regroup on the device
        program = jax.jit(staged.layout.to_canonical, out_shardings={k: staged.disk_shardings[k] for k in items})
        mem = program.lower(items).compile().memory_analysis()
        extra, how = mem.output_size_in_bytes + mem.temp_size_in_bytes, "whole regroup"
    else:
        extra, how = 0, "streamed, one layer at a time"
        import numpy as np
        compiled = {}
        for kind, _, leaves, shardings in streamed.groups(items):
            for leaf, sharding in zip(leaves, shardings):  # as the save calls them: one leaf's layer
                key = (leaf.shape, leaf.dtype, leaf.sharding, sharding)
                if key not in compiled:
                    program = streamed.layer_program(kind, [leaf], [sharding])
                    mem = program.lower([leaf], *[np.int32(0)] * 4).compile().memory_analysis()
                    compiled[key] = mem.output_size_in_bytes + mem.temp_size_in_bytes
                extra = max(extra, compiled[key])
    print(json.dumps({"repo": args.repo, "how": how, "state_gib": state / 2**30,
                      "save_peak_gib": (state + extra) / 2**30, "ratio": (state + extra) / state}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
