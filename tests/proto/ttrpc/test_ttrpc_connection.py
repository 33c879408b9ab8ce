"""The ttrpc connection core: client and server cores talking in memory, stream-level faults
answered with the Go server's exact statuses, connection-level faults, and API misuse."""

from __future__ import annotations

import itertools

import pytest

from podgate.proto.errors import LocalProtocolError, RemoteProtocolError
from podgate.proto.ttrpc import (
    CLIENT_TRANSITIONS,
    MAX_MESSAGE_LENGTH,
    MAX_STREAM_ID,
    SERVER_TRANSITIONS,
    Code,
    ConnectionClosed,
    DataReceived,
    Event,
    OversizedMessageError,
    RequestMode,
    RequestReceived,
    ResponseReceived,
    Role,
    StreamAborted,
    StreamClosedError,
    StreamState,
    TtrpcConnection,
    TtrpcConnectionError,
    envelope_pb2,
    status_pb2,
)
from podgate.proto.ttrpc.connection import Reaction, StreamInput

OVERSIZE_MESSAGE = "message length {} exceed maximum message size of 4194304"


# --- helpers: frames written by hand, so the core is checked against independent bytes
def header(length: int, stream_id: int, kind: int, flags: int = 0) -> bytes:
    return length.to_bytes(4, "big") + stream_id.to_bytes(4, "big") + bytes([kind]) + bytes([flags])


def raw_request(stream_id: int, service: str = "svc", method: str = "m", flags: int = 0) -> bytes:
    body = envelope_pb2.Request(service=service, method=method, payload=b"p").SerializeToString()
    return header(len(body), stream_id, 1, flags) + body


def raw_data(stream_id: int, body: bytes = b"", flags: int = 0) -> bytes:
    return header(len(body), stream_id, 3, flags) + body


def error_response(stream_id: int, code: int, message: str) -> bytes:
    body = envelope_pb2.Response(
        status=status_pb2.Status(code=code, message=message)
    ).SerializeToString()
    return header(len(body), stream_id, 2) + body


def pair() -> tuple[TtrpcConnection, TtrpcConnection]:
    return TtrpcConnection(Role.CLIENT), TtrpcConnection(Role.SERVER)


def to_server(client: TtrpcConnection, server: TtrpcConnection) -> list[Event]:
    return server.receive_data(client.data_to_send())


def to_client(server: TtrpcConnection, client: TtrpcConnection) -> list[Event]:
    return client.receive_data(server.data_to_send())


# --- client core <-> server core
def test_unary_round_trip() -> None:
    client, server = pair()
    sid = client.send_request(
        "pkg.Svc", "Do", b"req", timeout_nano=123, metadata=[("X-Trace", "a"), ("k", "v")]
    )
    assert to_server(client, server) == [
        RequestReceived(
            sid, "pkg.Svc", "Do", b"req", 123, (("x-trace", "a"), ("k", "v")), RequestMode.UNARY
        )
    ]
    server.send_response(sid, b"reply")
    assert to_client(server, client) == [ResponseReceived(sid, 0, "", b"reply")]
    assert client.open_streams == frozenset()
    assert server.open_streams == frozenset()


def test_stream_ids_are_odd_and_increase_by_two() -> None:
    client = TtrpcConnection(Role.CLIENT)
    assert [client.send_request("s", "m") for _ in range(4)] == [1, 3, 5, 7]


def test_concurrent_calls_answered_out_of_order() -> None:
    client, server = pair()
    ids = [client.send_request("s", "m", bytes([i])) for i in range(3)]
    received = to_server(client, server)
    assert [e.stream_id for e in received if isinstance(e, RequestReceived)] == ids
    for sid in reversed(ids):
        server.send_response(sid, b"r%d" % sid)
    events = to_client(server, client)
    assert events == [ResponseReceived(sid, 0, "", b"r%d" % sid) for sid in reversed(ids)]


