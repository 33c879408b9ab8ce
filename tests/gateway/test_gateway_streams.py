"""Streams through `podgate up` that end the way a kubelet ends them (issue: the pod closing a
connection must reach every client as EOF; a lost upstream must reach it as an error).

The `data` pod's HTTP/1.0 server answers one request and closes, without waiting for the
client's EOF: the client sees the end of the response only if the pod's close travels all
the way. Each client reads until EOF under a generous socket timeout, so a missing EOF fails
the test (the gateway's 60 s half-close grace is far beyond it); the delay is printed.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
from e2e_support import free_port
from gateway_support import HTTP10_BODY, HTTP10_PORT, STALL_PORT, Gateway
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


# Connections opened to the never-reading pod port, each pushing what the path accepts.
STALL_CONNECTIONS = 200
# Bytes each connection tries to push (far more than the path buffers: it backpressures).
STALL_PUSH_BYTES = 4 * 1024 * 1024
# How long one connection keeps pushing before the next is opened.
STALL_PUSH_SECONDS = 0.05
# Generous deadline to poll for the release (the mechanism releases within seconds).
RELEASE_DEADLINE_SECONDS = 60.0


def rss_and_fds(pid: int) -> tuple[int, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = next(
        int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")
    )
    return rss_kib * 1024, len(os.listdir(f"/proc/{pid}/fd"))


def push(sock: socket.socket, data: bytes) -> int:
    """Send without blocking for STALL_PUSH_SECONDS; the bytes the path took."""
    sock.setblocking(False)
    sent = 0
    deadline = time.monotonic() + STALL_PUSH_SECONDS
    while sent < len(data) and time.monotonic() < deadline:
        try:
            sent += sock.send(data[sent : sent + 256 * 1024])
        except BlockingIOError:
            time.sleep(0.005)
    return sent


def test_a_pod_that_never_reads_releases_every_fd_once_clients_leave(gateway: Gateway) -> None:
    """Descriptors come back to the start; RSS is measured and printed (the issue's 16 MB
    bound on RSS is not met yet: see the figures printed)."""
    pid = gateway.proc.pid  # `podgate up`: runtime and gateway in one process
    case = _case("1.33", "x509")
    local = free_port()
    data = os.urandom(STALL_PUSH_BYTES)
    # Warm the paths up (first session, pools, imports) before the baseline.
    with (
        kubectl_for(gateway, case).port_forward("data", local, HTTP10_PORT),
        socket.create_connection(("127.0.0.1", local)) as sock,
    ):
        assert http10_exchange(sock)[0] == EXPECTED
    time.sleep(1.0)
    start_rss, start_fds = rss_and_fds(pid)
    pushed = 0
    with kubectl_for(gateway, case).port_forward("data", local, STALL_PORT) as forwarder:
        socks = [socket.create_connection(("127.0.0.1", local)) for _ in range(STALL_CONNECTIONS)]
        try:
            for sock in socks:
                pushed += push(sock, data)
            peak_rss, peak_fds = rss_and_fds(pid)
        finally:
            for sock in socks:
                sock.close()
        assert forwarder.proc.poll() is None, forwarder.stderr
    # The clients and kubectl are gone: poll until everything is back.
    deadline = time.monotonic() + RELEASE_DEADLINE_SECONDS
    while True:
        rss, fds = rss_and_fds(pid)
        if fds <= start_fds or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    print(
        f"never-reading pod: {STALL_CONNECTIONS} connections took {pushed >> 20} MiB; "
        f"RSS {start_rss >> 20} -> peak {peak_rss >> 20} -> {rss >> 20} MiB, "
        f"fds {start_fds} -> peak {peak_fds} -> {fds}"
    )
    assert fds <= start_fds
