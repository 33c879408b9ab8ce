"""podgate's UDP port-forward extension, sans-IO: negotiation as one more protocol version (a
kubectl offer never gets it), and the `protocol` pair header that only counts under it."""

from __future__ import annotations

import pytest

from podgate.proto.errors import LocalProtocolError
from podgate.proto.portforward import (
    CLIENT_SPDY_PROTOCOLS_WITH_UDP,
    CLIENT_TUNNEL_PROTOCOLS_WITH_UDP,
    SERVER_SPDY_PROTOCOLS,
    SERVER_WS_PROTOCOLS,
    UDP_PORTFORWARD_PROTOCOL,
    ForwardProtocol,
    Pair,
    Pending,
    PortForwardPairing,
    StreamType,
    UnsupportedProtocol,
    allows_udp,
    stream_headers,
)
from podgate.proto.upgrade import Accepted, Rejected, StreamKind, Transport, negotiate

KUBECTL_SPDY = "portforward.k8s.io"
KUBECTL_TUNNEL = "SPDY/3.1+portforward.k8s.io"
UDP = "udp.portforward.podgate.io"
UDP_TUNNEL = "SPDY/3.1+udp.portforward.podgate.io"


def spdy_request(*offers: str) -> list[tuple[bytes, bytes]]:
    head = [(b"connection", b"Upgrade"), (b"upgrade", b"SPDY/3.1")]
    return head + [(b"x-stream-protocol-version", o.encode()) for o in offers]


def ws_request(offer: str) -> list[tuple[bytes, bytes]]:
    return [
        (b"connection", b"Upgrade"),
        (b"upgrade", b"websocket"),
        (b"sec-websocket-key", b"dGhlIHNhbXBsZSBub25jZQ=="),
        (b"sec-websocket-version", b"13"),
        (b"sec-websocket-protocol", offer.encode()),
    ]


def podgate_negotiate(method: str, headers: list[tuple[bytes, bytes]]) -> Accepted | Rejected:
    """What podgate's servers call for a port-forward upgrade."""
    return negotiate(
        method,
        headers,
        StreamKind.PORTFORWARD,
        spdy_protocols=SERVER_SPDY_PROTOCOLS,
        ws_protocols=SERVER_WS_PROTOCOLS,
    )


def test_names() -> None:
    assert UDP_PORTFORWARD_PROTOCOL == UDP
    assert CLIENT_SPDY_PROTOCOLS_WITH_UDP == (UDP, KUBECTL_SPDY)
    assert CLIENT_TUNNEL_PROTOCOLS_WITH_UDP == (UDP_TUNNEL, KUBECTL_TUNNEL)
    assert allows_udp(UDP)
    assert not allows_udp(KUBECTL_SPDY)
    assert not allows_udp(UDP_TUNNEL)  # the inner protocol is what counts


def test_kubectl_spdy_offer_gets_plain_portforward() -> None:
    decision = podgate_negotiate("POST", spdy_request(KUBECTL_SPDY))
    assert isinstance(decision, Accepted)
    assert (decision.transport, decision.protocol) == (Transport.SPDY, KUBECTL_SPDY)
    assert (b"X-Stream-Protocol-Version", b"portforward.k8s.io") in decision.response_headers


def test_kubectl_tunnel_offer_gets_plain_portforward() -> None:
    decision = podgate_negotiate("GET", ws_request(KUBECTL_TUNNEL))
    assert isinstance(decision, Accepted)
    assert decision.transport is Transport.WEBSOCKET_TUNNEL
    assert (decision.protocol, decision.inner_protocol) == (KUBECTL_TUNNEL, KUBECTL_SPDY)


def test_podgate_offer_gets_the_extension() -> None:
    decision = podgate_negotiate("POST", spdy_request(UDP, KUBECTL_SPDY))
    assert isinstance(decision, Accepted)
    assert decision.protocol == UDP
    assert (b"X-Stream-Protocol-Version", UDP.encode()) in decision.response_headers
    tunnel = podgate_negotiate("GET", ws_request(f"{UDP_TUNNEL},{KUBECTL_TUNNEL}"))
    assert isinstance(tunnel, Accepted)
    assert (tunnel.protocol, tunnel.inner_protocol) == (UDP_TUNNEL, UDP)


