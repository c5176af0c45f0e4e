"""The GPU check's environment stage: the GPU (nvidia-smi), versions, devices, peak FLOP/s for
MFU, the imports every later stage needs, and the wheels in .whl/ for the GPU image, printed and
written as one JSON object.

  python benchmarks/gpu_env.py --out env.json [--expect gpu|cpu]

Exit 1 when an import fails or the backend is not the one expected.
"""
from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import platform
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# What the stages import beyond jax (grain and gin-config come from .whl/ on the GPU image).
NEEDED = ("jaxlib", "flax", "optax", "orbax.checkpoint", "gin", "grain", "numpy", "pytest")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--expect", choices=("gpu", "cpu"), default="gpu")
    args = parser.parse_args()
    env = {"python": platform.python_version(), "modules": {}, "problems": [], "notes": []}
    env["gpu_wheels"] = sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO, ".whl", "*.whl")))
    if not env["gpu_wheels"]:
        env["notes"].append(".whl/ is empty: the GPU image lacks grain and gin-config, so before a GPU run "
                            "do `bash benchmarks/fetch_gpu_wheels.sh` where the package registry is reachable")
    if shutil.which("nvidia-smi"):
        try:
            query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
            env["nvidia_smi"] = subprocess.run(query, capture_output=True, text=True, timeout=15).stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            env["nvidia_smi"] = f"failed: {e}"
    else:
        env["nvidia_smi"] = None
    for name in NEEDED:
        try:
            module = importlib.import_module(name)
            env["modules"][name] = getattr(module, "__version__", "ok")
        except Exception as e:  # noqa: BLE001 - any import failure is the finding
            env["modules"][name] = None
            env["problems"].append(f"cannot import {name}: {type(e).__name__}: {e}"
                                   + (" (run benchmarks/fetch_gpu_wheels.sh where the registry is reachable)"
                                      if name in ("gin", "grain") else ""))
    import jax

    from jaxtrain.observe.flops import peak_flops

    devices = jax.devices()
    kind = devices[0].device_kind
    env.update(jax=jax.__version__, backend=jax.default_backend(), device_kind=kind, devices=len(devices),
               peak_bf16_flops=peak_flops(kind))
    try:
        env["memory_bytes"] = (devices[0].memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 - CPU devices may have no memory stats
        env["memory_bytes"] = None
    if env["backend"] != args.expect:
        env["problems"].append(f"backend is {env['backend']!r}, expected {args.expect!r}")
    if args.expect == "gpu" and env["peak_bf16_flops"] is None:
        env["problems"].append(f"no peak FLOP/s for {kind!r} in jaxtrain/observe/flops.py: MFU will be n/a")
    with open(args.out, "w") as f:
        json.dump(env, f, indent=1)
    peak = f"{env['peak_bf16_flops'] / 1e12:.0f} TFLOP/s" if env["peak_bf16_flops"] else "unknown"
    memory = f"{env['memory_bytes'] / 2**30:.1f} GiB" if env["memory_bytes"] else "n/a"
    print(f"nvidia-smi: {env['nvidia_smi']}\npython {env['python']}, jax {env['jax']}, backend {env['backend']}: "
          f"{kind} x {len(devices)}, memory {memory}, peak bf16 {peak}")
    print("modules: " + ", ".join(f"{k} {v}" if v else f"{k} MISSING" for k, v in env["modules"].items()))
    print(f"wheels in .whl/: {' '.join(env['gpu_wheels']) or 'none'}")
    for note in env["notes"]:
        print("note:", note)
    for problem in env["problems"]:
        print("problem:", problem)
    return 1 if env["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
