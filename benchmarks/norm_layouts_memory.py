"""Step temp of a train step by how its gradient/parameter norms are reduced, compiled only.

    python benchmarks/norm_layouts_memory.py --layout pipeline=2,data=2,context=2,expert=2,rules=zero1,microbatches=4,remat=none

Full-size planner draw 3's DeepSeek (MLA, 32 experts top-2, float32) at a smaller width
(--embed, mlp 4x, --vocab, --seq_len), one process, the variants compiled one after another:

    per_leaf   make_update without layouts: one all-reduce per leaf group
    params     leaf_sums' one psum with the gradients taken in the parameters' layouts
               (what steps did before step.gradient_layouts)
    moments    leaf_sums' one psum over the optimizer moments' layouts (the step's choice)

Prints one line per variant: XLA temp and arguments (GiB per device), all-reduce count.
Sets its own simulated device count: run it as a script.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layout", required=True)
    p.add_argument("--embed", type=int, default=512)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--variants", default="per_leaf,params,moments")
    args = p.parse_args(argv)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=16".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import jax
    import numpy as np

    import jaxtrain.training.step as step_module
    from jaxtrain.observe.hlo_stats import collective_stats
    from jaxtrain.training.config import TrainConfig
    from jaxtrain.training.optim import OptimizerConfig
    from jaxtrain.training.parallel_plan import ParallelPlan
    from jaxtrain.training.train_setup import build_train_setup
    from tests.test_planner_property import SEED, draw_model

    jax.config.update("jax_threefry_partitionable", True)
    model = draw_model(np.random.default_rng(SEED + 3))
    model = dataclasses.replace(model, embed=args.embed, mlp=4 * args.embed, vocab_size=args.vocab)
    plan = ParallelPlan.parse(args.layout)
    original = step_module.make_update
    for variant in args.variants.split(","):
        def make_update(*a, params_shardings=None, variant=variant, **kw):
            if variant == "per_leaf":
                return original(*a, **kw)
            grads = params_shardings if variant == "params" else None
            return original(*a, params_shardings=params_shardings, grads_shardings=grads, **kw)

        step_module.make_update = make_update
        try:
            setup = build_train_setup(model, plan, TrainConfig(global_batch=16, seq_len=args.seq_len), OptimizerConfig())
            t0 = time.perf_counter()
            compiled = setup.train_step.lower(setup.state.abstract, setup.abstract_batch(16, args.seq_len)).compile()
        finally:
            step_module.make_update = original
        mem = compiled.memory_analysis()
        reduces = collective_stats(compiled.as_text())["all-reduce"]["count"]
        print(f"{plan.label()} {variant}: temp {mem.temp_size_in_bytes / 2**30:.3f} GiB, arguments "
              f"{mem.argument_size_in_bytes / 2**30:.3f} GiB, {reduces} all-reduces, "
              f"compile {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