def test_error_status_round_trip() -> None:
    client, server = pair()
    sid = client.send_request("s", "m")
    to_server(client, server)
    server.send_response(sid, code=Code.NOT_FOUND, message="no such pod")
    assert to_client(server, client) == [ResponseReceived(sid, 5, "no such pod", b"")]


def test_server_streaming_round_trip() -> None:
    client, server = pair()
    sid = client.send_request("s", "Watch", mode=RequestMode.SERVER_STREAMING)
    [request] = to_server(client, server)
    assert isinstance(request, RequestReceived)
    assert request.mode is RequestMode.SERVER_STREAMING
    server.send_data(sid, b"one")
    server.send_data(sid, b"")
    server.send_data(sid, None, end=True)
    assert to_client(server, client) == [
        DataReceived(sid, b"one"),
        DataReceived(sid, b""),
        DataReceived(sid, None, end=True),
    ]
    assert client.open_streams == frozenset()
    assert server.open_streams == frozenset()


def test_client_streaming_round_trip() -> None:
    client, server = pair()
    sid = client.send_request("s", "Upload", mode=RequestMode.CLIENT_STREAMING)
    client.send_data(sid, b"a")
    client.send_data(sid, b"b", end=True)
    events = to_server(client, server)
    assert events[1:] == [
        DataReceived(sid, b"a"),
        DataReceived(sid, b"b"),
        DataReceived(sid, None, end=True),
    ]
    assert server.stream_state(sid) is StreamState.HALF_CLOSED_REMOTE
    server.send_response(sid, b"done")
    assert to_client(server, client) == [ResponseReceived(sid, 0, "", b"done")]


def test_client_sees_server_close_with_payload() -> None:
    client, server = pair()
    sid = client.send_request("s", "m", mode=RequestMode.SERVER_STREAMING)
    to_server(client, server)
    server.send_data(sid, b"final", end=True)
    assert to_client(server, client) == [DataReceived(sid, b"final", end=True)]
    assert client.open_streams == frozenset()


# --- stream-level faults on the server: the Go server's exact statuses
def test_even_stream_id_is_invalid_argument() -> None:
    server = TtrpcConnection(Role.SERVER)
    assert server.receive_data(raw_request(2)) == []
    assert server.data_to_send() == error_response(
        2, 3, "StreamID must be odd for client initiated streams"
    )
    # The connection goes on.
    assert [type(e) for e in server.receive_data(raw_request(1))] == [RequestReceived]


def test_even_stream_id_on_data_frame_too() -> None:
    server = TtrpcConnection(Role.SERVER)
    assert server.receive_data(raw_data(0, b"x")) == []
    assert server.data_to_send() == error_response(
        0, 3, "StreamID must be odd for client initiated streams"
    )


@pytest.mark.parametrize("second", [1, 3])
def test_stream_id_must_increase(second: int) -> None:
    server = TtrpcConnection(Role.SERVER)
    server.receive_data(raw_request(3))
    server.send_response(3)
    server.data_to_send()
    assert server.receive_data(raw_request(second)) == []
    assert server.data_to_send() == error_response(
        second, 3, "StreamID cannot be re-used and must increment"
    )


def test_reusing_a_live_stream_id_aborts_it() -> None:
    server = TtrpcConnection(Role.SERVER)
    server.receive_data(raw_request(1))
    message = "StreamID cannot be re-used and must increment"
    assert server.receive_data(raw_request(1)) == [StreamAborted(1, 3, message)]
    assert server.data_to_send() == error_response(1, 3, message)
    with pytest.raises(StreamClosedError) as info:
        server.send_response(1, b"late")
    assert info.value.stream_id == 1


def test_malformed_request_envelope_costs_only_its_stream() -> None:
    server = TtrpcConnection(Role.SERVER)
    garbage = b"\x0a\x10short"
    events = server.receive_data(header(len(garbage), 1, 1) + garbage + raw_request(3))
    assert [(type(e), e.stream_id) for e in events] == [(RequestReceived, 3)]  # type: ignore[attr-defined]
    reply = envelope_pb2.Response.FromString(server.data_to_send()[10:])
    assert reply.status.code == 3
    assert reply.status.message.startswith("unmarshal request error: ")


