"""Upgrade negotiation against the requests kubectl and the Python client really send.

Request bytes are the wire-order listings of kubectl-api-surface.md section 5 (and section 10
for the Python client), with PORT and <uuid> filled in. Expected 101 heads are the "response
that worked" listings of the same sections; Sec-WebSocket-Accept is checked against the
RFC 6455 section 1.3 example.
"""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podgate.proto.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from podgate.proto.upgrade import (
    MAX_HEAD_BYTES,
    PORTFORWARD_SPDY_PROTOCOLS,
    PORTFORWARD_WS_PROTOCOLS,
    REMOTECOMMAND_SPDY_PROTOCOLS,
    REMOTECOMMAND_WS_PROTOCOLS,
    Accepted,
    ClientHandshake,
    HandshakeError,
    Rejected,
    ServerHandshake,
    ServerState,
    StreamKind,
    Transport,
    UpgradeFailedError,
    UpgradeRequest,
    UpgradeResponse,
    build_spdy_request,
    build_ws_request,
    negotiate,
    status_body,
    ws_accept_value,
)

RFC_KEY = "dGhlIHNhbXBsZSBub25jZQ=="
# RFC 6455 section 1.3 (also sections 1.2 and 4.2.2).
RFC_ACCEPT = "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
SESSION = "5f1c3b2a-8d4e-4c6b-9a7f-0e1d2c3b4a59"


def crlf(*lines: str) -> bytes:
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


# kubectl-api-surface.md section 5.2 (1.29+: v5 offered first).
KUBECTL_SPDY_EXEC = crlf(
    "POST /api/v1/namespaces/default/pods/nginx/exec?command=cat&container=main&stderr=true"
    "&stdin=true&stdout=true HTTP/1.1",
    "Host: 127.0.0.1:6443",
    "User-Agent: kubectl/v1.33.1 (linux/amd64) kubernetes/8adc0f0",
    "Content-Length: 0",
    "Connection: Upgrade",
    "Kubectl-Command: kubectl exec",
    f"Kubectl-Session: {SESSION}",
    "Upgrade: SPDY/3.1",
    "X-Stream-Protocol-Version: v5.channel.k8s.io",
    "X-Stream-Protocol-Version: v4.channel.k8s.io",
    "X-Stream-Protocol-Version: v3.channel.k8s.io",
    "X-Stream-Protocol-Version: v2.channel.k8s.io",
    "X-Stream-Protocol-Version: channel.k8s.io",
)

# kubectl-api-surface.md section 5.4.
KUBECTL_SPDY_PORTFORWARD = crlf(
    "POST /api/v1/namespaces/default/pods/nginx/portforward HTTP/1.1",
    "Host: 127.0.0.1:6443",
    "User-Agent: kubectl/v1.27.16 (linux/amd64) kubernetes/cbb86e0",
    "Content-Length: 0",
    "Connection: Upgrade",
    "Kubectl-Command: kubectl port-forward",
    f"Kubectl-Session: {SESSION}",
    "Upgrade: SPDY/3.1",
    "X-Stream-Protocol-Version: portforward.k8s.io",
)

# kubectl-api-surface.md section 5.1, with the RFC 6455 example nonce.
KUBECTL_WS_EXEC = crlf(
    "GET /api/v1/namespaces/default/pods/nginx/exec?command=cat&container=main&stderr=true"
    "&stdin=true&stdout=true HTTP/1.1",
    "Host: 127.0.0.1:6443",
    "User-Agent: kubectl/v1.33.1 (linux/amd64) kubernetes/8adc0f0",
    "Connection: Upgrade",
    "Kubectl-Command: kubectl exec",
    f"Kubectl-Session: {SESSION}",
    f"Sec-WebSocket-Key: {RFC_KEY}",
    "Sec-WebSocket-Protocol: v5.channel.k8s.io",
    "Sec-WebSocket-Version: 13",
    "Upgrade: websocket",
)

# kubectl-api-surface.md section 5.3.
KUBECTL_WS_TUNNEL = crlf(
    "GET /api/v1/namespaces/default/pods/nginx/portforward HTTP/1.1",
    "Host: 127.0.0.1:6443",
    "User-Agent: kubectl/v1.33.1 (linux/amd64) kubernetes/8adc0f0",
    "Connection: Upgrade",
    "Kubectl-Command: kubectl port-forward",
    f"Kubectl-Session: {SESSION}",
    f"Sec-WebSocket-Key: {RFC_KEY}",
    "Sec-WebSocket-Protocol: SPDY/3.1+portforward.k8s.io",
    "Sec-WebSocket-Version: 13",
    "Upgrade: websocket",
)


