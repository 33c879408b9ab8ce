"""A bulk TCP transfer into a pod's sink, through `podgate port-forward` and through
`kubectl port-forward` (1.33) against the same gateway and the same pod: the sink's sha256
of what it received equals the sender's, for both tools, and the two tools agree.

64 MiB in `make test`; the full 1 GiB with PODGATE_FULL_ACCEPTANCE=1:

    PODGATE_FULL_ACCEPTANCE=1 .venv/bin/python -m pytest tests/forward_e2e -m slow -s
"""

from __future__ import annotations

import pytest
from forward_e2e_support import (
    FULL,
    SINK_PORT,
    Keystream,
    SinkResult,
    Stack,
    free_port,
    kubectl_forward,
    podgate_forward,
    send_to_sink,
)
from gateway_support import matching

pytestmark = [pytest.mark.e2e, pytest.mark.privileged, pytest.mark.slow]

SIZE = (1024 if FULL else 64) * 1024 * 1024
# Bound on one transfer (1 GiB takes seconds to tens of seconds through the gateway here).
TRANSFER_TIMEOUT_SECONDS = 600.0 if FULL else 120.0


def test_bulk_transfer_podgate_and_kubectl(stack: Stack) -> None:
    namespace = stack.namespace()
    pod = stack.pods.run_pod(namespace, "bulk")
    stack.pods.server(pod, "bulk")
    stream = Keystream()  # the same bytes for both tools
    audit = stack.node.audit
    results: dict[str, SinkResult] = {}

    mark = audit.mark()
    with podgate_forward(stack, "pod/bulk", [f"0:{SINK_PORT}"], namespace=namespace) as forward:
        port = forward.local_port(SINK_PORT)
        results["podgate"] = send_to_sink(port, stream, SIZE, TRANSFER_TIMEOUT_SECONDS)
        closed = forward.wait_event(
            lambda e: e.get("event") == "connection_closed" and e.get("remote") == SINK_PORT
        )
        assert forward.interrupt() == 0, forward.describe()
    assert (closed["bytes_out"], closed["bytes_in"]) == (SIZE, 64), closed
    assert not closed.get("error"), closed
    (podgate_record,) = audit.wait_for(
        mark, matching(verb="portforward", pod="bulk", port=SINK_PORT)
    )

    mark = audit.mark()
    local = free_port()
    with kubectl_forward(stack.kubectl(), namespace, "bulk", local, SINK_PORT) as kubectl:
        results["kubectl"] = send_to_sink(local, stream, SIZE, TRANSFER_TIMEOUT_SECONDS)
        assert kubectl.proc.poll() is None, kubectl.stderr
    (kubectl_record,) = audit.wait_for(
        mark, matching(verb="portforward", pod="bulk", port=SINK_PORT)
    )

    for tool, result in results.items():
        print(f"{tool}: {SIZE >> 20} MiB to the sink in {result.seconds:.1f} s")
        assert result.sent == SIZE, (tool, result)
        assert result.reply.decode() == result.sent_sha256, (tool, result)
    assert results["podgate"].sent_sha256 == results["kubectl"].sent_sha256
    for record in (podgate_record, kubectl_record):
        assert record["outcome"] == "allowed", record
        assert (record["bytes_in"], record["bytes_out"]) == (SIZE, 64), record
    # Two different clients, told apart by the transport the gateway served.
    assert kubectl_record["transport"] == "websocket:SPDY/3.1+portforward.k8s.io"
    print(f"podgate's transport: {podgate_record['transport']}")
