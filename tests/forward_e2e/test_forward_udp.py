"""UDP through `podgate port-forward REMOTE/udp`: DNS queries from the host to dnsmasq in a
plain pod and in a sandboxed pod, every reply matched to its query, and the gateway's audit
log naming the protocol of each forwarded flow.

dnsmasq answers from its own configuration only (no upstream, no hosts file), so a correct
reply proves the datagram reached the pod and came back: the id, the question and the answer
10.1.2.3 must all fit the query that is still in flight.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from forward_e2e_support import (
    DNS_PORT,
    FULL,
    SANDBOXED,
    Pod,
    Stack,
    podgate_forward,
    run_dns_queries,
)
from gateway_support import matching

pytestmark = [pytest.mark.e2e, pytest.mark.privileged, pytest.mark.slow]

# Queries per pod: 10,000 in `make test`, 100,000 with PODGATE_FULL_ACCEPTANCE=1.
QUERIES = 100_000 if FULL else 10_000
# Bound on one run of queries (a few seconds at the rates seen on loopback).
QUERIES_TIMEOUT_SECONDS = 600.0 if FULL else 120.0
# On the forwarded stream each datagram is a uint16 big-endian length, then the payload (the
# UDP extension's framing), so the gateway counts 2 bytes more per datagram than the payload.
FRAME_PREFIX_BYTES = 2


@pytest.fixture(scope="module")
def dns_pods(stack: Stack) -> Iterator[tuple[str, dict[str, Pod]]]:
    """dnsmasq in a plain pod ("dns") and in a sandboxed one ("dns-sandboxed")."""
    namespace = stack.namespace()
    pods = {
        "dns": stack.pods.run_pod(namespace, "dns"),
        "dns-sandboxed": stack.pods.run_pod(namespace, "dns-sandboxed", handler=SANDBOXED),
    }
    for pod in pods.values():
        stack.pods.dnsmasq(pod)
    yield namespace, pods
    for pod in pods.values():
        stack.pods.remove_pod(pod)


@pytest.mark.parametrize("name", ["dns", "dns-sandboxed"])
def test_dns_queries_through_udp_forward(
    stack: Stack, dns_pods: tuple[str, dict[str, Pod]], name: str
) -> None:
    namespace, _ = dns_pods
    audit = stack.node.audit
    mark = audit.mark()
    spec = f"0:{DNS_PORT}/udp"
    with podgate_forward(stack, f"pod/{name}", [spec], namespace=namespace) as forward:
        port = forward.local_port(DNS_PORT, "udp")
        run = run_dns_queries(port, QUERIES, timeout=QUERIES_TIMEOUT_SECONDS)
        print(
            f"{name}: {run.matched} of {QUERIES} queries answered in {run.seconds:.2f} s "
            f"({run.matched / run.seconds:.0f}/s)"
        )
        assert run.matched == QUERIES and not run.lost and not run.mismatched, (
            run.problems() + "\n" + forward.describe()
        )
        assert forward.interrupt() == 0, forward.describe()
    # One flow (one client socket), its bytes counted from the local side: payloads only.
    flows = [e for e in forward.events if e.get("peer") == run.peer]
    assert [e["event"] for e in flows] == ["connection_opened", "connection_closed"], flows
    closed = flows[1]
    assert (closed["remote"], closed["protocol"]) == (DNS_PORT, "udp"), closed
    assert (closed["bytes_out"], closed["bytes_in"]) == (run.query_bytes, run.reply_bytes)
    # The gateway's record of that flow: UDP, under podgate's protocol extension, its bytes
    # counted on the stream (each datagram framed by a 2-byte length).
    (record,) = audit.wait_for(
        mark,
        lambda e: matching(verb="portforward", namespace=namespace, pod=name)(e) and "port" in e,
    )
    assert (record["port"], record["protocol"]) == (DNS_PORT, "udp"), record
    assert record["transport"] == "websocket:SPDY/3.1+udp.portforward.podgate.io", record
    assert record["outcome"] == "allowed", record
    assert record["bytes_in"] == run.query_bytes + FRAME_PREFIX_BYTES * QUERIES, record
    assert record["bytes_out"] == run.reply_bytes + FRAME_PREFIX_BYTES * QUERIES, record