def test_an_upstream_server_answers_the_podgate_offer_with_plain_portforward() -> None:
    # negotiate() with its defaults is the apimachinery server (kubelet, containerd).
    decision = negotiate("POST", spdy_request(UDP, KUBECTL_SPDY), StreamKind.PORTFORWARD)
    assert isinstance(decision, Accepted)
    assert decision.protocol == KUBECTL_SPDY
    tunnel = negotiate("GET", ws_request(f"{UDP_TUNNEL},{KUBECTL_TUNNEL}"), StreamKind.PORTFORWARD)
    assert isinstance(tunnel, Accepted)
    assert tunnel.protocol == KUBECTL_TUNNEL


def test_an_offer_of_nothing_known_lists_both_versions() -> None:
    decision = podgate_negotiate("POST", spdy_request("v9.portforward.k8s.io"))
    assert isinstance(decision, Rejected)
    assert decision.status == 403
    accepted = [v for n, v in decision.headers if n == b"X-Accepted-Stream-Protocol-Versions"]
    assert accepted == [b"portforward.k8s.io", b"udp.portforward.podgate.io"]


# --- pair headers ------------------------------------------------------------------------------


def headers(stream_type: str, request_id: str = "0", protocol: str | None = None) -> dict[str, str]:
    out = {"streamtype": stream_type, "port": "53", "requestid": request_id}
    if protocol is not None:
        out["protocol"] = protocol
    return out


def test_stream_headers() -> None:
    # TCP pairs carry exactly kubectl's headers; UDP ones add one.
    assert stream_headers("data", 53, "4") == {"streamtype": "data", "port": "53", "requestid": "4"}
    assert stream_headers("error", 53, "4", "udp") == {
        "streamtype": "error",
        "port": "53",
        "requestid": "4",
        "protocol": "udp",
    }
    with pytest.raises(LocalProtocolError, match="sctp"):
        stream_headers("data", 53, "4", "sctp")


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, ForwardProtocol.TCP), ("tcp", ForwardProtocol.TCP), ("udp", ForwardProtocol.UDP)],
)
def test_protocol_header_under_the_extension(value: str | None, expected: ForwardProtocol) -> None:
    pairing = PortForwardPairing("c1", udp=True)
    assert pairing.add_stream(1, headers("error", protocol=value), 0.0) == Pending(
        "0", 1, StreamType.ERROR
    )
    assert pairing.add_stream(3, headers("data", protocol=value), 0.0) == Pair(
        "0", 53, 1, 3, expected
    )


def test_the_data_streams_header_counts() -> None:
    pairing = PortForwardPairing("c1", udp=True)
    pairing.add_stream(1, headers("error", protocol="tcp"), 0.0)
    assert pairing.add_stream(3, headers("data", protocol="udp"), 0.0) == Pair(
        "0", 53, 1, 3, ForwardProtocol.UDP
    )


@pytest.mark.parametrize("value", ["sctp", "UDP", "udp ", "quic"])
def test_unknown_protocol_fails_that_pair_only(value: str) -> None:
    pairing = PortForwardPairing("c1", udp=True)
    pairing.add_stream(1, headers("error", "0", value), 0.0)
    result = pairing.add_stream(3, headers("data", "0", value), 0.0)
    assert result == UnsupportedProtocol(
        "0", 53, 1, 3, f'unsupported port-forward protocol "{value}": expected "tcp" or "udp"'
    )
    assert len(pairing) == 0
    # The next pair on the connection is fine.
    pairing.add_stream(5, headers("error", "1", "udp"), 0.0)
    assert pairing.add_stream(7, headers("data", "1", "udp"), 0.0) == Pair(
        "1", 53, 5, 7, ForwardProtocol.UDP
    )


@pytest.mark.parametrize("value", ["udp", "sctp", ""])
def test_without_the_extension_the_header_is_ignored(value: str) -> None:
    # Plain portforward.k8s.io: whatever the header says, the pair is TCP, as upstream.
    pairing = PortForwardPairing("c1")
    pairing.add_stream(1, headers("error", protocol=value), 0.0)
    result = pairing.add_stream(3, headers("data", protocol=value), 0.0)
    assert result == Pair("0", 53, 1, 3)
    assert isinstance(result, Pair) and result.protocol is ForwardProtocol.TCP