def python_client_request(path: str) -> bytes:
    # kubectl-api-surface.md section 10: header order of the Python client 37.0.2.
    return crlf(
        f"GET {path} HTTP/1.1",
        "Upgrade: websocket",
        "Host: 127.0.0.1:6443",
        "Origin: http://127.0.0.1:6443",
        f"Sec-WebSocket-Key: {RFC_KEY}",
        "Sec-WebSocket-Version: 13",
        "Connection: Upgrade",
        "authorization: Bearer abc",
        "sec-websocket-protocol: v5.channel.k8s.io,v4.channel.k8s.io",
    )


def receive(raw: bytes) -> tuple[ServerHandshake, UpgradeRequest]:
    server = ServerHandshake()
    request = server.receive_data(raw)
    assert request is not None
    return server, request


def negotiate_raw(raw: bytes, kind: StreamKind) -> Accepted | Rejected:
    _, request = receive(raw)
    return negotiate(request.method, list(request.headers), kind)


def hdrs(*pairs: tuple[str, str]) -> list[tuple[bytes, bytes]]:
    return [(n.encode(), v.encode()) for n, v in pairs]


# --- constants --------------------------------------------------------------------------------


def test_protocol_lists_match_the_reference() -> None:
    assert REMOTECOMMAND_SPDY_PROTOCOLS == (
        "v4.channel.k8s.io",
        "v3.channel.k8s.io",
        "v2.channel.k8s.io",
        "channel.k8s.io",
    )
    assert PORTFORWARD_SPDY_PROTOCOLS == ("portforward.k8s.io",)
    assert REMOTECOMMAND_WS_PROTOCOLS == (
        "v5.channel.k8s.io",
        "v4.channel.k8s.io",
        "v4.base64.channel.k8s.io",
        "base64.channel.k8s.io",
        "channel.k8s.io",
        "",
    )
    assert PORTFORWARD_WS_PROTOCOLS == (
        "SPDY/3.1+portforward.k8s.io",
        "v4.channel.k8s.io",
        "v4.base64.channel.k8s.io",
        "",
    )


def test_ws_accept_matches_rfc6455_example() -> None:
    assert ws_accept_value(RFC_KEY) == RFC_ACCEPT


# --- SPDY -------------------------------------------------------------------------------------


def test_kubectl_spdy_exec_negotiates_v4() -> None:
    server, request = receive(KUBECTL_SPDY_EXEC)
    assert request.method == "POST"
    assert request.path == "/api/v1/namespaces/default/pods/nginx/exec"
    assert request.query == "command=cat&container=main&stderr=true&stdin=true&stdout=true"
    assert request.is_upgrade
    assert request.header_values("X-Stream-Protocol-Version") == [
        "v5.channel.k8s.io",
        "v4.channel.k8s.io",
        "v3.channel.k8s.io",
        "v2.channel.k8s.io",
        "channel.k8s.io",
    ]
    assert request.header("kubectl-command") == "kubectl exec"
    result = negotiate(request.method, list(request.headers), StreamKind.EXEC)
    assert isinstance(result, Accepted)
    assert result.transport is Transport.SPDY
    assert result.protocol == "v4.channel.k8s.io"
    assert server.accept(result) == crlf(
        "HTTP/1.1 101 Switching Protocols",
        "Connection: Upgrade",
        "Upgrade: SPDY/3.1",
        "X-Stream-Protocol-Version: v4.channel.k8s.io",
    )
    assert server.state is ServerState.SWITCHED
    assert server.trailing_data == b""


def test_kubectl_127_offer_and_attach_negotiate_v4() -> None:
    offer = [("X-Stream-Protocol-Version", p) for p in REMOTECOMMAND_SPDY_PROTOCOLS]
    headers = hdrs(("Connection", "Upgrade"), ("Upgrade", "SPDY/3.1"), *offer)
    result = negotiate("POST", headers, StreamKind.ATTACH)
    assert isinstance(result, Accepted)
    assert result.protocol == "v4.channel.k8s.io"