def test_oversized_request_is_discarded_in_pieces_and_answered() -> None:
    server = TtrpcConnection(Role.SERVER)
    size = 5 * 1024 * 1024
    assert server.receive_data(header(size, 1, 1)) == []
    body = bytes(size)
    for offset in range(0, size - 1000, 256 * 1024):
        assert server.receive_data(body[offset : min(offset + 256 * 1024, size - 1000)]) == []
        assert server.data_to_send() == b""  # answered only once the body is gone
    # The end of the oversized body and a normal request arrive together.
    events = server.receive_data(body[size - 1000 :] + raw_request(3))
    assert [type(e) for e in events] == [RequestReceived]
    assert server.data_to_send() == error_response(1, 8, OVERSIZE_MESSAGE.format(size))


def test_message_of_exactly_the_limit_is_accepted() -> None:
    client, server = pair()
    sid = client.send_request("s", "m", mode=RequestMode.CLIENT_STREAMING)
    to_server(client, server)
    events = server.receive_data(raw_data(sid, bytes(MAX_MESSAGE_LENGTH)))
    assert events == [DataReceived(sid, bytes(MAX_MESSAGE_LENGTH))]
    assert server.data_to_send() == b""


def test_oversized_data_on_a_live_stream_aborts_it() -> None:
    server = TtrpcConnection(Role.SERVER)
    server.receive_data(raw_request(1, flags=0x02))
    size = MAX_MESSAGE_LENGTH + 1
    events = server.receive_data(header(size, 1, 3) + bytes(size))
    assert events == [StreamAborted(1, 8, OVERSIZE_MESSAGE.format(size))]
    assert server.data_to_send() == error_response(1, 8, OVERSIZE_MESSAGE.format(size))


def test_data_on_unknown_stream() -> None:
    server = TtrpcConnection(Role.SERVER)
    assert server.receive_data(raw_data(5, b"x")) == []
    assert server.data_to_send() == error_response(5, 3, "StreamID is no longer active")


def test_close_carrying_data_is_rejected() -> None:
    server = TtrpcConnection(Role.SERVER)
    server.receive_data(raw_request(1, flags=0x02))
    message = "data close message cannot include data"
    assert server.receive_data(raw_data(1, b"x", flags=0x01)) == [StreamAborted(1, 3, message)]
    assert server.data_to_send() == error_response(1, 3, message)


def test_empty_message_with_close_is_a_message_and_a_close() -> None:
    server = TtrpcConnection(Role.SERVER)
    server.receive_data(raw_request(1, flags=0x02))
    assert server.receive_data(raw_data(1, b"", flags=0x01)) == [DataReceived(1, b"", end=True)]


def test_data_after_the_client_closed_is_rejected() -> None:
    server = TtrpcConnection(Role.SERVER)
    server.receive_data(raw_request(1))  # unary: nothing may follow
    message = "data handling error: ttrpc: stream closed"
    assert server.receive_data(raw_data(1, b"x")) == [StreamAborted(1, 3, message)]
    assert server.data_to_send() == error_response(1, 3, message)


def test_repeated_close_is_ignored() -> None:
    server = TtrpcConnection(Role.SERVER)
    server.receive_data(raw_request(1))
    assert server.receive_data(raw_data(1, flags=0x05)) == []
    assert server.data_to_send() == b""
    assert server.stream_state(1) is StreamState.HALF_CLOSED_REMOTE


def test_no_data_frame_without_close_is_nothing() -> None:
    server = TtrpcConnection(Role.SERVER)
    server.receive_data(raw_request(1, flags=0x02))
    assert server.receive_data(raw_data(1, flags=0x04)) == []
    assert server.stream_state(1) is StreamState.OPEN


@pytest.mark.parametrize("kind", [2, 0, 4, 0xFF])
def test_server_ignores_responses_and_unknown_types(kind: int) -> None:
    server = TtrpcConnection(Role.SERVER)
    assert server.receive_data(header(3, 1, kind) + b"abc" + raw_request(1)) != []
    assert server.data_to_send() == b""


