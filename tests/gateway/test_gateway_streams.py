"""Streams through `podgate up` that end the way a kubelet ends them (issue: the pod closing a
connection must reach every client as EOF; a lost upstream must reach it as an error).

The `data` pod's HTTP/1.0 server answers one request and closes, without waiting for the
client's EOF: the client sees the end of the response only if the pod's close travels all
the way. Each client reads until EOF under a generous socket timeout, so a missing EOF fails
the test (the gateway's 60 s half-close grace is far beyond it); the delay is printed.
"""

from __future__ import annotations

import socket
import time

import pytest
from e2e_support import free_port
from gateway_support import HTTP10_BODY, HTTP10_PORT, Gateway
from test_gateway_kubectl import _case, kubectl_for

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

# Far below the gateway's 60 s half-close grace (which ended such connections before), far
# above the fraction of a second EOF takes through kubectl on loopback.
EOF_TIMEOUT_SECONDS = 20.0
REQUEST = b"GET / HTTP/1.0\r\nHost: data\r\n\r\n"
EXPECTED = b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n" + HTTP10_BODY


def http10_exchange(sock: socket.socket) -> tuple[bytes, float]:
    """Send the request without half-closing; read to EOF. (answer, seconds from the last
    answer byte to EOF)."""
    sock.settimeout(EOF_TIMEOUT_SECONDS)
    sock.sendall(REQUEST)
    answer = bytearray()
    last = time.monotonic()
    while chunk := sock.recv(65536):
        answer += chunk
        last = time.monotonic()
    return bytes(answer), time.monotonic() - last


@pytest.mark.parametrize("profile", ["1.27", "1.30", "1.33", "1.33-pf-spdy"])
def test_pod_close_reaches_kubectl_port_forward_as_eof(gateway: Gateway, profile: str) -> None:
    case = _case(profile, "x509")
    local = free_port()
    with kubectl_for(gateway, case).port_forward("data", local, HTTP10_PORT) as forwarder:
        for _ in range(3):  # repeated: each connection of the session ends on its own
            with socket.create_connection(("127.0.0.1", local)) as sock:
                answer, eof_after = http10_exchange(sock)
            assert answer == EXPECTED
            print(f"kubectl {profile}: EOF {eof_after * 1000:.0f} ms after the answer")
        assert forwarder.proc.poll() is None, forwarder.stderr
    assert "error" not in forwarder.stderr.lower(), forwarder.stderr
