"""Several `python -m jaxtrain.cli.train` processes on localhost (jax.distributed, gloo CPU
collectives), as the multi-process tests start them.

    with reserved_port() as port:  # held until the coordinator has come and gone
        procs = start_train_processes(workdir, bindings, port)
        outputs = wait_for(procs)
"""
from __future__ import annotations

import os
import subprocess
import sys

from xla_flags import COMPILE_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(xla_flags: str = "", drop: tuple[str, ...] = (), **extra: str) -> dict:
    """The environment of a process a test starts: the suite's compile-speed flags but not its
    device count (the CLI sizes its simulated devices itself, unless `xla_flags` does), without
    the variables in `drop`, with `extra` set."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", *drop)}
    env["XLA_FLAGS"] = f"{COMPILE_FLAGS} {xla_flags}".strip()
    env.update(extra)
    return env


def start_train_processes(workdir, bindings, port: int, count: int = 2,
                          xla_flags: str = "") -> list[subprocess.Popen]:
    """`count` CLI processes joining the coordinator on `port`, each with the gin `bindings`; on CPU,
    with child_env's XLA_FLAGS plus `xla_flags` (e.g. each process's device count)."""
    env = child_env(xla_flags, JAX_PLATFORMS="cpu")
    return [subprocess.Popen(
        [sys.executable, "-m", "jaxtrain.cli.train", f"--workdir={workdir}", *[f"--gin_param={b}" for b in bindings],
         f"--coordinator_address=localhost:{port}", f"--num_processes={count}", f"--process_id={i}"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(count)]


def wait_for(procs: list[subprocess.Popen], timeout: float = 300) -> list[str]:
    """Each process's output (stdout and stderr) once it exits; one still running after `timeout`
    seconds is killed."""
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=timeout)[0])
        finally:
            p.kill()
    return outputs