# --- stream-level faults on the client
def test_client_ignores_frames_for_unknown_streams() -> None:
    client = TtrpcConnection(Role.CLIENT)
    frames = error_response(1, 2, "x") + raw_data(3, b"y") + raw_request(5)
    assert client.receive_data(frames) == []


def test_client_drops_reply_of_abandoned_stream() -> None:
    client, server = pair()
    sid = client.send_request("s", "m")
    to_server(client, server)
    client.abandon_stream(sid)
    server.send_response(sid, b"late")
    assert to_client(server, client) == []


def test_client_turns_oversized_reply_into_the_calls_failure() -> None:
    client = TtrpcConnection(Role.CLIENT)
    sid = client.send_request("s", "m")
    client.data_to_send()
    size = MAX_MESSAGE_LENGTH + 10
    events = client.receive_data(header(size, sid, 2) + bytes(size))
    assert events == [ResponseReceived(sid, 8, OVERSIZE_MESSAGE.format(size), b"")]
    assert client.data_to_send() == b""  # a client never answers
    assert client.open_streams == frozenset()


def test_client_turns_malformed_reply_into_internal() -> None:
    client = TtrpcConnection(Role.CLIENT)
    sid = client.send_request("s", "m")
    [event] = client.receive_data(header(2, sid, 2) + b"\x0a\x09")
    assert isinstance(event, ResponseReceived)
    assert event.code == Code.INTERNAL
    assert event.message.startswith("unmarshal response error: ")


# --- connection-level faults
def test_reserved_length_byte_is_a_connection_error() -> None:
    server = TtrpcConnection(Role.SERVER)
    with pytest.raises(TtrpcConnectionError) as info:
        server.receive_data(raw_request(1) + b"\x01" + bytes(9))
    assert isinstance(info.value, RemoteProtocolError)
    assert [type(e) for e in info.value.events] == [RequestReceived]
    with pytest.raises(TtrpcConnectionError):
        server.receive_data(raw_request(3))
    assert server.closed


def test_clean_eof_and_truncated_eof() -> None:
    server = TtrpcConnection(Role.SERVER)
    server.receive_data(raw_request(1))
    assert server.receive_eof() == [ConnectionClosed()]
    with pytest.raises(LocalProtocolError):
        server.receive_data(b"x")

    truncated = TtrpcConnection(Role.SERVER)
    truncated.receive_data(raw_request(1)[:-1])
    with pytest.raises(TtrpcConnectionError):
        truncated.receive_eof()

    discarding = TtrpcConnection(Role.CLIENT)
    discarding.receive_data(header(MAX_MESSAGE_LENGTH + 1, 1, 2))
    with pytest.raises(TtrpcConnectionError):
        discarding.receive_eof()


# --- local misuse
def test_role_checks() -> None:
    client, server = pair()
    with pytest.raises(LocalProtocolError):
        client.send_response(1)
    with pytest.raises(LocalProtocolError):
        server.send_request("s", "m")


def test_sending_on_unknown_or_finished_streams() -> None:
    client, server = pair()
    with pytest.raises(StreamClosedError):
        server.send_response(1)
    with pytest.raises(StreamClosedError):
        client.send_data(1, b"x")
    sid = client.send_request("s", "m")  # unary: the client's side is already done
    with pytest.raises(LocalProtocolError):
        client.send_data(sid, b"x")
    with pytest.raises(LocalProtocolError):
        client.send_data(sid, None)


def test_oversized_request_consumes_no_stream_id() -> None:
    client = TtrpcConnection(Role.CLIENT)
    with pytest.raises(OversizedMessageError):
        client.send_request("s", "m", bytes(MAX_MESSAGE_LENGTH))
    assert client.data_to_send() == b""
    assert client.send_request("s", "m") == 1


