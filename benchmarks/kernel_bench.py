"""Times each Pallas kernel against its XLA path and its roofline on a GPU.

Roofline time = max(bytes / measured copy bandwidth, FLOPs / measured bf16
matmul rate); "% roof" = roofline time / kernel time. Shapes are the real
models': DeepSeek-V2-Lite experts and MLA attention, Llama-style GQA attention and
Nemotron-3-Nano Mamba layers.
Every section is guarded: an error prints and the next section runs.

  python benchmarks/kernel_bench.py [--sections gmm,route,ssd,conv,flash] [--quick]
  python benchmarks/kernel_bench.py --smoke   # tiny shapes: checks the script
  python benchmarks/kernel_bench.py --json rows.jsonl   # also one JSON line per row, as it is measured

A row's "goal" (in the JSON) is its target in numbers: {"kind": "vs_dense" | "vs_xla" | "roof",
"min": x} means dense_ms / pallas_ms, xla_ms / pallas_ms or roof_ms / pallas_ms should be >= x.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxtrain.pallas_kernels.causal_conv1d import causal_conv1d  # noqa: E402
from jaxtrain.pallas_kernels.flash_attention import flash_attention  # noqa: E402
from jaxtrain.pallas_kernels.grouped_matmul import grouped_matmul  # noqa: E402
from jaxtrain.pallas_kernels.moe_routing import route  # noqa: E402
from jaxtrain.pallas_kernels.ssd_scan import ssd_scan  # noqa: E402

BF16 = jnp.bfloat16
ROWS = []  # (section, case, pallas_ms, xla_ms, roof_ms, target, note)
SMOKE = False  # --smoke: tiny shapes so the script itself can be checked on CPU
JSONL = None  # --json: path that every row is appended to as one JSON line


def size(real, tiny):
    return tiny if SMOKE else real


# ----------------------------------------------------------------------------
# Timing.


def time_ms(fn, *args, iters=20, min_ms=20.0):
    """Median ms per call of a jitted fn: warm up, then time batches of calls.

    Each sample runs enough back-to-back async calls to last >= min_ms, so
    dispatch overhead hides behind the GPU except for kernels of a few µs.
    """
    out = fn(*args)
    jax.block_until_ready(out)  # compile + first run
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = max((time.perf_counter() - t0) * 1e3, 1e-3)
    reps = max(1, min(1000, int(min_ms / once)))
    samples = []
    for _ in range(1 if SMOKE else max(3, iters // 4)):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) * 1e3 / reps)
    return statistics.median(samples)


class Roofline:
    """Measured copy bandwidth (bytes/s) and bf16 matmul rate (FLOP/s)."""

    def __init__(self):
        n = size(256 * 1024 * 1024, 1024)  # 1 GiB of f32: read + write
        x = jnp.ones((n,), jnp.float32)
        ms = time_ms(jax.jit(lambda a: a * 1.0001), x)
        self.bandwidth = 2 * 4 * n / (ms * 1e-3)
        del x
        m = size(8192, 64)
        a = jnp.ones((m, m), BF16)
        ms = time_ms(jax.jit(lambda p, q: p @ q), a, a)
        self.matmul = 2 * m**3 / (ms * 1e-3)
        print(f"copy bandwidth {self.bandwidth / 1e12:.2f} TB/s, " f"bf16 matmul {self.matmul / 1e12:.0f} TFLOP/s")
        write_json({"kind": "roofline", "bandwidth": self.bandwidth, "matmul_flops": self.matmul, "measured": True})

    def ms(self, nbytes, flops=0.0):
        return 1e3 * max(nbytes / self.bandwidth, flops / self.matmul)


def write_json(record):
    if JSONL:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(JSONL, "a") as f:
            f.write(json.dumps(clean) + "\n")


def add_row(section, case, pallas_ms, xla_ms, roof_ms, target="", note="", goal=None, dense_ms=None):
    """goal: (kind, min), see the module docstring; dense_ms: a dense matmul of the same FLOPs."""
    ROWS.append((section, case, pallas_ms, xla_ms, roof_ms, target, note))
    write_json({"kind": "kernel", "section": section, "case": case, "pallas_ms": pallas_ms, "xla_ms": xla_ms,
                "roof_ms": roof_ms, "dense_ms": dense_ms, "target": target, "note": note,
                "goal": {"kind": goal[0], "min": goal[1]} if goal else None})
    print(f"  {case}: pallas {pallas_ms:.3f} ms, xla {xla_ms:.3f} ms, " f"roofline {roof_ms:.3f} ms {note}", flush=True)


def print_table():
    head = f"{'section':8} {'case':44} {'pallas ms':>10} {'xla ms':>9} " f"{'speedup':>7} {'% roof':>7}  target / note"
    print("\n" + head + "\n" + "-" * len(head))
    for sec, case, p_ms, x_ms, r_ms, target, note in ROWS:
        speed = x_ms / p_ms if p_ms and x_ms == x_ms else float("nan")
        roof = 100 * r_ms / p_ms if p_ms else float("nan")
        print(f"{sec:8} {case:44} {p_ms:10.3f} {x_ms:9.3f} {speed:6.2f}x " f"{roof:6.1f}%  {target} {note}")


# ----------------------------------------------------------------------------
# Sections.


def bench_gmm(roof, quick):
    """DeepSeek-V2-Lite experts: 8192 tokens x top-6 over 64 experts."""
    tokens, top_k, g, hidden, inter = size((8192, 6, 64, 2048, 1408), (64, 2, 4, 64, 32))
    m = tokens * top_k
    rng = np.random.default_rng(0)
    balanced = jnp.full((g,), m // g, jnp.int32)
    skew = rng.dirichlet(np.full(g, 0.3)) * m
    skewed = np.floor(skew).astype(np.int32)
    skewed[0] += m - skewed.sum()
    skewed = jnp.asarray(skewed)
    for name, k, n in [("up", hidden, inter), ("down", inter, hidden)]:
        lhs = jnp.asarray(rng.standard_normal((m, k)), BF16)
        rhs = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), BF16)
        flops = 2 * m * k * n
        nbytes = 2 * (m * k + g * k * n + m * n)
        dense = jax.jit(lambda a, b: a @ b)
        dense_ms = time_ms(dense, lhs, rhs[0])
        dense_tflops = flops / dense_ms / 1e9
        print(f"  dense [{m},{k}]x[{k},{n}]: {dense_ms:.3f} ms " f"({dense_tflops:.0f} TFLOP/s)")
        configs = [(128, 128, 64, 4, 4)]
        if not quick:
            configs += [(128, 256, 64, 8, 3), (64, 128, 64, 4, 4), (128, 128, 32, 4, 5), (256, 128, 64, 8, 3)]
        best = None
        for bm, bn, bk, warps, stages in configs:
            try:
                fn = jax.jit(
                    lambda a, b, s, c=(bm, bn, bk, warps, stages): grouped_matmul(
                        a,
                        b,
                        s,
                        impl="pallas",
                        block_m=c[0],
                        block_n=c[1],
                        block_k=c[2],
                        num_warps=c[3],
                        num_stages=c[4],
                    )
                )
                ms = time_ms(fn, lhs, rhs, balanced)
                print(f"    blocks {bm}x{bn}x{bk} w{warps} s{stages}: {ms:.3f} ms " f"({flops / ms / 1e9:.0f} TFLOP/s)")
                if best is None or ms < best[0]:
                    best = (ms, (bm, bn, bk, warps, stages))
            except Exception as e:  # a config may not fit shared memory
                print(f"    blocks {bm}x{bn}x{bk} w{warps} s{stages}: " f"{type(e).__name__}: {str(e)[:200]}")
        xla = jax.jit(lambda a, b, s: grouped_matmul(a, b, s, impl="xla"))
        xla_ms = time_ms(xla, lhs, rhs, balanced)
        ms, cfg = best
        add_row(
            "gmm",
            f"{name} fwd balanced m={m} k={k} n={n}",
            ms,
            xla_ms,
            roof.ms(nbytes, flops),
            f">=70% dense: {100 * dense_ms / ms:.0f}%",
            f"best blocks {cfg}",
            goal=("vs_dense", 0.70),
            dense_ms=dense_ms,
        )
        bm, bn, bk, warps, stages = cfg
        tuned = jax.jit(
            lambda a, b, s: grouped_matmul(
                a, b, s, impl="pallas", block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages
            )
        )
        add_row(
            "gmm",
            f"{name} fwd skewed (dirichlet 0.3)",
            time_ms(tuned, lhs, rhs, skewed),
            time_ms(xla, lhs, rhs, skewed),
            roof.ms(nbytes, flops),
            dense_ms=dense_ms,
        )

        def grads(impl):
            loss = lambda a, b, s: jnp.sum(grouped_matmul(a, b, s, impl=impl).astype(jnp.float32))
            return jax.jit(jax.grad(loss, argnums=(0, 1)))

        p_ms = time_ms(grads("pallas"), lhs, rhs, balanced)
        add_row(
            "gmm",
            f"{name} fwd+bwd balanced",
            p_ms,
            time_ms(grads("xla"), lhs, rhs, balanced),
            roof.ms(3 * nbytes, 3 * flops),
            f"vs 3 dense: {300 * dense_ms / p_ms:.0f}%",
            dense_ms=3 * dense_ms,
        )


def bench_route(roof, quick):
    """Router + dispatch plan: V2-Lite (64 experts, top-6, softmax), V3-like."""
    cases = [
        ("v2lite softmax e=64 k=6", 64, dict(top_k=6, norm_topk_prob=False)),
        (
            "v3 sigmoid e=256 k=8 g8/4 bias",
            size(256, 32),
            dict(top_k=8, score_fn="sigmoid", n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5),
        ),
    ]
    token_counts = size([8192] if quick else [8192, 65536], [40])
    rng = np.random.default_rng(1)
    for name, e, opts in cases:
        bias = jnp.asarray(rng.standard_normal(e) * 0.01, jnp.float32) if "bias" in name else None
        for t in token_counts:
            logits = jnp.asarray(rng.standard_normal((t, e)), BF16)
            k = opts["top_k"]
            # logits in; ids + weights + sort_order + inverse_order out.
            nbytes = 2 * t * e + 4 * t * k * 4 + 4 * e
            fn = lambda impl: jax.jit(lambda lg: route(lg, correction_bias=bias, impl=impl, **opts))
            add_row(
                "route",
                f"{name} t={t}",
                time_ms(fn("pallas"), logits),
                time_ms(fn("xla"), logits),
                roof.ms(nbytes),
                ">=50% roof",
                "(µs-scale: launch-bound)" if t <= 8192 else "",
                goal=("roof", 0.50),
            )


SSD_DIMS = (64, 64, 8, 128)  # heads, head_dim, groups, state
SSD_TINY = (4, 16, 2, 16)


def _ssd_inputs(seq, rng):
    heads, head_dim, groups, state = size(SSD_DIMS, SSD_TINY)
    x = jnp.asarray(rng.standard_normal((1, seq, heads, head_dim)), BF16)
    dt = jnp.asarray(np.log1p(np.exp(rng.standard_normal((1, seq, heads)) - 2)), jnp.float32)
    a = -jnp.asarray(np.exp(rng.uniform(0, 2, heads)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((1, seq, groups, state)), BF16)
    c = jnp.asarray(rng.standard_normal((1, seq, groups, state)), BF16)
    d = jnp.ones((heads,), jnp.float32)
    return (x, dt, a, b, c), d


def bench_ssd(roof, quick):
    """Nemotron-3-Nano Mamba-2 layer: 64 heads x 64, state 128, 8 groups."""
    chunk = size(128, 16)
    rng = np.random.default_rng(2)
    for seq in size([4096] if quick else [4096, 8192, 16384], [40]):
        args, d = _ssd_inputs(seq, rng)
        h, p, g, n = size(SSD_DIMS, SSD_TINY)
        nbytes = 2 * (2 * seq * h * p + 2 * seq * g * n) + 4 * seq * h
        flops = -(-seq // chunk) * h * (2 * chunk * chunk * (n + p) + 4 * chunk * p * n)
        fwd = lambda impl: jax.jit(lambda *a: ssd_scan(*a, chunk_size=chunk, D=d, impl=impl))
        p_ms, x_ms = time_ms(fwd("pallas"), *args), time_ms(fwd("xla"), *args)
        add_row("ssd", f"fwd b=1 l={seq}", p_ms, x_ms, roof.ms(nbytes, flops), f">=2x xla: {x_ms / p_ms:.2f}x",
                goal=("vs_xla", 2.0))

        def grads(impl):
            def loss(*a):
                y, final = ssd_scan(*a, chunk_size=chunk, D=d, impl=impl)
                return jnp.sum(y.astype(jnp.float32)) + jnp.sum(final)

            return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))

        try:
            p_ms, x_ms = time_ms(grads("pallas"), *args), time_ms(grads("xla"), *args)
            add_row(
                "ssd",
                f"fwd+bwd b=1 l={seq}",
                p_ms,
                x_ms,
                roof.ms(3 * nbytes, 3 * flops),
                f">=2x xla: {x_ms / p_ms:.2f}x",
                goal=("vs_xla", 2.0),
            )
        except Exception as e:
            print(f"  ssd fwd+bwd l={seq}: {type(e).__name__}: {str(e)[:300]}")


def bench_conv(roof, quick):
    """Mamba conv over x|B|C: 4096 + 2*8*128 = 6144 channels, width 4."""
    d, k = size(6144, 48), 4
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((d, k)) * 0.5, BF16)
    bias = jnp.asarray(rng.standard_normal(d), BF16)
    for seq in size([4096] if quick else [4096, 16384], [40]):
        x = jnp.asarray(rng.standard_normal((1, seq, d)), BF16)
        nbytes = 2 * 2 * seq * d
        fn = lambda impl: jax.jit(lambda a: causal_conv1d(a, w, bias, impl=impl))
        add_row("conv", f"fwd silu b=1 l={seq} d={d}", time_ms(fn("pallas"), x), time_ms(fn("xla"), x), roof.ms(nbytes))

        def grads(impl):
            loss = lambda a, ww, bb: jnp.sum(causal_conv1d(a, ww, bb, impl=impl).astype(jnp.float32))
            return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

        add_row(
            "conv",
            f"fwd+bwd silu b=1 l={seq}",
            time_ms(grads("pallas"), x, w, bias),
            time_ms(grads("xla"), x, w, bias),
            roof.ms(3 * nbytes),
        )


def bench_flash(roof, quick):
    """Causal flash attention, one document: Llama-3-8B GQA (32/8 heads x 128) and
    DeepSeek-V2-Lite MLA (16 heads, d=192, dv=128)."""
    cases = [("gqa 32/8 d=128", size((32, 8, 128, 128), (4, 2, 24, 8))),
             ("mla 16/16 d=192 dv=128", size((16, 16, 192, 128), (2, 2, 24, 16)))]
    rng = np.random.default_rng(4)
    for name, (h, kv, d, dv) in cases:
        for seq in size([4096] if quick else [4096, 16384], [40]):
            q = jnp.asarray(rng.standard_normal((1, seq, h, d)), BF16)
            k = jnp.asarray(rng.standard_normal((1, seq, kv, d)), BF16)
            v = jnp.asarray(rng.standard_normal((1, seq, kv, dv)), BF16)
            seg = jnp.zeros((1, seq), jnp.int32)
            flops = h * seq * seq * (d + dv)  # two matmuls over the causal half
            nbytes = 2 * seq * (h * d + kv * (d + dv) + h * dv)
            fwd = lambda impl: jax.jit(lambda a, b, c: flash_attention(a, b, c, seg, seg, scale=d**-0.5, impl=impl))
            add_row("flash", f"{name} fwd l={seq}", time_ms(fwd("pallas"), q, k, v), time_ms(fwd("xla"), q, k, v),
                    roof.ms(nbytes, flops))

            def grads(impl):
                loss = lambda a, b, c: jnp.sum(
                    flash_attention(a, b, c, seg, seg, scale=d**-0.5, impl=impl).astype(jnp.float32))
                return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

            # backward: 5 matmuls over the causal half, plus the forward's 2
            add_row("flash", f"{name} fwd+bwd l={seq}", time_ms(grads("pallas"), q, k, v),
                    time_ms(grads("xla"), q, k, v), roof.ms(3 * nbytes, 3.5 * flops))


SECTIONS = {"gmm": bench_gmm, "route": bench_route, "ssd": bench_ssd, "conv": bench_conv, "flash": bench_flash}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--quick", action="store_true", help="one size per kernel, no block sweep")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: checks the script, not the kernels")
    parser.add_argument("--budget_s", type=float, default=280.0, help="skip sections that would start after this")
    parser.add_argument("--json", default=None, help="append every row to this file as one JSON line")
    args = parser.parse_args()
    global SMOKE, JSONL
    SMOKE, JSONL = args.smoke, args.json

    def on_timeout(*_):  # `timeout` sends SIGTERM: still print what we have
        print("\n== interrupted (SIGTERM)")
        print_table()
        sys.exit(124)

    signal.signal(signal.SIGTERM, on_timeout)
    start = time.time()
    print(f"jax {jax.__version__}, devices {jax.devices()}")
    if jax.default_backend() != "gpu" and not SMOKE:
        print("WARNING: no GPU backend; Pallas runs interpreted and timings are " "meaningless.")
    try:
        roof = Roofline()
    except Exception:
        traceback.print_exc()
        print("roofline probes failed; using H200 spec sheet numbers")
        roof = Roofline.__new__(Roofline)
        roof.bandwidth, roof.matmul = 4.8e12, 989e12
        write_json({"kind": "roofline", "bandwidth": roof.bandwidth, "matmul_flops": roof.matmul, "measured": False})
    failed = []
    write_json({"kind": "plan", "sections": args.sections.split(","), "smoke": SMOKE, "quick": args.quick})
    for name in args.sections.split(","):
        if time.time() - start > args.budget_s:
            print(f"== {name}: skipped (time budget)")
            write_json({"kind": "section", "section": name, "status": "skipped (time budget)"})
            continue
        print(f"== {name}", flush=True)
        try:
            SECTIONS[name](roof, args.quick)
            write_json({"kind": "section", "section": name, "status": "done"})
        except Exception as e:
            traceback.print_exc()
            print(f"== {name}: FAILED (continuing)", flush=True)
            failed.append(name)
            write_json({"kind": "section", "section": name, "status": f"failed: {type(e).__name__}: {str(e)[:300]}"})
    print_table()
    print(f"total {time.time() - start:.0f} s" + (f"; failed sections: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
