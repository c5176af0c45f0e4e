"""The update phase's memory on its own: the optimizer step + non-finite guard, compiled alone.

    python benchmarks/update_memory.py --gin_file=configs/llama3_8b.gin --layout data=4,tensor=4,rules=zero1

Compiles (never runs) `make_update` — AdamW, the non-finite guard, the step's metrics — on
abstract arrays with the train state donated, as the train step does, and prints XLA's temp
memory per device next to one Adam moment's size per device. The whole step's temp is the
larger of its backward and its update phase; this isolates the update. Gradients come in laid
out like the parameters (what the backward pass hands the update). Prints one JSON line.
Sets its own simulated device count: run it as a script.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys


def _shard_bytes(abstract_tree) -> int:
    import jax
    total = 0
    for leaf in jax.tree.leaves(abstract_tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gin_file", action="append", default=[])
    parser.add_argument("--gin_param", action="append", default=[])
    parser.add_argument("--layout", default="data=4,tensor=4,rules=zero1")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.getcwd())
    axes = [part.split("=") for part in args.layout.split(",") if "=" in part]
    devices = math.prod(int(v) for k, v in axes if k in ("data", "tensor", "pipeline", "context", "expert"))
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={devices}").strip()
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxtrain.cli.bench import apply_layout
    from jaxtrain.training.config import load_experiment, parse_gin
    from jaxtrain.training.step import make_update
    from jaxtrain.training.train_setup import build_train_setup
    from jaxtrain.meshes.rules import use_rules

    parse_gin(args.gin_file, args.gin_param)
    exp, plan = apply_layout(load_experiment(), args.layout)
    setup = build_train_setup(exp.model, plan, exp.train, exp.optimizer)
    state_abs, shardings = setup.state.abstract, setup.state.shardings
    item = lambda tree, k: tree[k] if isinstance(tree, dict) else getattr(tree, k)  # a dict or a TrainState
    update = make_update(setup.state.graphdef, setup.tx, setup.lr_schedule, rules=setup.rules,
                         opt_state_shardings=item(shardings, "opt_state"))
    grads_abs = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jax.numpy.float32, sharding=p.sharding),
                             item(state_abs, "params"))
    scalar = jax.ShapeDtypeStruct((), jax.numpy.float32, sharding=NamedSharding(setup.mesh, PartitionSpec()))

    def run(state, grads, nll, tokens):
        with use_rules(setup.mesh, setup.rules):
            return update(state, grads, (nll, nll, nll), {}, tokens, {})

    replicated = NamedSharding(setup.mesh, PartitionSpec())
    jitted = jax.jit(run, out_shardings=(shardings, replicated), donate_argnums=(0,))
    compiled = jitted.lower(state_abs, grads_abs, scalar, scalar).compile()
    mem = compiled.memory_analysis()
    mu = [s for s in jax.tree.leaves(item(state_abs, "opt_state"), is_leaf=lambda x: hasattr(x, "mu"))
          if hasattr(s, "mu")]
    moment = sum(_shard_bytes(s.mu) for s in mu)  # one Adam moment per device
    out = {"layout": args.layout, "gin": args.gin_file, "moment_gib": moment / 2**30,
           "params_gib": _shard_bytes(item(state_abs, "params")) / 2**30,
           "opt_state_gib": _shard_bytes(item(state_abs, "opt_state")) / 2**30,
           "update_temp_gib": mem.temp_size_in_bytes / 2**30,
           "update_temp_moments": mem.temp_size_in_bytes / moment}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
