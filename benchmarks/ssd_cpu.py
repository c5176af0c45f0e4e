"""Forward+backward time of the chunked SSD scan (the XLA reference the models run on CPU)
against the token-by-token scan, side by side in one process, on one CPU device.

  python benchmarks/ssd_cpu.py [--lengths 512,2048,8192] [--heads 8 --head_dim 64 --state 64
                                --groups 1 --chunk 128] [--repeats 5]

Prints one row per length: median ms of each and the speed-up; also each one's compiled
temporary memory, to show both stay linear in length.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxtrain.pallas_kernels.ssd_scan import ssd_scan, ssd_scan_naive  # noqa: E402


def inputs(length: int, h: int, p: int, g: int, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    return (f32(rng.standard_normal((1, length, h, p))), f32(np.log1p(np.exp(rng.standard_normal((1, length, h)) - 2))),
            f32(-np.exp(rng.standard_normal(h))), f32(rng.standard_normal((1, length, g, n))),
            f32(rng.standard_normal((1, length, g, n))))


def forward_backward(scan):
    def loss(x, dt, a, b, c):
        y, final = scan(x, dt, a, b, c)
        return jnp.sum(y * y) + jnp.sum(final)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))


def time_ms(fn, args, repeats: int) -> tuple[float, float]:
    compiled = fn.lower(*args).compile()
    temp_mb = compiled.memory_analysis().temp_size_in_bytes / 2**20
    jax.block_until_ready(compiled(*args))  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times), temp_mb


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--state", type=int, default=64)
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    h, p, g, n = args.heads, args.head_dim, args.groups, args.state
    chunked = forward_backward(functools.partial(ssd_scan, chunk_size=args.chunk, impl="xla"))
    naive = forward_backward(ssd_scan_naive)
    print(f"# {jax.devices()[0].device_kind}, batch 1, heads {h} x head_dim {p}, state {n}, groups {g}, "
          f"chunk {args.chunk}; forward+backward, median of {args.repeats}")
    print("| length | chunked ms | naive ms | speed-up | chunked temp MiB | naive temp MiB |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for length in (int(v) for v in args.lengths.split(",")):
        x = inputs(length, h, p, g, n)
        (c_ms, c_mb), (n_ms, n_mb) = time_ms(chunked, x, args.repeats), time_ms(naive, x, args.repeats)
        print(f"| {length} | {c_ms:.1f} | {n_ms:.1f} | {n_ms / c_ms:.1f}x | {c_mb:.1f} | {n_mb:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
