"""tests/ports.py: a reserved port refuses every other bind but one with SO_REUSEPORT (gRPC's)."""
import socket

import pytest

from ports import reserved_port

pytestmark = [pytest.mark.fast]


@pytest.mark.parametrize("family, address", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "0.0.0.0"),
                                             (socket.AF_INET6, "::1"), (socket.AF_INET6, "::")])
def test_reserved_port_refuses_plain_binds_until_released(family, address):
    if family == socket.AF_INET6 and not socket.has_ipv6:
        pytest.skip("no IPv6")
    with reserved_port() as port, socket.socket(family) as other:
        with pytest.raises(OSError):
            other.bind((address, port))
    with socket.socket(family) as later:
        later.bind((address, port))


def test_reserved_port_admits_a_reuseport_server():
    family, address = (socket.AF_INET6, "::") if socket.has_ipv6 else (socket.AF_INET, "127.0.0.1")
    with reserved_port() as port, socket.socket(family) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        server.bind((address, port))
        server.listen()
        with socket.create_connection(("localhost", port), timeout=5):
            conn, _ = server.accept()  # the connection reaches the server, not the reservation
            conn.close()