def test_spdy_comma_separated_versions_and_get() -> None:
    headers = hdrs(
        ("connection", "upgrade"),
        ("upgrade", "spdy/3.1"),
        ("x-stream-protocol-version", "v9.channel.k8s.io, v3.channel.k8s.io,v4.channel.k8s.io"),
    )
    result = negotiate("GET", headers, StreamKind.EXEC)
    assert isinstance(result, Accepted)
    # Client order wins over server order.
    assert result.protocol == "v3.channel.k8s.io"


def test_spdy_server_may_offer_v5() -> None:
    _, request = receive(KUBECTL_SPDY_EXEC)
    server_list = ("v5.channel.k8s.io", *REMOTECOMMAND_SPDY_PROTOCOLS)
    result = negotiate(
        request.method, list(request.headers), StreamKind.EXEC, spdy_protocols=server_list
    )
    assert isinstance(result, Accepted)
    assert result.protocol == "v5.channel.k8s.io"


def test_kubectl_spdy_portforward() -> None:
    server, request = receive(KUBECTL_SPDY_PORTFORWARD)
    assert request.query == ""
    result = negotiate(request.method, list(request.headers), StreamKind.PORTFORWARD)
    assert isinstance(result, Accepted)
    assert result.transport is Transport.SPDY
    assert result.protocol == "portforward.k8s.io"
    assert server.accept(result) == crlf(
        "HTTP/1.1 101 Switching Protocols",
        "Connection: Upgrade",
        "Upgrade: SPDY/3.1",
        "X-Stream-Protocol-Version: portforward.k8s.io",
    )


def test_spdy_exec_protocols_are_not_portforward_protocols() -> None:
    result = negotiate_raw(KUBECTL_SPDY_EXEC, StreamKind.PORTFORWARD)
    assert isinstance(result, Rejected)
    assert result.status == 403


def test_spdy_unknown_protocols_get_403_with_accepted_versions() -> None:
    headers = hdrs(
        ("Connection", "Upgrade"),
        ("Upgrade", "SPDY/3.1"),
        ("X-Stream-Protocol-Version", "v9.channel.k8s.io"),
    )
    result = negotiate("POST", headers, StreamKind.EXEC)
    assert isinstance(result, Rejected)
    assert result.status == 403
    assert result.reason == "Forbidden"
    accepted = [v for n, v in result.headers if n == b"X-Accepted-Stream-Protocol-Versions"]
    assert accepted == [
        b"v4.channel.k8s.io",
        b"v3.channel.k8s.io",
        b"v2.channel.k8s.io",
        b"channel.k8s.io",
    ]
    assert result.body == (
        b"unable to upgrade: unable to negotiate protocol: client supports "
        b"[v9.channel.k8s.io], server accepts "
        b"[v4.channel.k8s.io v3.channel.k8s.io v2.channel.k8s.io channel.k8s.io]\n"
    )
    server = ServerHandshake()
    raw = crlf(
        "POST /x HTTP/1.1",
        "Host: h",
        "Content-Length: 0",
        "Connection: Upgrade",
        "Upgrade: SPDY/3.1",
        "X-Stream-Protocol-Version: v9.channel.k8s.io",
    )
    assert server.receive_data(raw) is not None
    out = server.reject(result)
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403 Forbidden\r\n")
    assert head.count(b"\r\nX-Accepted-Stream-Protocol-Versions: ") == 4
    assert f"\r\nContent-Length: {len(result.body)}".encode() in head
    assert body == result.body


def test_spdy_without_versions_is_400() -> None:
    headers = hdrs(("Connection", "Upgrade"), ("Upgrade", "SPDY/3.1"))
    result = negotiate("POST", headers, StreamKind.EXEC)
    assert isinstance(result, Rejected)
    assert result.status == 400
    assert result.message == "unable to upgrade: X-Stream-Protocol-Version is required"


# --- WebSocket --------------------------------------------------------------------------------


def test_kubectl_ws_exec_negotiates_v5() -> None:
    server, request = receive(KUBECTL_WS_EXEC + b"\x82\x85")
    result = negotiate(request.method, list(request.headers), StreamKind.EXEC)
    assert isinstance(result, Accepted)
    assert result.transport is Transport.WEBSOCKET
    assert result.protocol == "v5.channel.k8s.io"
    assert server.accept(result) == crlf(
        "HTTP/1.1 101 Switching Protocols",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Accept: {RFC_ACCEPT}",
        "Sec-WebSocket-Protocol: v5.channel.k8s.io",
    )
    assert server.trailing_data == b"\x82\x85"


