"""Process start-up shared by the CLIs: gin parsing, simulated CPU devices, multi-host init.

Runs before jax is imported: XLA reads the simulated-device flag only at backend start.
Several processes join through jax.distributed within ResilienceConfig.peer_timeout_s (read from
gin before jax starts), or every started one exits with exit_codes.PEER and one line.
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import sys
import threading

from jaxtrain.xla_gpu_flags import apply_gpu_flags

from jaxtrain import bundled

DEFAULT_GIN = str(bundled.CONFIGS / "default.gin")
_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gin_file", action="append", default=[], type=bundled.gin_file,
                        help="gin config file, or a bundled config's name (repeatable)")
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
    """Reads only the MeshConfig, Experiment.layout and DeviceGroups.rows bindings (no jax yet) and, if the
    mesh (times the device groups) asks for more than one device, lets the CPU backend offer that many
    per process. GPU/TPU backends ignore it."""
    import gin
    from jaxtrain.training.mesh_configurable import GinMeshConfig
    from jaxtrain.training.parallel_plan import ParallelPlan

    for path in gin_files:
        if not os.path.exists(path):
            fail(f"gin file not found: {path}")
    try:
        gin.add_config_file_search_path(str(bundled.ROOT))  # bundled includes
        gin.parse_config_files_and_bindings(gin_files, gin_params, skip_unknown=True, finalize_config=False)
        rows = gin_binding(gin_files, gin_params, "DeviceGroups", "rows", ())
        plan = ParallelPlan(mesh=GinMeshConfig(), groups=tuple(rows) if isinstance(rows, (tuple, list)) else ())
        layout = gin_binding(gin_files, gin_params, "Experiment", "layout", None)
        if isinstance(layout, str):  # the plan's spec string on top (mesh axes, groups=)
            plan = plan.with_spec(layout)
        needed = plan.device_count()  # the mesh is one device group's
    except Exception:  # the strict parse after jax starts reports config errors clearly
        needed = 1
    finally:
        gin.clear_config()
    simulate_cpu_devices(needed, num_processes)


def simulate_cpu_devices(needed: int, num_processes: int = 1) -> None:
    """Lets the CPU backend offer `needed / num_processes` devices per process (before jax
    starts; an explicit XLA_FLAGS setting wins). GPU/TPU backends ignore it."""
    flags = os.environ.get("XLA_FLAGS", "")
    if needed > 1 and _DEVICE_FLAG not in flags:
        per_process = max(needed // max(num_processes, 1), 1)
        os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={per_process}".strip()


def _gin_parser(text_or_file):
    import gin.config_parser as parser

    class Placeholders(parser.ParserDelegate):  # references and macros are not needed here
        def configurable_reference(self, scoped_name, evaluate):
            return None

        def macro(self, name):
            return None

    return parser.ConfigParser(text_or_file, Placeholders())


def _gin_statements(path: str, seen: set):
    """The statements of a gin file, its includes expanded in place (found as given, next to the
    including file, or under the repo root: gin's search path for the bundled configs)."""
    import gin.config_parser as parser

    real = os.path.realpath(path)
    if real in seen or not os.path.exists(path):
        return
    seen.add(real)
    with open(path) as f:
        for statement in _gin_parser(f):
            if isinstance(statement, parser.IncludeStatement):
                candidates = [statement.filename, os.path.join(os.path.dirname(path), statement.filename),
                              str(bundled.ROOT / statement.filename)]
                yield from _gin_statements(next((c for c in candidates if os.path.exists(c)), candidates[0]), seen)
            else:
                yield statement


def gin_binding(gin_files, gin_params, selector: str, arg: str, default):
    """The value bound to `selector.arg` (unscoped) in the gin files and parameters, read before
    jax starts and without the configurable registered; `default` when unbound or unreadable
    (the strict parse after jax starts reports real errors)."""
    import io

    import gin.config_parser as parser

    value = default
    try:
        statements = [s for path in gin_files for s in _gin_statements(path, set())]
        for param in gin_params:
            statements.extend(_gin_parser(io.StringIO(param)))
        for s in statements:
            if (isinstance(s, parser.BindingStatement) and not s.scope and s.arg_name == arg
                    and s.selector.split(".")[-1] == selector):
                value = s.value
    except Exception:
        return default
    return value


# ResilienceConfig.peer_timeout_s's default (jaxtrain/training/config.py imports jax-dependent modules, so the
# CLI reads the binding from gin before importing it; tests/faults check the two agree).
DEFAULT_PEER_TIMEOUT_S = 60.0


def peer_timeout_s(gin_files, gin_params) -> float:
    old = gin_binding(gin_files, gin_params, "TrainConfig", "peer_timeout_s", DEFAULT_PEER_TIMEOUT_S)  # (moved)
    value = gin_binding(gin_files, gin_params, "ResilienceConfig", "peer_timeout_s", old)
    try:
        value = float(value)
    except (TypeError, ValueError):
        return DEFAULT_PEER_TIMEOUT_S
    return value if value > 0 else DEFAULT_PEER_TIMEOUT_S


def _launched_process_id(args) -> int | None:
    if args.process_id is not None:
        return args.process_id
    for var in ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return None


def _coordinator_reachable(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "localhost", int(port)), timeout=2):
            return True
    except (OSError, ValueError):
        return False


