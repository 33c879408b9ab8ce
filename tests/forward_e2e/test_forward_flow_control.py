"""One stalled connection through `podgate port-forward` holds up only itself.

podgate port-forward carries every local connection to a pod on one session to the gateway,
and offers podgate's extension even for TCP-only targets, so that session (like the gateway's
own session to the runtime) has per-stream flow control. A local client writing into a pod
server that accepts but never reads fills its stream's window; the gateway keeps reading the
session, so a second connection through the same forwarder still moves 64 MiB, and the
session is never declared lost (before, its pings went unanswered and it was replaced after
~20 s, ending every connection on it).
"""

from __future__ import annotations

import select
import socket
import time

import pytest
from forward_e2e_support import (
    HOLD_PORT,
    SINK_PORT,
    Keystream,
    Stack,
    podgate_forward,
    send_to_sink,
)

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

# The stalled writer: no progress for this long means every buffer on the way is full; it
# fails if this much is taken without any backpressure.
STALL_CONFIRM_SECONDS = 2.0
MAX_STALL_BYTES = 1024 * 1024 * 1024
STALL_WRITE_BYTES = 1024 * 1024
# The second connection's transfer and its bound: about a second here, and below the ~10-20 s
# after which unanswered pings would have the forwarder drop a stalled session.
TRANSFER_BYTES = 64 * 1024 * 1024
TRANSFER_TIMEOUT_SECONDS = 10.0
# Events that would mean the session was given up on.
LOST_EVENTS = ("session_lost", "reconnecting", "reconnected", "connection_error")


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


def test_a_stalled_connection_leaves_the_others_on_the_session_alone(stack: Stack) -> None:
    namespace = stack.namespace()
    pod = stack.pods.run_pod(namespace, "stall")
    container = stack.pods.server(pod, "stall")
    ports = [f"0:{HOLD_PORT}", f"0:{SINK_PORT}"]
    with podgate_forward(stack, "pod/stall", ports, namespace=namespace) as forward:
        hold, sink = forward.local_port(HOLD_PORT), forward.local_port(SINK_PORT)
        with socket.create_connection(("127.0.0.1", hold)) as stalled:
            taken = fill_until_stalled(stalled)
            # It reached the pod's server: the stall is the server not reading.
            stack.pods.wait_log(container, b"held 1")
            result = send_to_sink(sink, Keystream(), TRANSFER_BYTES, TRANSFER_TIMEOUT_SECONDS)
            assert result.sent == TRANSFER_BYTES
            assert result.reply.decode() == result.sent_sha256
            # The stalled connection is still open, and the session was never given up on.
            with pytest.raises(BlockingIOError):
                stalled.recv(1)
            lost = [e for e in forward.since(0) if e.get("event") in LOST_EVENTS]
            assert lost == [], forward.describe()
    print(f"{taken >> 20} MiB taken before the stall; 64 MiB beside it in {result.seconds:.1f} s")