def test_kubectl_ws_tunnel() -> None:
    result = negotiate_raw(KUBECTL_WS_TUNNEL, StreamKind.PORTFORWARD)
    assert isinstance(result, Accepted)
    assert result.transport is Transport.WEBSOCKET_TUNNEL
    assert result.protocol == "SPDY/3.1+portforward.k8s.io"
    assert result.inner_protocol == "portforward.k8s.io"
    assert (b"Sec-WebSocket-Protocol", b"SPDY/3.1+portforward.k8s.io") in result.response_headers


def test_tunnel_is_not_an_exec_protocol() -> None:
    result = negotiate_raw(KUBECTL_WS_TUNNEL, StreamKind.EXEC)
    assert isinstance(result, Rejected)
    assert result.status == 403
    # Upstream x/net answers a bare 403: no headers, no body.
    assert result.headers == ()
    assert result.body == b""


def test_python_client_portforward_gets_v4_and_exec_gets_v5() -> None:
    pf = negotiate_raw(
        python_client_request("/api/v1/namespaces/default/pods/nginx/portforward?ports=80"),
        StreamKind.PORTFORWARD,
    )
    assert isinstance(pf, Accepted)
    assert pf.transport is Transport.WEBSOCKET
    assert pf.protocol == "v4.channel.k8s.io"
    ex = negotiate_raw(
        python_client_request(
            "/api/v1/namespaces/default/pods/nginx/exec?command=ls&command=-l"
            "&stderr=true&stdin=false&stdout=true&tty=false"
        ),
        StreamKind.EXEC,
    )
    assert isinstance(ex, Accepted)
    assert ex.protocol == "v5.channel.k8s.io"
    assert (b"Sec-WebSocket-Accept", RFC_ACCEPT.encode()) in ex.response_headers


def test_python_client_query_params() -> None:
    _, request = receive(
        python_client_request(
            "/api/v1/namespaces/default/pods/nginx/exec?command=ls&command=-l&stderr=true"
        )
    )
    assert request.query_params() == [("command", "ls"), ("command", "-l"), ("stderr", "true")]
    assert request.header("Authorization") == "Bearer abc"


def ws_headers(*extra: tuple[str, str]) -> list[tuple[bytes, bytes]]:
    return hdrs(
        ("Host", "h"),
        ("Connection", "Upgrade"),
        ("Upgrade", "websocket"),
        ("Sec-WebSocket-Key", RFC_KEY),
        ("Sec-WebSocket-Version", "13"),
        *extra,
    )


def test_ws_without_subprotocol_chooses_empty_and_echoes_it() -> None:
    result = negotiate("GET", ws_headers(), StreamKind.EXEC)
    assert isinstance(result, Accepted)
    assert result.protocol == ""
    assert (b"Sec-WebSocket-Protocol", b"") in result.response_headers


def test_ws_reads_only_the_first_protocol_line() -> None:
    headers = ws_headers(
        ("Sec-WebSocket-Protocol", "v9.example.io"),
        ("Sec-WebSocket-Protocol", "v5.channel.k8s.io"),
    )
    result = negotiate("GET", headers, StreamKind.EXEC)
    assert isinstance(result, Rejected)
    assert result.status == 403


def test_ws_client_order_wins() -> None:
    headers = ws_headers(("Sec-WebSocket-Protocol", "base64.channel.k8s.io, v4.channel.k8s.io"))
    result = negotiate("GET", headers, StreamKind.ATTACH)
    assert isinstance(result, Accepted)
    assert result.protocol == "base64.channel.k8s.io"


def test_ws_plain_channel_name_is_not_a_portforward_protocol() -> None:
    headers = ws_headers(("Sec-WebSocket-Protocol", "channel.k8s.io"))
    assert isinstance(negotiate("GET", headers, StreamKind.PORTFORWARD), Rejected)
    assert isinstance(negotiate("GET", headers, StreamKind.EXEC), Accepted)


def test_ws_never_negotiates_extensions() -> None:
    headers = ws_headers(("Sec-WebSocket-Extensions", "permessage-deflate; client_max_window_bits"))
    result = negotiate("GET", headers, StreamKind.EXEC)
    assert isinstance(result, Accepted)
    assert all(n.lower() != b"sec-websocket-extensions" for n, _ in result.response_headers)