def join_processes(args, processes: int, timeout_s: float) -> None:
    """jax.distributed.initialize, bounded: if the processes have not all joined the coordinator
    within `timeout_s`, exits with exit_codes.PEER and one line (jax's own timeout would abort
    with a C++ stack trace instead, so jax's is set later than ours). Also sets jax's heartbeat
    timeout above ours (jaxtrain/resilience/peers.py notices a dead peer first) and turns off
    jax's preemption notifier (jaxtrain/resilience/preemption.py handles SIGTERM)."""
    import jax

    from jaxtrain.resilience import exit_codes

    if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.config.update("jax_enable_preemption_service", False)
    except (AttributeError, KeyError):  # a jax without the option
        pass
    kwargs = {}
    if args.coordinator_address:
        kwargs = dict(coordinator_address=args.coordinator_address, num_processes=args.num_processes,
                      process_id=args.process_id)
    address = args.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or "the coordinator"
    process = _launched_process_id(args)
    who = f"process {process}" if process is not None else "this process"
    joined = threading.Event()

    def give_up():
        if joined.wait(timeout_s):
            return
        if process != 0 and address != "the coordinator" and not _coordinator_reachable(address):
            what = f"cannot reach the coordinator at {address} (is process 0 running there?)"
        else:
            what = f"not all {processes} processes joined the coordinator at {address}"
        print(f"error: {who}: {what} within {timeout_s:g} s (ResilienceConfig.peer_timeout_s)",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(exit_codes.PEER)

    threading.Thread(target=give_up, name="jaxtrain-join-timeout", daemon=True).start()
    timeouts = dict(heartbeat_timeout_seconds=int(max(100, 3 * timeout_s)),
                    shutdown_timeout_seconds=int(max(30, 2 * timeout_s)))
    try:
        jax.distributed.initialize(**kwargs, initialization_timeout=int(timeout_s) + 60, **timeouts)
    except TypeError as e:  # a jax without one of these arguments: keep jax's own
        if not any(name in str(e) for name in timeouts):
            raise
        jax.distributed.initialize(**kwargs, initialization_timeout=int(timeout_s) + 60)
    joined.set()


def start(args) -> None:
    """Parse gin for real (strict) and join the other processes when there are several."""
    gin_files = args.gin_file or [DEFAULT_GIN]
    processes = _launched_processes(args)
    apply_gpu_flags()  # before jax starts a backend: XLA reads XLA_FLAGS once (jaxtrain/xla_gpu_flags.py)
    simulate_devices_if_needed(gin_files, args.gin_param, processes)
    if processes > 1:
        join_processes(args, processes, peer_timeout_s(gin_files, args.gin_param))

    from jaxtrain.training.config import parse_gin  # registers every configurable
    try:
        parse_gin(gin_files, args.gin_param)
    except (ValueError, KeyError, TypeError, SyntaxError) as e:
        fail("bad gin config: " + re.sub(r"\s+", " ", str(e)))


def start_from_model_source(args) -> None:
    """Start-up of a CLI that reads a model from `args.workdir` (its config.gin under any
    --gin_file/--gin_param, `args.layout` on top of the run's plan) or `args.hf_dir` (on
    `args.layout`, or one device): devices sized, gin parsed, jax not yet imported before."""
    import json

    if getattr(args, "workdir", None) is not None:
        saved = os.path.join(args.workdir, "config.gin")
        if not args.gin_file:
            if not os.path.exists(saved):
                fail(f"{saved} not found: pass --gin_file describing the model")
            args.gin_file = [saved]
        if args.layout:  # the run's plan with this spec on top (also sizes the CPU devices)
            args.gin_param = [*args.gin_param, f"Experiment.layout={json.dumps(args.layout)}"]
        start(args)
        return
    if not os.path.isdir(args.hf_dir):
        fail(f"--hf_dir {args.hf_dir}: not a directory")
    if args.layout:
        from jaxtrain.training.parallel_plan import ParallelPlan
        try:
            simulate_cpu_devices(ParallelPlan.parse(args.layout).device_count())
        except ValueError as e:
            fail(str(e))
