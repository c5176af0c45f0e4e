"""Recommended XLA flags for GPU backends, set by the CLIs before jax starts.

XLA reads XLA_FLAGS once, when the backend starts, and an unknown flag ABORTS the process; flag
names change between XLA releases. So the decision is made before jax starts, from the
environment alone: the platform (JAX_PLATFORMS, else a CUDA plugin installed and an NVIDIA
device present), and for each flag whether the installed jaxlib or its CUDA plugin names it
(the flag's name in their shared libraries' bytes; never by starting jax). On any other
platform nothing is added. `JAXTRAIN_XLA_GPU_FLAGS=0` turns the whole set off; a flag the
user already set in XLA_FLAGS wins over ours.

Only jax-free imports here: this module runs before jax initializes a backend.
"""
from __future__ import annotations

import glob
import importlib.util
import mmap
import os
import re
import sys

OPT_OUT = "JAXTRAIN_XLA_GPU_FLAGS"

# (flag, value, why). Overlap of communication with compute is what the step time of a sharded
# model on several GPUs hangs on; these are the switches for it, our own selection.
RECOMMENDED: tuple[tuple[str, str, str], ...] = (
    ("xla_gpu_enable_latency_hiding_scheduler", "true",
     "schedule collectives early and compute while they run (FSDP gathers, TP reductions)"),
    ("xla_gpu_enable_highest_priority_async_stream", "true",
     "run async collectives on a high-priority stream so compute does not starve them"),
    ("xla_gpu_all_reduce_combine_threshold_bytes", str(1 << 30),
     "combine small gradient all-reduces into few large ones (fewer launches, better bandwidth)"),
    ("xla_gpu_all_gather_combine_threshold_bytes", str(1 << 27),
     "combine a layer's FSDP weight gathers into one collective"),
    ("xla_gpu_reduce_scatter_combine_threshold_bytes", str(1 << 26),
     "combine a layer's FSDP gradient reduce-scatters into one collective"),
    ("xla_gpu_enable_pipelined_all_gather", "true",
     "gather the next layer's weights inside the layer scan while this layer computes"),
    ("xla_gpu_enable_pipelined_reduce_scatter", "true",
     "reduce-scatter a layer's gradients while the previous layer's backward runs"),
    ("xla_gpu_enable_pipelined_all_reduce", "true",
     "the same for data-parallel gradient all-reduces inside the layer scan"),
    ("xla_gpu_enable_while_loop_double_buffering", "true",
     "double-buffer scan carries so the pipelined collectives above can overlap"),
    ("xla_gpu_enable_command_buffer", "",
     "no CUDA graphs: they serialise the async collectives the scheduler overlapped"),
)

GPU_PLATFORMS = ("cuda", "gpu", "rocm")


def detect_platform(env=None) -> str:
    """'gpu' or 'cpu' (or what JAX_PLATFORMS names first), decided without starting jax."""
    env = os.environ if env is None else env
    named = [p.strip().lower() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if named:
        return "gpu" if named[0] in GPU_PLATFORMS else named[0]
    cuda_plugin = any(_installed(name) for name in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
    nvidia_device = bool(glob.glob("/dev/nvidia[0-9]*"))
    return "gpu" if cuda_plugin and nvidia_device else "cpu"


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _library_files() -> list[str]:
    """The shared libraries of jaxlib and of any installed CUDA plugin (not imported)."""
    files = []
    for name in ("jaxlib", "jax_cuda12_plugin", "jax_cuda12_pjrt", "jax_cuda13_plugin", "jax_cuda13_pjrt"):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        roots = list(spec.submodule_search_locations or []) if spec is not None else []
        for root in roots:
            files += glob.glob(os.path.join(root, "**", "*.so*"), recursive=True)
    return files


def known_flags(names, files=None) -> set[str]:
    """The flag names (without dashes) that appear in the given shared libraries' bytes as C
    strings of their own, NUL on both sides, as a registered flag's name is (one pass over each
    library for every such `xla_*` string). A removed flag's name can live on inside the options
    proto's descriptor, among its reserved field names, where no NUL surrounds it: that one
    does not count, since XLA aborts on it."""
    names = set(names)
    found = set()
    for path in (_library_files() if files is None else files):
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    continue
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                    words = {m.group().decode() for m in re.finditer(rb"(?<=\x00)xla_[a-z0-9_]+(?=\x00)", data)}
        except OSError:
            continue
        found |= names & words
        if found == names:
            break
    return found


def gpu_flags(platform: str, env=None, known=None) -> list[str]:
    """The `--flag=value` strings to add for `platform`: none off a GPU, none when opted out,
    only those `known` names (default: the installed jaxlib's), none the user already set."""
    env = os.environ if env is None else env
    if platform != "gpu" or env.get(OPT_OUT, "1").strip().lower() in ("0", "false", "no", "off"):
        return []
    known = known_flags([name for name, _, _ in RECOMMENDED]) if known is None else set(known)
    already = env.get("XLA_FLAGS", "")
    return [f"--{name}={value}" for name, value, _ in RECOMMENDED
            if name in known and f"--{name}=" not in already and f"--{name} " not in already + " "]


def apply_gpu_flags(env=None, platform: str | None = None, log=None) -> list[str]:
    """Adds the recommended flags to env["XLA_FLAGS"] (before jax starts) and prints the set."""
    env = os.environ if env is None else env
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))  # stdout may be a CLI's output
    platform = detect_platform(env) if platform is None else platform
    flags = gpu_flags(platform, env)
    if flags:
        env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", "").strip(), *flags]).strip()
        log(f"jaxtrain: XLA GPU flags ({OPT_OUT}=0 turns them off): {' '.join(flags)}")
    elif platform == "gpu" and env.get(OPT_OUT, "1").strip().lower() in ("0", "false", "no", "off"):
        log(f"jaxtrain: XLA GPU flags off ({OPT_OUT}=0)")
    return flags