def test_ws_post_is_405() -> None:
    result = negotiate("POST", ws_headers(), StreamKind.EXEC)
    assert isinstance(result, Rejected)
    assert result.status == 405
    assert result.reason == "MethodNotAllowed"


@pytest.mark.parametrize(
    "headers",
    [
        hdrs(
            ("Upgrade", "websocket"),
            ("Sec-WebSocket-Key", RFC_KEY),
            ("Sec-WebSocket-Version", "13"),
        ),
        hdrs(("Connection", "Upgrade"), ("Upgrade", "websocket"), ("Sec-WebSocket-Version", "13")),
        hdrs(("Connection", "Upgrade"), ("Upgrade", "websocket"), ("Sec-WebSocket-Key", RFC_KEY)),
        hdrs(
            ("Connection", "Upgrade"),
            ("Upgrade", "websocket"),
            ("Sec-WebSocket-Key", RFC_KEY),
            ("Sec-WebSocket-Version", "8"),
        ),
    ],
    ids=["no-connection", "no-key", "no-version", "version-8"],
)
def test_ws_bad_handshake_is_400(headers: list[tuple[bytes, bytes]]) -> None:
    result = negotiate("GET", headers, StreamKind.EXEC)
    assert isinstance(result, Rejected)
    assert result.status == 400


def test_ws_bad_version_names_the_supported_one() -> None:
    headers = hdrs(
        ("Connection", "Upgrade"),
        ("Upgrade", "websocket"),
        ("Sec-WebSocket-Key", RFC_KEY),
        ("Sec-WebSocket-Version", "8"),
    )
    result = negotiate("GET", headers, StreamKind.EXEC)
    assert isinstance(result, Rejected)
    assert (b"Sec-WebSocket-Version", b"13") in result.headers


def test_ws_rejection_as_status_body() -> None:
    result = negotiate("GET", ws_headers(("Sec-WebSocket-Protocol", "v9")), StreamKind.EXEC)
    assert isinstance(result, Rejected)
    status = result.as_status()
    assert status.status == 403
    assert (b"Content-Type", b"application/json") in status.headers
    doc = json.loads(status.body)
    assert doc == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": result.message,
        "reason": "Forbidden",
        "code": 403,
    }


def test_no_upgrade_headers_is_400_status() -> None:
    result = negotiate("GET", hdrs(("Host", "h")), StreamKind.EXEC)
    assert isinstance(result, Rejected)
    assert result.status == 400
    assert result.body == (
        b'{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",'
        b'"message":"unable to upgrade: missing upgrade headers in request",'
        b'"reason":"BadRequest","code":400}'
    )
    # SPDY in Upgrade but no Connection: upgrade counts as missing too.
    spdy_only = negotiate("POST", hdrs(("Upgrade", "SPDY/3.1")), StreamKind.EXEC)
    assert isinstance(spdy_only, Rejected)
    assert spdy_only.status == 400


def test_status_body_field_order() -> None:
    # kubectl-api-surface.md section 4.4 shows this key order.
    assert status_body(404, "NotFound", 'pods "missing-pod" not found') == (
        b'{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",'
        b'"message":"pods \\"missing-pod\\" not found","reason":"NotFound","code":404}'
    )


# --- the server handshake as an HTTP/1.1 server -----------------------------------------------


def test_trailing_data_after_spdy_request() -> None:
    syn_start = b"\x80\x03\x00\x01\x00\x00\x00\x2a"
    server = ServerHandshake()
    request = server.receive_data(KUBECTL_SPDY_EXEC + syn_start[:3])
    assert request is not None
    # More bytes may arrive before the driver answers; they are kept too.
    assert server.receive_data(syn_start[3:]) is None
    accepted = negotiate(request.method, list(request.headers), StreamKind.EXEC)
    assert isinstance(accepted, Accepted)
    server.accept(accepted)
    assert server.trailing_data == syn_start
    with pytest.raises(LocalProtocolError):
        server.receive_data(b"more")


