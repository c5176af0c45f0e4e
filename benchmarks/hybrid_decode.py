"""One decode step of a hybrid (PatternStack) model, each way of threading its caches and of
reading attention's cache, side by side in one process (steps alternate between the variants,
same threads):

  scan_switch   the pattern's scan + switch threading every kind's cache (PatternStack's
                prefill path): each layer slices one layer of every kind's cache and writes it back
  unrolled      the pattern unrolled, each layer writing its own kind's stacked cache in place
  x whole       attention reads the whole max_len cache each step (one block of max_len entries)
  x blocks      attention reads only the blocks holding filled entries (decode_block entries each)

    .venv/bin/python benchmarks/hybrid_decode.py --max_len 65536 --filled 1024

Defaults: 16 layers (2 attention, 8 Mamba-2, 6 MLP), batch 4, a 1024-entry prompt in a 65536
cache. Prints one JSON line per variant: the median step time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max_len", type=int, default=65536)
    p.add_argument("--filled", type=int, default=1024, help="cache entries filled before the timed steps")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxtrain.models.layers.attention_impl import BlockwiseAttention
    from jaxtrain.models.layers.pattern_stack import PatternStack
    from jaxtrain.models.layers.mamba2 import SSMConfig
    from jaxtrain.models.nemotron_h import NemotronHConfig

    pattern = ("mamba", "mlp") * 3 + ("mamba", "attention", "mlp") + ("mamba", "mlp") * 2 + ("mamba", "attention", "mamba")
    base = NemotronHConfig(vocab_size=1024, embed=256, pattern=pattern, heads=8, kv_heads=2, head_dim=64, mlp=512,
                           ssm=SSMConfig(heads=8, head_dim=64, state=64, groups=2, chunk_size=64))

    def step_fn(cfg, unrolled: bool):
        model = cfg.build(nnx.Rngs(0))
        graphdef, state = nnx.split(model)

        def step(state, cache, tokens, index, valid_from):
            m = nnx.merge(graphdef, state)
            positions = (index - valid_from)[:, None]
            if unrolled:
                return m.decode(tokens[:, None], positions, cache, index, valid_from)
            x = m.embed_inputs(tokens[:, None])
            cache = dict(cache)
            for name in m.stack_order:
                stack = m.stacks[name]
                assert isinstance(stack, PatternStack)
                x, cache[name] = stack._with_cache(
                    x, cache[name], lambda layer, h, c: layer.decode(h, positions, c, index, valid_from))
            return m._last_logits(x), cache

        return model, state, jax.jit(step, donate_argnums=(1,))

    variants = {}
    for unrolled in (False, True):
        for blocks in (False, True):
            cfg = base.with_runtime(attention=BlockwiseAttention(decode_block=256 if blocks else args.max_len))
            name = f"{'unrolled' if unrolled else 'scan_switch'} x {'blocks' if blocks else 'whole'}"
            variants[name] = step_fn(cfg, unrolled)

    tokens = jnp.zeros(args.batch, jnp.int32)
    valid_from = jnp.zeros(args.batch, jnp.int32)
    # one cache (the same structure for every variant) handed from step to step: each step donates it
    cache = variants["unrolled x blocks"][0].init_cache(args.batch, args.max_len, jnp.float32)
    times = {name: [] for name in variants}
    for name, (model, state, step) in variants.items():
        t0 = time.perf_counter()
        logits, cache = step(state, cache, tokens, jnp.int32(args.filled), valid_from)
        jax.block_until_ready(logits)
        print(json.dumps({"variant": name, "compile_and_first_step_s": round(time.perf_counter() - t0, 2)}),
              flush=True)
    for r in range(args.rounds):
        for name, (model, state, step) in variants.items():
            t0 = time.perf_counter()
            logits, cache = step(state, cache, tokens, jnp.int32(args.filled + r), valid_from)
            jax.block_until_ready(logits)
            times[name].append(time.perf_counter() - t0)
    for name, ts in times.items():
        print(json.dumps({"variant": name, "step_s": round(statistics.median(ts), 4), "steps": len(ts),
                          "layers": len(pattern), "attention_layers": pattern.count("attention"),
                          "batch": args.batch, "max_len": args.max_len, "filled": args.filled,
                          "jax": jax.__version__}), flush=True)


if __name__ == "__main__":
    main()
