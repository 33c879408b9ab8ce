"""Port-forward stream pairing and helpers (k8s-streaming.md §3, §5.6; api-surface §6.3)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podgate.proto.errors import LocalProtocolError
from podgate.proto.k8s import StatusError
from podgate.proto.portforward import (
    MAX_PENDING_PAIRS,
    MAX_PORTS_PER_REQUEST,
    PORTFORWARD_PROTOCOL,
    STREAM_CREATION_TIMEOUT,
    Duplicate,
    Expired,
    Pair,
    Pending,
    PortForwardPairing,
    PortForwardRequestIds,
    Rejected,
    StreamType,
    forward_error_message,
    parse_ports,
    stream_headers,
    websocket_channels,
    websocket_port_prefix,
)
from podgate.proto.remotecommand import parse_query


def _headers(stream_type: str, port: str = "80", request_id: str | None = "0") -> dict[str, str]:
    headers = {"streamtype": stream_type, "port": port}
    if request_id is not None:
        headers["requestid"] = request_id
    return headers


def test_constants() -> None:
    assert PORTFORWARD_PROTOCOL == "portforward.k8s.io"
    assert STREAM_CREATION_TIMEOUT == 30.0


def test_kubectl_sequence_pairs() -> None:
    # kubectl: error on sid 1 with requestid "0", then data on sid 3.
    pairing = PortForwardPairing("c1")
    assert pairing.add_stream(1, _headers("error"), now=0.0) == Pending("0", 1, StreamType.ERROR)
    assert len(pairing) == 1
    assert pairing.add_stream(3, _headers("data"), now=0.5) == Pair("0", 80, 1, 3)
    assert len(pairing) == 0
    assert pairing.next_deadline() is None


def test_header_names_fold_case_and_order_does_not_matter() -> None:
    pairing = PortForwardPairing("c1")
    headers = {"requestID": "7", "Port": "8080", "streamType": "error"}
    assert pairing.add_stream(1, headers, now=0.0) == Pending("7", 1, StreamType.ERROR)
    assert pairing.add_stream(3, _headers("data", "8080", "7"), now=0.0) == Pair("7", 8080, 1, 3)


def test_concurrent_requests_interleave() -> None:
    pairing = PortForwardPairing("c1")
    assert isinstance(pairing.add_stream(1, _headers("error", "80", "0"), 0.0), Pending)
    assert isinstance(pairing.add_stream(3, _headers("error", "443", "1"), 0.0), Pending)
    assert pairing.add_stream(5, _headers("data", "443", "1"), 0.0) == Pair("1", 443, 3, 5)
    assert pairing.add_stream(7, _headers("data", "80", "0"), 0.0) == Pair("0", 80, 1, 7)


def test_any_string_request_id_and_data_first() -> None:
    # krelay uses random strings; order within a pair is not enforced by the server.
    pairing = PortForwardPairing("c1")
    rid = "f3b1-x"
    assert pairing.add_stream(1, _headers("data", "9000", rid), 0.0) == Pending(
        rid, 1, StreamType.DATA
    )
    assert pairing.add_stream(3, _headers("error", "9000", rid), 0.0) == Pair(rid, 9000, 3, 1)


def test_port_comes_from_the_data_stream() -> None:
    pairing = PortForwardPairing("c1")
    pairing.add_stream(1, _headers("error", "1"), 0.0)
    assert pairing.add_stream(3, _headers("data", "2"), 0.0) == Pair("0", 2, 1, 3)


def test_missing_request_id_uses_pseudo_ids() -> None:
    pairing = PortForwardPairing("c1")
    assert pairing.add_stream(5, _headers("error", request_id=None), 0.0) == Pending(
        "5", 5, StreamType.ERROR
    )
    assert pairing.add_stream(7, _headers("data", request_id=None), 0.0) == Pair("5", 80, 5, 7)
    # An empty requestid counts as missing.
    assert pairing.add_stream(9, _headers("data", request_id=""), 0.0) == Pending(
        "7", 9, StreamType.DATA
    )


def test_duplicate_error_stream() -> None:
    pairing = PortForwardPairing("c1")
    pairing.add_stream(1, _headers("error"), 0.0)
    assert pairing.add_stream(3, _headers("error"), 0.0) == Duplicate(
        "0",
        3,
        StreamType.ERROR,
        1,
        "error processing stream for request 0: error stream already assigned",
    )
    # The pending pair keeps its first error stream.
    assert pairing.add_stream(5, _headers("data"), 0.0) == Pair("0", 80, 1, 5)


def test_duplicate_data_stream_without_error_stream() -> None:
    pairing = PortForwardPairing("c1")
    pairing.add_stream(1, _headers("data"), 0.0)
    assert pairing.add_stream(3, _headers("data"), 0.0) == Duplicate(
        "0",
        3,
        StreamType.DATA,
        None,
        "error processing stream for request 0: data stream already assigned",
    )


def test_completed_request_id_starts_a_new_pair() -> None:
    pairing = PortForwardPairing("c1")
    pairing.add_stream(1, _headers("error"), 0.0)
    pairing.add_stream(3, _headers("data"), 0.0)
    assert pairing.add_stream(5, _headers("error"), 1.0) == Pending("0", 5, StreamType.ERROR)


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ({"streamtype": "error", "requestid": "0"}, '"port" header is required'),
        ({"streamtype": "error", "port": ""}, '"port" header is required'),
        (
            _headers("error", "http"),
            'unable to parse "http" as a port: strconv.ParseUint: parsing "http": invalid syntax',
        ),
        (
            _headers("error", "-1"),
            'unable to parse "-1" as a port: strconv.ParseUint: parsing "-1": invalid syntax',
        ),
        (
            _headers("error", "+80"),
            'unable to parse "+80" as a port: strconv.ParseUint: parsing "+80": invalid syntax',
        ),
        (
            _headers("error", "65536"),
            'unable to parse "65536" as a port: '
            'strconv.ParseUint: parsing "65536": value out of range',
        ),
        (_headers("error", "0"), 'port "0" must be > 0'),
        ({"port": "80", "requestid": "0"}, '"streamType" header is required'),
        (_headers("stdout"), 'invalid stream type "stdout"'),
        (_headers("Error"), 'invalid stream type "Error"'),
    ],
)
def test_invalid_streams_are_rejected(headers: dict[str, str], reason: str) -> None:
    pairing = PortForwardPairing("c1")
    assert pairing.add_stream(1, headers, 0.0) == Rejected(1, reason)
    assert len(pairing) == 0


@pytest.mark.parametrize(("text", "port"), [("1", 1), ("080", 80), ("65535", 65535)])
def test_valid_ports(text: str, port: int) -> None:
    pairing = PortForwardPairing("c1")
    pairing.add_stream(1, _headers("error", text), 0.0)
    assert pairing.add_stream(3, _headers("data", text), 0.0) == Pair("0", port, 1, 3)


def test_timeout_after_30_seconds_from_first_stream() -> None:
    pairing = PortForwardPairing("conn-7")
    pairing.add_stream(1, _headers("error", request_id="0"), now=10.0)
    pairing.add_stream(3, _headers("data", request_id="1"), now=20.0)
    assert pairing.next_deadline() == 40.0
    assert pairing.expire(39.999) == []
    assert pairing.expire(40.0) == [
        Expired("0", 1, "(conn=conn-7, request=0) timed out waiting for streams")
    ]
    assert pairing.next_deadline() == 50.0
    assert pairing.expire(50.0) == [
        Expired("1", None, "(conn=conn-7, request=1) timed out waiting for streams")
    ]
    assert len(pairing) == 0
    # The late partner starts a fresh pair rather than completing the expired one.
    assert pairing.add_stream(5, _headers("data", request_id="0"), 51.0) == Pending(
        "0", 5, StreamType.DATA
    )


def test_completed_pairs_never_expire() -> None:
    pairing = PortForwardPairing("c1")
    pairing.add_stream(1, _headers("error"), 0.0)
    pairing.add_stream(3, _headers("data"), 29.0)
    assert pairing.expire(1000.0) == []


def test_remove() -> None:
    pairing = PortForwardPairing("c1")
    pairing.add_stream(1, _headers("error"), 0.0)
    assert pairing.remove("0") is True
    assert pairing.remove("0") is False
    assert pairing.add_stream(3, _headers("data"), 0.0) == Pending("0", 3, StreamType.DATA)


def test_pending_pairs_are_bounded() -> None:
    pairing = PortForwardPairing("c1")
    for i in range(MAX_PENDING_PAIRS):
        assert isinstance(
            pairing.add_stream(1 + 2 * i, _headers("error", "80", str(i)), 0.0), Pending
        )
    sid = 1 + 2 * MAX_PENDING_PAIRS
    result = pairing.add_stream(sid, _headers("error", "80", "new"), 0.0)
    assert isinstance(result, Rejected)
    assert "too many" in result.reason
    # Streams joining an existing pair are still accepted.
    assert pairing.add_stream(sid + 2, _headers("data", "80", "5"), 0.0) == Pair(
        "5", 80, 11, sid + 2
    )
    assert isinstance(pairing.add_stream(sid + 4, _headers("error", "80", "new"), 0.0), Pending)


def test_forward_error_message() -> None:
    # k8s-streaming.md §3 and §5.6.
    assert forward_error_message(80, "abc123", "u-1", "connection refused") == (
        "error forwarding port 80 to pod abc123, uid u-1: connection refused"
    )


@settings(max_examples=100, deadline=None)
@given(data=st.data(), count=st.integers(1, 8))
def test_any_interleaving_of_kubectl_pairs(data: st.DataObject, count: int) -> None:
    # Each request opens error then data; requests interleave arbitrarily.
    queues = {str(i): ["error", "data"] for i in range(count)}
    order: list[str] = []
    while queues:
        rid = data.draw(st.sampled_from(sorted(queues)))
        order.append(rid)
        queues[rid].pop(0)
        if not queues[rid]:
            del queues[rid]
    pairing = PortForwardPairing("c1")
    opened: dict[str, int] = {}
    pairs: list[Pair] = []
    for n, rid in enumerate(order):
        sid = 1 + 2 * n
        kind = "data" if rid in opened else "error"
        result = pairing.add_stream(sid, _headers(kind, str(1000 + int(rid)), rid), float(n))
        if kind == "error":
            opened[rid] = sid
            assert result == Pending(rid, sid, StreamType.ERROR)
        else:
            assert result == Pair(rid, 1000 + int(rid), opened[rid], sid)
            pairs.append(result)
    assert sorted(p.request_id for p in pairs) == sorted(str(i) for i in range(count))
    assert len(pairing) == 0


# --- client side ------------------------------------------------------------------------------


def test_request_ids_count_from_zero() -> None:
    ids = PortForwardRequestIds()
    assert [next(ids) for _ in range(2)] == ["0", "1"]
    assert [ids.next() for _ in range(2)] == ["2", "3"]


def test_stream_headers_as_kubectl() -> None:
    # kubectl-api-surface.md §6.3.
    assert stream_headers("error", 80, "0") == {
        "streamtype": "error",
        "port": "80",
        "requestid": "0",
    }
    assert stream_headers(StreamType.DATA, 80, "0") == {
        "streamtype": "data",
        "port": "80",
        "requestid": "0",
    }


@pytest.mark.parametrize(("kind", "port"), [("error", 0), ("data", 65536), ("stdout", 80)])
def test_stream_headers_refuse_bad_input(kind: str, port: int) -> None:
    with pytest.raises((LocalProtocolError, ValueError)):
        stream_headers(kind, port, "0")


def test_client_headers_pair_on_the_server() -> None:
    ids = PortForwardRequestIds()
    pairing = PortForwardPairing("c1")
    rid = next(ids)
    pairing.add_stream(1, stream_headers("error", 8080, rid), 0.0)
    assert pairing.add_stream(3, stream_headers("data", 8080, rid), 0.0) == Pair(rid, 8080, 1, 3)


# --- WebSocket layout (k8s-streaming.md §5.6, kubectl-api-surface.md §10) ---------------------


def test_websocket_layout() -> None:
    assert websocket_channels(0) == (0, 1)
    assert websocket_channels(1) == (2, 3)
    # Port 80 as the first message on both channels: "00 50 00" and "01 50 00".
    data_ch, err_ch = websocket_channels(0)
    assert bytes([data_ch]) + websocket_port_prefix(80) == bytes.fromhex("005000")
    assert bytes([err_ch]) + websocket_port_prefix(80) == bytes.fromhex("015000")
    assert websocket_port_prefix(8080) == b"\x90\x1f"


@pytest.mark.parametrize(
    ("query", "ports"),
    [("ports=80&ports=8080", (80, 8080)), ("ports=80,8080", (80, 8080)), ("ports=80", (80,))],
)
def test_parse_ports(query: str, ports: tuple[int, ...]) -> None:
    assert parse_ports(parse_query(query)) == ports


def test_parse_ports_bounds_the_list() -> None:
    most = ",".join(str(1000 + i) for i in range(MAX_PORTS_PER_REQUEST))
    assert len(parse_ports(parse_query(f"ports={most}"))) == MAX_PORTS_PER_REQUEST
    with pytest.raises(StatusError, match="at most"):
        parse_ports(parse_query(f"ports={most}&ports=9"))
    # A huge list is refused without parsing all of it.
    with pytest.raises(StatusError, match="at most"):
        parse_ports(parse_query("ports=" + ",".join(["80"] * 100_000)))


def test_parse_ports_kubelet_name() -> None:
    assert parse_ports(parse_query("port=80,8080"), name="port") == (80, 8080)


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("", 'query parameter "ports" is required'),
        ("ports=", 'query parameter "ports" cannot be empty'),
        ("ports=0", 'port "0" must be > 0'),
        ("ports=80,x", 'unable to parse "x" as a port'),
    ],
)
def test_parse_ports_errors(query: str, message: str) -> None:
    with pytest.raises(StatusError) as info:
        parse_ports(parse_query(query))
    assert info.value.code == 400
    assert info.value.message.startswith(message)
