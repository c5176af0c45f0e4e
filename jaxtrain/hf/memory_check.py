"""Measures the peak host memory of converting a large model both ways.

    python -m jaxtrain.hf.memory_check --dir=/tmp/convert_check [--layers=20]

Writes a random-weight Llama HF directory of about 300M float32 parameters (1.2 GB) one
tensor at a time, converts it to a jaxtrain checkpoint and back with `python -m
jaxtrain.cli.convert` in fresh processes, prints each one's peak RSS against the model size,
and checks that the round trip returns every tensor byte for byte.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import zlib

import numpy as np

from jaxtrain.models.llama import LlamaConfig


class RandomRows:
    """Random stack rows of any parameter of `plan`, made on demand; only the last one is kept."""

    def __init__(self, plan, seed: int = 0):
        self.plan, self.seed, self.last = plan, seed, (None, None)

    def region(self, path: str, index: tuple[int, ...], slices: tuple[slice, ...]) -> np.ndarray:
        if self.last[0] != (path, index):
            rng = np.random.default_rng([self.seed, zlib.crc32(path.encode()), *index])
            self.last = (path, index), 0.02 * rng.standard_normal(self.plan.leaves[path].layer_shape, np.float32)
        return self.last[1][slices]


def write_random_hf_dir(config, directory: str, seed: int = 0, max_shard_bytes: int = 500 * 10 ** 6) -> int:
    """An HF directory of random weights for `config`, written a block at a time; returns its bytes."""
    from jaxtrain.hf.exporter import ExportPlan, write_hf_dir
    from jaxtrain.hf.registry import family_for_config

    plan = ExportPlan(family_for_config(config), config)
    write_hf_dir(plan, RandomRows(plan, seed), directory, max_shard_bytes=max_shard_bytes)
    return sum(t.nbytes for t in plan.planned.values())


def run_convert(args: list[str]) -> float:
    out = subprocess.run([sys.executable, "-m", "jaxtrain.cli.convert", *args], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"convert {args} failed:\n{out.stderr}")
    return float(re.search(r"max RSS\): (\d+) MiB", out.stdout).group(1))


def same_tensors(a: str, b: str) -> bool:
    from jaxtrain.hf.safetensors_io import SafetensorsDir

    left, right = SafetensorsDir(a), SafetensorsDir(b)
    if set(left.tensors) != set(right.tensors):
        return False
    return all(left.read(n).tobytes() == right.read(n).tobytes() for n in left.tensors)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="scratch directory (emptied first)")
    parser.add_argument("--layers", type=int, default=20)
    args = parser.parse_args(argv)
    config = LlamaConfig(vocab_size=32000, embed=1024, layers=args.layers, heads=16, kv_heads=8, mlp=2816)
    shutil.rmtree(args.dir, ignore_errors=True)
    hf_in, workdir, hf_out = (os.path.join(args.dir, d) for d in ("hf_in", "workdir", "hf_out"))
    tiny_in, tiny_work = os.path.join(args.dir, "tiny_in"), os.path.join(args.dir, "tiny_work")
    write_random_hf_dir(LlamaConfig(vocab_size=64, embed=32, layers=1, heads=2, kv_heads=2, mlp=64), tiny_in)
    baseline = run_convert([f"--hf_dir={tiny_in}", f"--workdir={tiny_work}"])
    print(f"fixed cost (a tiny model's conversion): {baseline:.0f} MiB")
    size = write_random_hf_dir(config, hf_in)
    mib = size / 2 ** 20
    print(f"model: {config.param_count() / 1e6:.0f}M parameters, {mib:.0f} MiB of float32 safetensors")
    rss_in = run_convert([f"--hf_dir={hf_in}", f"--workdir={workdir}"])
    print(f"HF -> checkpoint: peak RSS {rss_in:.0f} MiB ({rss_in / mib:.0%} of the model)")
    rss_out = run_convert([f"--workdir={workdir}", f"--hf_out={hf_out}", "--max_shard_gb=0.5"])
    print(f"checkpoint -> HF: peak RSS {rss_out:.0f} MiB ({rss_out / mib:.0%} of the model)")
    identical = same_tensors(hf_in, hf_out)
    print(f"round trip byte-identical: {identical}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
