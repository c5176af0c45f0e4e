"""Process start-up shared by the CLIs: gin parsing, simulated CPU devices, multi-host init.

Runs before jax is imported: XLA reads the simulated-device flag only at backend start.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

DEFAULT_GIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "default.gin")
_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gin_file", action="append", default=[], help="gin config file (repeatable)")
    parser.add_argument("--gin_param", action="append", default=[], help="gin binding 'X.y=z' (repeatable)")
    parser.add_argument("--coordinator_address", default=None, help="host:port of process 0 (multi-process)")
    parser.add_argument("--num_processes", type=int, default=None)
    parser.add_argument("--process_id", type=int, default=None)


def fail(message: str, code: int = 2):
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def _launched_processes(args) -> int:
    if args.num_processes:
        return args.num_processes
    for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


def simulate_devices_if_needed(gin_files, gin_params, num_processes: int) -> None:
    """Reads only the MeshConfig bindings (no jax yet) and, if the mesh asks for more than one
    device, lets the CPU backend offer that many per process. GPU/TPU backends ignore it."""
    import gin
    from jaxtrain.mesh_configurable import GinMeshConfig

    for path in gin_files:
        if not os.path.exists(path):
            fail(f"gin file not found: {path}")
    try:
        gin.add_config_file_search_path(os.path.dirname(os.path.dirname(DEFAULT_GIN)))  # bundled includes
        gin.parse_config_files_and_bindings(gin_files, gin_params, skip_unknown=True, finalize_config=False)
        needed = GinMeshConfig().fixed_device_count()
    except Exception:  # the strict parse after jax starts reports config errors clearly
        needed = 1
    finally:
        gin.clear_config()
    flags = os.environ.get("XLA_FLAGS", "")
    if needed > 1 and _DEVICE_FLAG not in flags:
        per_process = max(needed // max(num_processes, 1), 1)
        os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={per_process}".strip()


def start(args) -> None:
    """Parse gin for real (strict) and join the other processes when there are several."""
    gin_files = args.gin_file or [DEFAULT_GIN]
    processes = _launched_processes(args)
    simulate_devices_if_needed(gin_files, args.gin_param, processes)
    import jax

    if processes > 1:
        if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS") == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        kwargs = {}
        if args.coordinator_address:
            kwargs = dict(coordinator_address=args.coordinator_address, num_processes=args.num_processes,
                          process_id=args.process_id)
        jax.distributed.initialize(**kwargs)

    from jaxtrain.config import parse_gin  # registers every configurable
    try:
        parse_gin(gin_files, args.gin_param)
    except (ValueError, KeyError, TypeError, SyntaxError) as e:
        fail("bad gin config: " + re.sub(r"\s+", " ", str(e)))
