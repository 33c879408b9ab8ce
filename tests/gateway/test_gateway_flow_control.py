"""One stalled port-forward connection through `podgate up` holds up only itself.

The gateway keeps one upstream SPDY session per pod to the runtime's streaming server and
opens a stream pair on it for every forwarded connection. Both ends are podgate, so that
session negotiates podgate's extension and with it per-stream flow control: a pod server that
accepts a connection but never reads fills that stream's window, and the runtime keeps
reading the session for everyone else. Here user A writes into such a server until everything
on the way is full, then user B's kubectl 1.33 moves 64 MiB to the same pod's sink through the
same gateway, and so through the same pooled upstream session.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest
from e2e_support import exchange_tcp, free_port, sha256_hex, stop_process
from gateway_support import SINK_PORT, Gateway, read_lines

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

# The data pod's port for the server started here: it accepts and never reads.
HOLD_PORT = 7005
# The held server ends itself after this long, should its kubectl exec outlive the test.
HOLD_LIFETIME_SECONDS = 300
HOLD_SERVER = f"""\
import os, socket, sys, threading
threading.Timer({HOLD_LIFETIME_SECONDS}, os._exit, (0,)).start()
s = socket.create_server(("127.0.0.1", {HOLD_PORT}))
held = []
def accept():
    while True:
        c, _ = s.accept()
        held.append(c)
        print("held", len(held), flush=True)
threading.Thread(target=accept, daemon=True).start()
print("listening", flush=True)
sys.stdin.read()
os._exit(0)
"""
# How long the exec'd server may take to listen, and to report a connection.
HOLD_READY_SECONDS = 30.0
# User A's writer: no progress for this long means every buffer on the way is full.
STALL_CONFIRM_SECONDS = 2.0
# ...and it gives up (the stall never came: nothing pushes back) after this much.
MAX_STALL_BYTES = 1024 * 1024 * 1024
STALL_WRITE_BYTES = 1024 * 1024
# User B's transfer beside the stall, and its bound: under a second on loopback. Without flow
# control B's stream pair cannot even be opened on the stalled session until the gateway gives
# up waiting for SYN_REPLY (30 s, client-go's timeout) and replaces the session, which ends
# A's connection; the bound is below that, and A's connection must survive.
TRANSFER_BYTES = 64 * 1024 * 1024
TRANSFER_TIMEOUT_SECONDS = 20.0


@contextlib.contextmanager
def hold_server(gateway: Gateway) -> Iterator[subprocess.Popen[bytes]]:
    """The never-reading server, run in the data pod with `kubectl exec -i` (it shares the
    pod's network namespace); it exits when its stdin closes."""
    kubectl = gateway.kubectl("1.33", gateway.kubeconfig)
    proc = subprocess.Popen(
        kubectl.argv(["exec", "-i", "data", "--", "python3", "-c", HOLD_SERVER]),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=kubectl.environ(),
    )
    try:
        assert read_lines(proc, 1, HOLD_READY_SECONDS) == ["listening"]
        yield proc
    finally:
        stop_process(proc)


def fill_until_stalled(sock: socket.socket) -> int:
    """Write until nothing more is taken for STALL_CONFIRM_SECONDS; the bytes taken."""
    sock.setblocking(False)
    block = bytes(STALL_WRITE_BYTES)
    total = 0
    last_progress = time.monotonic()
    while time.monotonic() - last_progress < STALL_CONFIRM_SECONDS:
        assert total < MAX_STALL_BYTES, f"{total} bytes taken and still no backpressure"
        _, writable, _ = select.select([], [sock], [], STALL_CONFIRM_SECONDS / 4)
        if not writable:
            continue
        try:
            sent = sock.send(block)
        except BlockingIOError:
            continue
        total += sent
        last_progress = time.monotonic()
    return total


def test_a_stalled_connection_does_not_stall_another_users_forward(gateway: Gateway) -> None:
    token = secrets.token_urlsafe(32)
    gateway.add_token(token, "user-b", ["system:masters"])
    user_a = gateway.kubectl("1.33", gateway.kubeconfig)
    user_b = gateway.kubectl("1.33", gateway.token_kubeconfig("user-b", token))
    data = os.urandom(TRANSFER_BYTES)
    with (
        hold_server(gateway) as held,
        user_a.port_forward("data", free_port(), HOLD_PORT) as forward_a,
        socket.create_connection(("127.0.0.1", forward_a.local_port)) as stalled,
    ):
        taken = fill_until_stalled(stalled)
        # The connection reached the pod's server (the stall is its not reading, not an error).
        assert read_lines(held, 1, HOLD_READY_SECONDS) == ["held 1"]
        with user_b.port_forward("data", free_port(), SINK_PORT) as forward_b:
            started = time.monotonic()
            answer = exchange_tcp(forward_b.local_port, data, TRANSFER_TIMEOUT_SECONDS)
            elapsed = time.monotonic() - started
            assert forward_b.proc.poll() is None, forward_b.stderr
        assert answer.head.decode() == sha256_hex(data)
        # User A's connection is still there: neither reset nor ended, just waiting.
        assert forward_a.proc.poll() is None, forward_a.stderr
        with pytest.raises(BlockingIOError):
            stalled.recv(1)
    print(f"{taken >> 20} MiB taken before user A's stall; user B's 64 MiB in {elapsed:.1f} s")
