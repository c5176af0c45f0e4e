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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_train_processes(workdir, bindings, port: int, count: int = 2,
                          xla_flags: str | None = None) -> list[subprocess.Popen]:
    """`count` CLI processes joining the coordinator on `port`, each with the gin `bindings`; on CPU,
    with the suite's XLA_FLAGS dropped (the CLI sizes the simulated devices itself) unless
    `xla_flags` gives each process its own."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
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
