"""A TCP port for a child process's server (jax's coordinator), reserved without a race.

Binding port 0, reading the number and closing the socket leaves a window in which any other
process (another test, another engineer's run, an outgoing connection's ephemeral port) can
take the port before the child binds it; jax's coordinator then fails to bind and the process
crashes (SIGSEGV after "Failed to add port to server", jax 0.10). Instead `reserved_port` keeps
the socket bound, not listening, with SO_REUSEPORT for the whole block: gRPC binds its servers
with SO_REUSEPORT, so the coordinator (same user) can bind the same port, while everything
else (a bind without SO_REUSEPORT, the kernel choosing a free or ephemeral port) is refused it.
Only listening sockets receive connections, so all of them reach the coordinator.
Checked on Linux: a coordinator on `[::]:port` binds next to a held `[::]` or `127.0.0.1`
socket with SO_REUSEPORT, and crashes next to one without it.

    with reserved_port() as port:
        procs = [subprocess.Popen([..., f"--coordinator_address=localhost:{port}", ...])]
        ...  # wait for them inside the block
"""
from __future__ import annotations

import contextlib
import socket
from typing import Iterator


def _bound_socket() -> socket.socket:
    """A socket bound to a free port on every address (IPv6 dual-stack, else IPv4 loopback)."""
    attempts = []
    if socket.has_ipv6:
        attempts.append((socket.AF_INET6, ("::", 0)))
    attempts.append((socket.AF_INET, ("127.0.0.1", 0)))
    for family, address in attempts:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # also block IPv4
            sock.bind(address)
            return sock
        except OSError:
            sock.close()
            if family == attempts[-1][0]:
                raise
    raise AssertionError("unreachable")


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """Yields a port no other process can take until the block ends; start the processes that
    serve on it (gRPC, with SO_REUSEPORT) and wait for them inside the block. The socket is not
    inherited by child processes (Python sockets are non-inheritable)."""
    sock = _bound_socket()
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()