def test_plain_gets_share_one_connection() -> None:
    server = ServerHandshake()
    first = crlf(
        "GET /api?timeout=32s HTTP/1.1", "Host: 127.0.0.1:6443", "Accept: application/json"
    )
    second = crlf("GET /apis?timeout=32s HTTP/1.1", "Host: 127.0.0.1:6443")
    request = server.receive_data(first + second)
    assert request is not None
    assert request.target == "/api?timeout=32s"
    assert not request.is_upgrade
    out = server.respond(200, [("Content-Type", "application/json")], b'{"kind":"APIVersions"}')
    assert out == (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 22\r\n\r\n"
        b'{"kind":"APIVersions"}'
    )
    assert server.state is ServerState.RECEIVING
    assert not server.must_close
    request = server.receive_data(b"")
    assert request is not None
    assert request.target == "/apis?timeout=32s"
    server.respond(404, [], b"")
    assert server.state is ServerState.RECEIVING
    # A third request, fed later, still works.
    assert server.receive_data(crlf("GET /api/v1 HTTP/1.1", "Host: h")) is not None


def test_rejected_upgrade_keeps_the_connection() -> None:
    server = ServerHandshake()
    request = server.receive_data(KUBECTL_WS_EXEC)
    assert request is not None
    rejected = negotiate(request.method, list(request.headers), StreamKind.PORTFORWARD)
    assert isinstance(rejected, Rejected)
    server.reject(rejected.as_status())
    assert server.state is ServerState.RECEIVING
    assert server.receive_data(KUBECTL_SPDY_EXEC) is not None


def test_connection_close_request_must_close() -> None:
    server = ServerHandshake()
    assert server.receive_data(crlf("GET /api HTTP/1.1", "Host: h", "Connection: close"))
    out = server.respond(200, [], b"{}")
    assert b"\r\nConnection: close\r\n" in out
    assert server.must_close
    with pytest.raises(LocalProtocolError):
        server.respond(200, [], b"{}")


def test_post_body_is_collected() -> None:
    server = ServerHandshake()
    raw = crlf("POST /x HTTP/1.1", "Host: h", "Content-Length: 5") + b"hello"
    request = server.receive_data(raw[:-2])
    assert request is None
    request = server.receive_data(raw[-2:])
    assert request is not None
    assert request.body == b"hello"


def test_oversized_head_is_431_and_closes() -> None:
    server = ServerHandshake()
    with pytest.raises(HandshakeError) as info:
        server.receive_data(b"GET /" + b"a" * (MAX_HEAD_BYTES + 1))
    assert info.value.status == 431
    assert isinstance(info.value, RemoteProtocolError)
    out = server.respond(431, [], b"")
    assert out.startswith(b"HTTP/1.1 431 ")
    assert b"\r\nConnection: close\r\n" in out
    assert server.must_close


def test_garbage_head_is_400() -> None:
    with pytest.raises(HandshakeError) as info:
        ServerHandshake().receive_data(b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n")
    assert info.value.status == 400


def test_eof_mid_request_raises_and_eof_between_requests_closes() -> None:
    server = ServerHandshake()
    server.receive_data(b"GET /api HTTP/1.1\r\nHo")
    with pytest.raises(HandshakeError):
        server.receive_eof()
    idle = ServerHandshake()
    idle.receive_eof()
    assert idle.state is ServerState.CLOSED


def test_accept_requires_an_upgrade_request() -> None:
    server, _ = receive(crlf("GET /api HTTP/1.1", "Host: h"))
    accepted = negotiate("GET", ws_headers(), StreamKind.EXEC)
    assert isinstance(accepted, Accepted)
    with pytest.raises(LocalProtocolError):
        server.accept(accepted)


@settings(max_examples=100, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=len(KUBECTL_SPDY_EXEC) + 8), max_size=12))
def test_random_splits_give_the_same_request(cuts: list[int]) -> None:
    tail = b"\x80\x03\x00\x01\x01\x00\x00\x10"
    raw = KUBECTL_SPDY_EXEC + tail
    points = sorted({0, len(raw), *cuts})
    server = ServerHandshake()
    found: list[UpgradeRequest] = []
    for start, end in itertools.pairwise(points):
        request = server.receive_data(raw[start:end])
        if request is not None:
            found.append(request)
    assert len(found) == 1
    _, expected = receive(KUBECTL_SPDY_EXEC)
    assert found[0] == expected
    accepted = negotiate(found[0].method, list(found[0].headers), StreamKind.EXEC)
    assert isinstance(accepted, Accepted)
    server.accept(accepted)
    assert server.trailing_data == tail


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=300))
def test_garbage_heads_raise_only_protocol_errors(data: bytes) -> None:
    server = ServerHandshake()
    try:
        server.receive_data(data)
        server.receive_eof()
    except ProtocolError:
        pass


# --- client handshake <-> server handshake ------------------------------------------------------