def test_oversized_reply_leaves_the_stream_for_an_error() -> None:
    client, server = pair()
    sid = client.send_request("s", "m")
    to_server(client, server)
    with pytest.raises(OversizedMessageError) as info:
        server.send_response(sid, bytes(MAX_MESSAGE_LENGTH))
    assert server.data_to_send() == b""
    server.send_response(sid, code=info.value.code, message=info.value.message)
    [event] = to_client(server, client)
    # The envelope is the payload plus its tag (1 byte) and length varint (4 bytes for 4 MiB).
    assert event == ResponseReceived(sid, 8, OVERSIZE_MESSAGE.format(MAX_MESSAGE_LENGTH + 5), b"")


def test_stream_ids_run_out() -> None:
    client = TtrpcConnection(Role.CLIENT)
    client._next_stream_id = MAX_STREAM_ID  # the last odd uint32
    assert client.send_request("s", "m") == MAX_STREAM_ID
    with pytest.raises(LocalProtocolError):
        client.send_request("s", "m")


# --- every (state, input) pair against the transition tables
def _client_in(state: StreamState) -> tuple[TtrpcConnection, int]:
    client = TtrpcConnection(Role.CLIENT)
    mode = RequestMode.CLIENT_STREAMING if state is StreamState.OPEN else RequestMode.UNARY
    sid = client.send_request("s", "m", mode=mode)
    client.data_to_send()
    assert client.stream_state(sid) is state
    return client, sid


def _server_in(state: StreamState) -> tuple[TtrpcConnection, int]:
    server = TtrpcConnection(Role.SERVER)
    server.receive_data(raw_request(1, flags=0x02 if state is StreamState.OPEN else 0))
    assert server.stream_state(1) is state
    return server, 1


def _apply(conn: TtrpcConnection, sid: int, step: StreamInput) -> list[Event]:
    if step is StreamInput.SEND_DATA:
        conn.send_data(sid, b"x")
    elif step is StreamInput.SEND_CLOSE:
        conn.send_data(sid, None, end=True)
    elif step is StreamInput.SEND_RESPONSE:
        conn.send_response(sid)
    elif step is StreamInput.RECV_DATA:
        return conn.receive_data(raw_data(sid, b"x"))
    elif step is StreamInput.RECV_CLOSE:
        return conn.receive_data(raw_data(sid, flags=0x05))
    else:
        return conn.receive_data(error_response(sid, 0, ""))
    return []


CLIENT_CASES = list(
    itertools.product(
        [StreamState.OPEN, StreamState.HALF_CLOSED_LOCAL],
        [s for s in StreamInput if s is not StreamInput.SEND_RESPONSE],
    )
)
SERVER_CASES = list(
    itertools.product(
        [StreamState.OPEN, StreamState.HALF_CLOSED_REMOTE],
        [s for s in StreamInput if s is not StreamInput.RECV_RESPONSE],
    )
)


@pytest.mark.parametrize(("state", "step"), CLIENT_CASES)
def test_client_transitions(state: StreamState, step: StreamInput) -> None:
    client, sid = _client_in(state)
    expected = CLIENT_TRANSITIONS.get((state, step))
    if expected is None:
        assert step.name.startswith("SEND")  # every remote input is in the client's table
        with pytest.raises(LocalProtocolError):
            _apply(client, sid, step)
        assert client.stream_state(sid) is state
        return
    events = _apply(client, sid, step)
    assert client.stream_state(sid) is expected[0]
    if step.name.startswith("RECV"):
        assert len(events) == 1


@pytest.mark.parametrize(("state", "step"), SERVER_CASES)
def test_server_transitions(state: StreamState, step: StreamInput) -> None:
    server, sid = _server_in(state)
    expected = SERVER_TRANSITIONS.get((state, step))
    assert expected is not None
    events = _apply(server, sid, step)
    assert server.stream_state(sid) is expected[0]
    reaction = expected[1]
    if reaction is Reaction.ABORT:
        assert [type(e) for e in events] == [StreamAborted]
    elif reaction is Reaction.IGNORE:
        assert events == []
    elif step.name.startswith("RECV"):
        assert [type(e) for e in events] == [DataReceived]
