"""Streams through `podgate up` that end the way a kubelet ends them (issue: the pod closing a
connection must reach every client as EOF; a lost upstream must reach it as an error).

The `data` pod's HTTP/1.0 server answers one request and closes, without waiting for the
client's EOF: the client sees the end of the response only if the pod's close travels all
the way. Each client reads until EOF under a generous socket timeout, so a missing EOF fails
the test (the gateway's 60 s half-close grace is far beyond it); the delay is printed.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path

import pytest
from e2e_support import free_port
from gateway_support import (
    ECHO_PORT,
    HTTP10_BODY,
    HTTP10_PORT,
    STALL_PORT,
    Gateway,
    bearer,
    exec_target,
    matching,
    spdy_headers,
    websocket_headers,
)
from test_gateway_kubectl import _case, kubectl_for

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

# Far below the gateway's 60 s half-close grace (which ended such connections before), far
# above the fraction of a second EOF takes through kubectl on loopback.
EOF_TIMEOUT_SECONDS = 20.0
REQUEST = b"GET / HTTP/1.0\r\nHost: data\r\n\r\n"
PF_PATH = "/api/v1/namespaces/default/pods/data/portforward"
# Abandoned upgrades per kind: a few, so that the race between the answer and the close is
# lost in more than one place.
ABANDON_REPEATS = 5
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
# The bound: once the clients left, RSS within 16 MB of where it started.
RSS_SLACK_BYTES = 16_000_000


# The inode column of /proc/PID/net/<table> (0-based; netlink's is the last).
_INODE_FIELD = {"tcp": 9, "tcp6": 9, "udp": 9, "udp6": 9, "raw": 9, "raw6": 9, "unix": 6}


def _listed_socket_inodes(pids: list[int]) -> set[str]:
    """Inodes of every socket the kernel lists in these processes' network namespaces."""
    found: set[str] = set()
    for pid in pids:
        for table, field in _INODE_FIELD.items():
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                    fields = line.split()
                    if len(fields) > field:
                        found.add(fields[field])
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/netlink").read_text().splitlines()[1:]:
                found.add(line.split()[-1])
    return found


def _one_pid_per_network_namespace() -> list[int]:
    """A process in each network namespace of the machine (the pods' among them)."""
    found: dict[tuple[int, int], int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                st = os.stat(entry / "ns" / "net")
                found.setdefault((st.st_dev, st.st_ino), int(entry.name))
    return list(found.values())


def rss_and_fds(pid: int) -> tuple[int, int]:
    """RSS, and the descriptors held apart from the runtime's pool of unconnected sockets made
    ahead in pod namespaces (netns_pool: its level after a burst is anywhere up to a batch)."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = next(
        int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")
    )
    listed = _listed_socket_inodes([pid, *_one_pid_per_network_namespace()])
    held = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            # An unconnected, unbound TCP socket is in no table: a pooled one.
            if target.startswith("socket:[") and target[8:-1] not in listed:
                continue
            held += 1
    return rss_kib * 1024, held


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


def test_a_pod_that_never_reads_releases_every_fd_and_the_memory_once_clients_leave(
    gateway: Gateway,
) -> None:
    """Descriptors come back to the start and RSS to within 16 MB of it. `podgate up` is the
    runtime and the gateway in one process: its RSS is both daemons' (the stalled bytes sit in
    the gateway's and the runtime streaming server's queues). What held ~25 MiB here before:
    stored stream errors raised as themselves and cancelled reader tasks, whose tracebacks
    kept the pumps' last chunks in reference cycles (tests/aio/test_reference_cycles.py)."""
    pid = gateway.proc.pid
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
        released = fds <= start_fds and rss <= start_rss + RSS_SLACK_BYTES
        if released or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    print(
        f"never-reading pod: {STALL_CONNECTIONS} connections took {pushed >> 20} MiB; "
        f"RSS {start_rss >> 20} -> peak {peak_rss >> 20} -> {rss >> 20} MiB, "
        f"fds {start_fds} -> peak {peak_fds} -> {fds}"
    )
    assert fds <= start_fds
    assert rss <= start_rss + RSS_SLACK_BYTES, (rss, start_rss)


# Port-forward through the WebSocket tunnel and SPDY, exec through WebSocket and SPDY, and
# v4 channel port-forward (the Python client's): every upgrade kind the gateway serves.
ABANDONED_UPGRADES = {
    "ws-exec": (
        exec_target("data", ["cat"]) + "&stdin=true",
        websocket_headers("v5.channel.k8s.io"),
    ),
    "spdy-exec": (
        exec_target("data", ["cat"]) + "&stdin=true",
        spdy_headers(["v4.channel.k8s.io"]),
    ),
    "ws-tunnel": (
        f"{PF_PATH}",
        websocket_headers("SPDY/3.1+portforward.k8s.io"),
    ),
    "ws-v4-portforward": (f"{PF_PATH}?ports={ECHO_PORT}", websocket_headers("v4.channel.k8s.io")),
    "spdy-portforward": (PF_PATH, spdy_headers(["portforward.k8s.io"])),
}


@pytest.mark.parametrize("kind", list(ABANDONED_UPGRADES))
def test_a_client_that_leaves_before_the_answer_leaves_no_traceback(
    gateway: Gateway, kind: str
) -> None:
    """The client sends its upgrade and closes at once: the gateway's answer meets a closed
    connection. That is the client's business, not a crash: the log gets no traceback."""
    target, headers = ABANDONED_UPGRADES[kind]
    credentials = bearer(gateway.admin_token())
    log_mark = gateway.log_mark()
    audit_mark = gateway.audit.mark()
    for _ in range(ABANDON_REPEATS):
        conn = gateway.connect()
        conn.send(conn.request("GET", target, [*headers, *credentials]))
        conn.close()  # what the gateway writes from now on meets a closed socket
    # Each abandoned session ends (and is audited) before the log is read.
    gateway.audit.wait_for(audit_mark, matching(stage="finished"), count=ABANDON_REPEATS)
    log = gateway.log_since(log_mark)
    assert "Traceback" not in log, log