def test_build_spdy_request_has_one_line_per_protocol() -> None:
    raw = build_spdy_request(
        "POST",
        "/api/v1/namespaces/default/pods/nginx/exec?command=cat&stdout=true",
        "127.0.0.1:6443",
        ["v5.channel.k8s.io", *REMOTECOMMAND_SPDY_PROTOCOLS],
        [("Kubectl-Command", "kubectl exec")],
    )
    assert raw.startswith(
        b"POST /api/v1/namespaces/default/pods/nginx/exec?command=cat&stdout=true HTTP/1.1\r\n"
    )
    assert raw.count(b"\r\nX-Stream-Protocol-Version: ") == 5
    assert b"\r\nContent-Length: 0\r\n" in raw
    _, request = receive(raw)
    assert request.header("kubectl-command") == "kubectl exec"
    result = negotiate(request.method, list(request.headers), StreamKind.EXEC)
    assert isinstance(result, Accepted)
    assert result.protocol == "v4.channel.k8s.io"


def test_build_ws_request_is_what_the_server_expects() -> None:
    raw = build_ws_request("/pf?ports=80", "h", ["v5.channel.k8s.io", "v4.channel.k8s.io"], RFC_KEY)
    _, request = receive(raw)
    assert request.method == "GET"
    assert request.header("sec-websocket-protocol") == "v5.channel.k8s.io,v4.channel.k8s.io"
    result = negotiate(request.method, list(request.headers), StreamKind.PORTFORWARD)
    assert isinstance(result, Accepted)
    assert result.protocol == "v4.channel.k8s.io"


def test_ws_key_must_be_16_bytes_of_base64() -> None:
    with pytest.raises(LocalProtocolError):
        build_ws_request("/", "h", [], "c2hvcnQ=")


def round_trip(
    client: ClientHandshake, raw_request: bytes, kind: StreamKind, after: bytes = b""
) -> tuple[UpgradeResponse, bytes]:
    server, request = receive(raw_request)
    decision = negotiate(request.method, list(request.headers), kind)
    if isinstance(decision, Accepted):
        answer = server.accept(decision)
    else:
        answer = server.reject(decision.as_status())
    response = None
    rest = b""
    for i in range(len(answer + after)):
        # Byte by byte: the client must cope with any split.
        response = client.receive_data((answer + after)[i : i + 1]) or response
        if response is not None:
            rest = (answer + after)[i + 1 :]
            break
    assert response is not None
    return response, rest


def test_spdy_client_server_in_memory() -> None:
    client = ClientHandshake()
    raw = client.spdy_request(
        "POST", "/api/v1/namespaces/default/pods/nginx/portforward", "h", ["portforward.k8s.io"]
    )
    frame = b"\x80\x03\x00\x06\x00\x00\x00\x04\x00\x00\x00\x01"
    response, rest = round_trip(client, raw, StreamKind.PORTFORWARD, after=frame)
    assert response.upgraded
    assert response.status == 101
    assert response.protocol == "portforward.k8s.io"
    # The byte-by-byte feed stopped at the end of the head; the rest is the next protocol's.
    assert client.trailing_data + rest == frame


def test_ws_client_server_in_memory() -> None:
    client = ClientHandshake()
    raw = client.ws_request(
        "/api/v1/namespaces/default/pods/nginx/exec?command=sh&stdout=true",
        "h",
        ["v5.channel.k8s.io"],
        RFC_KEY,
    )
    response, _ = round_trip(client, raw, StreamKind.EXEC)
    assert response.upgraded
    assert response.protocol == "v5.channel.k8s.io"
    assert response.header("sec-websocket-accept") == RFC_ACCEPT
    response.raise_for_error()


def test_ws_client_sees_rejection_as_status_error() -> None:
    client = ClientHandshake()
    raw = client.ws_request("/pf", "h", ["SPDY/3.1+portforward.k8s.io"], RFC_KEY)
    response, _ = round_trip(client, raw, StreamKind.EXEC)
    assert not response.upgraded
    assert response.status == 403
    assert response.error is not None
    assert response.error.startswith(
        "Error from server (Forbidden): requested protocol(s) are not supported"
    )
    with pytest.raises(UpgradeFailedError) as info:
        response.raise_for_error()
    assert info.value.status == 403


