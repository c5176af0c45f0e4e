"""The training loader from a token store: throughput against what an H200 consumes, and start-up
cost flat in the store's size.

  python benchmarks/bench_loader.py [--gb 2.0] [--small_mb 20] [--dir /tmp/bench_loader] [--batches 300]

Writes two synthetic token stores under --dir (uint16 ids below 32768, document lengths drawn
log-normally around ~700 tokens; reused when present; never commit them): --gb GB and --small_mb
MB. Then, each in a fresh process (so peak RSS is that run's own):

  first batch   make_train_iterator over the store (16 x 4096, shuffled) up to its first batch:
                seconds and the process's peak RSS, for the big and the small store
  throughput    --batches batches of 16 x 4096 from the big store through the grain iterator
                (read from the store, packed, handed over): windows/s, and RSS before and after

and compares the throughput with what an H200 consumes at the planner's predicted step time for
configs/gpu_dense_4k.gin at 16 x 4096 (`python -m jaxtrain.plan`, best layout): issue 23's
target is >= 20x, with a start-up within 1.3x and +300 MB of the small store's.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SEQ_LEN, GLOBAL_BATCH = 4096, 16


def write_store(path: pathlib.Path, tokens: int, seed: int = 0) -> pathlib.Path:
    """A store of about `tokens` random ids in documents of log-normal lengths, written in chunks."""
    import numpy as np

    from jaxtrain.data.store.store_writer import StoreWriter

    if (path / "metadata.json").exists():
        return path
    rng = np.random.default_rng(seed)
    writer = StoreWriter(path, vocab_size=32768, has_loss_mask=False)
    written = 0
    while written < tokens:
        lengths = np.clip(rng.lognormal(6.2, 0.9, size=20_000).astype(np.int64), 2, 32_000)
        lengths = lengths[np.cumsum(lengths) <= max(tokens - written, int(lengths[0]))]
        ids = rng.integers(0, 32768, size=int(lengths.sum()), dtype=np.uint16)
        writer.add(ids, lengths)
        written += int(lengths.sum())
    # "bytes" as the identity keeps DataConfig's default tokenizer; the loader never decodes.
    writer.commit(tokenizer_id="bytes", vocab_size=32768, bos_id=1, eos_id=2, pad_id=0, data_format="text",
                  sources=())
    return path


def rss_mb() -> dict:
    """This process's resident memory now (MB): anonymous (the loader's own arrays) and file pages
    (what it has mapped of files: libraries, and a memory-mapped corpus's touched pages)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024
    return {"anon_mb": fields["RssAnon"], "file_mb": fields["RssFile"], "peak_rss_mb": fields["VmHWM"]}


def first_batch(store: str) -> dict:
    """In this process: seconds to the first batch and peak RSS (MB)."""
    from jaxtrain.data.packing import DataConfig, make_train_iterator

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    it = make_train_iterator(DataConfig(train_files=(store,), eval_files=(store,)), seq_len=SEQ_LEN,
                             global_batch=GLOBAL_BATCH, seed=0)
    batch = next(it)
    seconds = time.perf_counter() - start
    assert batch["inputs"].shape == (GLOBAL_BATCH, SEQ_LEN)
    return {"first_batch_s": seconds, "rss_before_mb": before, **rss_mb()}


def throughput(store: str, batches: int) -> dict:
    """windows/s over `batches` batches, and RSS before and after them (a loader whose RSS grows
    with the batches read would reach the corpus's size in a long run)."""
    from jaxtrain.data.packing import DataConfig, make_train_iterator

    it = make_train_iterator(DataConfig(train_files=(store,), eval_files=(store,)), seq_len=SEQ_LEN,
                             global_batch=GLOBAL_BATCH, seed=0)
    next(it)  # start-up measured separately
    before = rss_mb()
    start = time.perf_counter()
    real = 0.0
    for _ in range(batches):
        real += float(next(it)["loss_mask"].sum())
    seconds = time.perf_counter() - start
    assert real > 0.9 * batches * GLOBAL_BATCH * SEQ_LEN
    return {"windows_per_s": batches * GLOBAL_BATCH / seconds, "batches": batches, "seconds": seconds,
            "before": before, "after": rss_mb()}


def h200_windows_per_s() -> tuple[float, float]:
    """(step seconds, windows/s) of the planner's best layout of gpu_dense_4k.gin on one H200."""
    out = subprocess.run([sys.executable, "-m", "jaxtrain.plan", "--gin_file=configs/gpu_dense_4k.gin",
                          "--device", "H200", "--devices", "1", "--global_batch", str(GLOBAL_BATCH),
                          "--seq_len", str(SEQ_LEN), "--top", "1", "--json", "/dev/stdout"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    step = min(r["step_s"] for r in rows if r["fits"])
    return step, GLOBAL_BATCH / step


def in_fresh_process(function: str, *args) -> dict:
    code = (f"import json, sys; sys.path.insert(0, {str(REPO)!r}); from benchmarks.bench_loader import {function}; "
            f"print(json.dumps({function}(*{list(args)!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--small_mb", type=float, default=20.0)
    parser.add_argument("--dir", default="/tmp/bench_loader")
    parser.add_argument("--batches", type=int, default=300)
    args = parser.parse_args(argv)
    root = pathlib.Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    big = write_store(root / f"store_{args.gb:g}gb", int(args.gb * 2**30 / 2))
    small = write_store(root / f"store_{args.small_mb:g}mb", int(args.small_mb * 2**20 / 2), seed=1)

    rows = {"big": in_fresh_process("first_batch", str(big)), "small": in_fresh_process("first_batch", str(small))}
    fast = in_fresh_process("throughput", str(big), args.batches)
    step, consumed = h200_windows_per_s()
    size = {name: sum(f.stat().st_size for f in path.iterdir()) / 2**20
            for name, path in (("big", big), ("small", small))}
    print(f"{'store':>8} {'size MB':>9} {'first batch s':>14} {'peak RSS MB':>12} {'RssAnon MB':>11} {'RssFile MB':>11}")
    for name in ("big", "small"):
        row = rows[name]
        print(f"{name:>8} {size[name]:>9.0f} {row['first_batch_s']:>14.3f} {row['peak_rss_mb']:>12.0f} "
              f"{row['anon_mb']:>11.0f} {row['file_mb']:>11.0f}")
    ratio = rows["big"]["first_batch_s"] / rows["small"]["first_batch_s"]
    extra = rows["big"]["peak_rss_mb"] - rows["small"]["peak_rss_mb"]
    print(f"start-up big/small: {ratio:.2f}x time, {extra:+.0f} MB peak RSS (targets <= 1.3x, <= +300 MB)")
    print(f"loader: {fast['windows_per_s']:.0f} windows/s of {GLOBAL_BATCH} x {SEQ_LEN} "
          f"({fast['batches']} batches in {fast['seconds']:.2f} s, 0 worker processes, 1 prefetch thread)")
    b, a = fast["before"], fast["after"]
    print(f"RSS over those batches: RssAnon {b['anon_mb']:.0f} -> {a['anon_mb']:.0f} MB, RssFile "
          f"{b['file_mb']:.0f} -> {a['file_mb']:.0f} MB, peak {a['peak_rss_mb']:.0f} MB")
    print(f"H200 (planner, gpu_dense_4k.gin at {GLOBAL_BATCH} x {SEQ_LEN}): step {step:.3f} s = "
          f"{consumed:.1f} windows/s; "
          f"loader / H200 = {fast['windows_per_s'] / consumed:.0f}x (target >= 20x)")


if __name__ == "__main__":
    main()
