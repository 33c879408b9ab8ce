"""`kubectl port-forward` (1.33) through the gateway into `podgate runtime`, whose SPDY session
with the gateway is a plain loopback socket and whose pod socket is a plain one too: the DATA
payloads are spliced in the kernel both ways (podgate.aio.spdysplice). The sink's sha256 of an
upload and the echo's sha256 of a round trip match what was sent, and the runtime's log says
how many payload bytes went around Python each way."""

from __future__ import annotations

import hashlib
import re
import time

import pytest
from forward_e2e_support import (
    ECHO_PORT,
    FULL,
    SINK_PORT,
    Keystream,
    Stack,
    echo_roundtrip,
    free_port,
    kubectl_forward,
    send_to_sink,
)

pytestmark = [pytest.mark.e2e, pytest.mark.privileged, pytest.mark.slow]

SIZE = (1024 if FULL else 64) * 1024 * 1024
ECHO_SIZE = 16 * 1024 * 1024
TRANSFER_TIMEOUT_SECONDS = 600.0 if FULL else 120.0
# The runtime logs a session's spliced bytes once the gateway has closed it.
LOG_WAIT_SECONDS = 30.0
SPLICED = re.compile(
    r"port-forward (?P<pod>\S+): (?P<received>\d+) payload bytes spliced from the client, "
    r"(?P<sent>\d+) to it"
)


def spliced_totals(log: str, pod: str) -> tuple[int, int]:
    received = sent = 0
    for found in SPLICED.finditer(log):
        if found["pod"] == pod:
            received += int(found["received"])
            sent += int(found["sent"])
    return received, sent


def test_kubectl_bulk_and_echo_are_spliced_in_the_runtime(stack: Stack) -> None:
    namespace = stack.namespace()
    pod = stack.pods.run_pod(namespace, "spliced")
    stack.pods.server(pod, "bulk")
    stream = Keystream()
    echo_data = b"".join(Keystream().chunks(ECHO_SIZE))
    log_start = stack.runtime.output.stat().st_size
    local = free_port()
    with kubectl_forward(stack.kubectl(), namespace, "spliced", local, SINK_PORT) as kubectl:
        result = send_to_sink(local, stream, SIZE, TRANSFER_TIMEOUT_SECONDS)
        assert kubectl.proc.poll() is None, kubectl.stderr
    assert result.sent == SIZE
    assert result.reply.decode() == result.sent_sha256
    local = free_port()
    with kubectl_forward(stack.kubectl(), namespace, "spliced", local, ECHO_PORT) as kubectl:
        echoed = echo_roundtrip(local, echo_data, TRANSFER_TIMEOUT_SECONDS)
        assert kubectl.proc.poll() is None, kubectl.stderr
    assert echoed == hashlib.sha256(echo_data).hexdigest()

    # The gateway keeps its session to the runtime for the next forward; stopping it ends
    # the session, and the runtime logs what was spliced in it.
    assert stack.node.stop() == 0
    stack.node.start()
    deadline = time.monotonic() + LOG_WAIT_SECONDS
    while True:
        log = stack.runtime.output.read_bytes()[log_start:].decode(errors="replace")
        received, sent = spliced_totals(log, f"{namespace}/spliced")
        if (received and sent) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    print(f"spliced in the runtime: {received} bytes from the gateway, {sent} to it")
    # Most of the upload (and of the echo's way in) and of the echo's way out went around
    # Python in the runtime; the rest came with frame headers or met a busy socket.
    assert received > SIZE // 4, log[-2000:]
    assert sent > ECHO_SIZE // 8, log[-2000:]