def test_client_text_error_body() -> None:
    client = ClientHandshake()
    client.spdy_request("POST", "/x", "h", ["v4.channel.k8s.io"])
    body = b"unable to upgrade: something\n"
    raw = (
        b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    response = client.receive_data(raw)
    assert response is not None
    assert response.error == "unable to upgrade connection: unable to upgrade: something"
    assert response.body == body
    with pytest.raises(LocalProtocolError):
        _ = client.trailing_data


def test_client_101_without_subprotocol_is_an_upgrade_failure() -> None:
    # kubectl-api-surface.md section 1.3: this makes kubectl fall back to SPDY.
    client = ClientHandshake()
    client.ws_request("/x", "h", ["v5.channel.k8s.io"], RFC_KEY)
    response = client.receive_data(
        crlf(
            "HTTP/1.1 101 Switching Protocols",
            "Upgrade: websocket",
            "Connection: Upgrade",
            f"Sec-WebSocket-Accept: {RFC_ACCEPT}",
        )
    )
    assert response is not None
    assert response.status == 101
    assert not response.upgraded
    assert response.error is not None
    assert "invalid protocol" in response.error


def test_client_bad_accept_is_an_upgrade_failure() -> None:
    client = ClientHandshake()
    client.ws_request("/x", "h", ["v5.channel.k8s.io"], RFC_KEY)
    response = client.receive_data(
        crlf(
            "HTTP/1.1 101 Switching Protocols",
            "Upgrade: websocket",
            "Connection: Upgrade",
            "Sec-WebSocket-Accept: AAAAAAAAAAAAAAAAAAAAAAAAAAA=",
            "Sec-WebSocket-Protocol: v5.channel.k8s.io",
        )
    )
    assert response is not None
    assert not response.upgraded


def test_spdy_client_tolerates_missing_version_header() -> None:
    client = ClientHandshake()
    client.spdy_request("POST", "/x", "h", ["portforward.k8s.io"])
    response = client.receive_data(
        crlf("HTTP/1.1 101 Switching Protocols", "Connection: Upgrade", "Upgrade: SPDY/3.1")
    )
    assert response is not None
    assert response.upgraded
    assert response.protocol is None


def test_client_eof_before_response() -> None:
    client = ClientHandshake()
    client.spdy_request("POST", "/x", "h", ["portforward.k8s.io"])
    client.receive_data(b"HTTP/1.1 10")
    # Not an upgrade failure: kubectl reports "unexpected EOF" and does not fall back.
    with pytest.raises(RemoteProtocolError) as info:
        client.receive_eof()
    assert not isinstance(info.value, UpgradeFailedError)


def test_client_parses_a_response_to_a_request_built_elsewhere() -> None:
    raw = build_ws_request("/x", "h", ["v5.channel.k8s.io"], RFC_KEY)
    response, _ = round_trip(ClientHandshake(ws_key=RFC_KEY), raw, StreamKind.EXEC)
    assert response.upgraded
    assert response.protocol == "v5.channel.k8s.io"
    raw = build_spdy_request("POST", "/x", "h", ["portforward.k8s.io"])
    response, _ = round_trip(ClientHandshake(), raw, StreamKind.PORTFORWARD)
    assert response.upgraded
    assert response.protocol == "portforward.k8s.io"
    # The Accept check still applies without the offered list.
    wrong = ClientHandshake(ws_key="AAAAAAAAAAAAAAAAAAAAAA==")
    response, _ = round_trip(wrong, build_ws_request("/x", "h", [], RFC_KEY), StreamKind.EXEC)
    assert not response.upgraded


def test_a_server_without_websocket_protocols_refuses_every_websocket_upgrade() -> None:
    # An empty list is "none", not "the defaults": the clean way to force kubectl onto SPDY.
    _, request = receive(KUBECTL_WS_EXEC)
    result = negotiate(request.method, list(request.headers), StreamKind.EXEC, ws_protocols=())
    assert isinstance(result, Rejected)
    assert result.status == 403


def test_oversized_body_is_413_and_closes() -> None:
    server = ServerHandshake(max_body_bytes=4)
    with pytest.raises(HandshakeError) as info:
        server.receive_data(crlf("POST /x HTTP/1.1", "Host: h", "Content-Length: 9") + b"123456789")
    assert info.value.status == 413
    with pytest.raises(LocalProtocolError):
        server.receive_data(b"more")
    out = server.respond(413, [], b"")
    assert out.startswith(b"HTTP/1.1 413 ")
    assert b"\r\nConnection: close\r\n" in out
    assert server.must_close
