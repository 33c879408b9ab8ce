"""Property tests: split invariance, round trips, and hostile input only ever raising
ProtocolError (and well-framed input never raising at all)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from podgate.proto.errors import ProtocolError
from podgate.proto.ttrpc import (
    MAX_MESSAGE_LENGTH,
    Event,
    RequestReceived,
    ResponseReceived,
    Role,
    TtrpcConnection,
)

SETTINGS = settings(max_examples=150, deadline=None)
BIG = settings(max_examples=15, deadline=None)  # examples that move megabytes

_text = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=30)
calls = st.lists(
    st.tuples(
        _text,  # service
        _text,  # method
        st.binary(max_size=300),  # payload
        st.integers(-(2**63), 2**63 - 1),  # timeout_nano
        st.lists(st.tuples(_text, _text), max_size=3),  # metadata
    ),
    min_size=1,
    max_size=6,
)


def feed_in_pieces(conn: TtrpcConnection, data: bytes, cuts: list[int]) -> list[Event]:
    events: list[Event] = []
    start = 0
    for cut in [*sorted({c % (len(data) + 1) for c in cuts}), len(data)]:
        events += conn.receive_data(data[start:cut])
        start = cut
    return events


@SETTINGS
@given(calls=calls, cuts=st.lists(st.integers(0, 10**6), max_size=20))
def test_requests_round_trip_under_any_split(
    calls: list[tuple[str, str, bytes, int, list[tuple[str, str]]]], cuts: list[int]
) -> None:
    client = TtrpcConnection(Role.CLIENT)
    ids = [client.send_request(s, m, p, timeout_nano=t, metadata=md) for s, m, p, t, md in calls]
    wire = client.data_to_send()
    whole = TtrpcConnection(Role.SERVER).receive_data(wire)
    split = feed_in_pieces(TtrpcConnection(Role.SERVER), wire, cuts)
    assert split == whole
    assert whole == [
        RequestReceived(sid, s, m, p, t, tuple((k.lower(), v) for k, v in md))
        for sid, (s, m, p, t, md) in zip(ids, calls, strict=True)
    ]


@SETTINGS
@given(
    replies=st.lists(
        st.tuples(st.binary(max_size=200), st.integers(0, 16), _text), min_size=1, max_size=6
    ),
    cuts=st.lists(st.integers(0, 10**6), max_size=20),
)
def test_responses_round_trip_under_any_split(
    replies: list[tuple[bytes, int, str]], cuts: list[int]
) -> None:
    client, server = TtrpcConnection(Role.CLIENT), TtrpcConnection(Role.SERVER)
    ids = [client.send_request("s", "m") for _ in replies]
    server.receive_data(client.data_to_send())
    for sid, (payload, code, message) in zip(ids, replies, strict=True):
        server.send_response(sid, payload, code=code, message=message)
    wire = server.data_to_send()
    events = feed_in_pieces(client, wire, cuts)
    assert events == [
        ResponseReceived(sid, code, message, payload)
        for sid, (payload, code, message) in zip(ids, replies, strict=True)
    ]


@BIG
@given(
    extra=st.integers(1, 4096),
    cuts=st.lists(st.integers(0, 6 * 1024 * 1024), max_size=8),
)
def test_oversized_frame_skipped_the_same_under_any_split(extra: int, cuts: list[int]) -> None:
    size = MAX_MESSAGE_LENGTH + extra
    client = TtrpcConnection(Role.CLIENT)
    client.send_request("s", "m", b"before")
    before = client.data_to_send()
    # stream 3 carries an oversized request; stream 5 a normal one
    oversized = size.to_bytes(4, "big") + (3).to_bytes(4, "big") + b"\x01\x00" + bytes(size)
    client._next_stream_id = 5
    client.send_request("s", "m", b"after")
    wire = before + oversized + client.data_to_send()

    whole_conn = TtrpcConnection(Role.SERVER)
    whole = whole_conn.receive_data(wire)
    split_conn = TtrpcConnection(Role.SERVER)
    split = feed_in_pieces(split_conn, wire, cuts)
    assert split == whole
    assert [(e.stream_id, e.payload) for e in whole if isinstance(e, RequestReceived)] == [
        (1, b"before"),
        (5, b"after"),
    ]
    answer = whole_conn.data_to_send()
    assert split_conn.data_to_send() == answer
    assert f"message length {size} exceed maximum message size of 4194304".encode() in answer


@SETTINGS
@given(
    role=st.sampled_from(list(Role)),
    chunks=st.lists(st.binary(max_size=64), max_size=12),
)
def test_garbage_only_raises_protocol_errors(role: Role, chunks: list[bytes]) -> None:
    conn = TtrpcConnection(role)
    if role is Role.CLIENT:
        for _ in range(4):
            conn.send_request("s", "m")
    for chunk in chunks:
        try:
            conn.receive_data(chunk)
        except ProtocolError:
            pass
    try:
        conn.receive_eof()
    except ProtocolError:
        pass


frames = st.lists(
    st.tuples(
        st.integers(0, 9),  # stream id
        st.integers(0, 255),  # type
        st.integers(0, 255),  # flags
        st.binary(max_size=40),  # body
    ),
    max_size=15,
)


@SETTINGS
@given(role=st.sampled_from(list(Role)), frames=frames)
def test_well_framed_input_never_kills_the_connection(
    role: Role, frames: list[tuple[int, int, int, bytes]]
) -> None:
    conn = TtrpcConnection(role)
    if role is Role.CLIENT:
        for _ in range(5):
            conn.send_request("s", "m")
    wire = b"".join(
        len(body).to_bytes(4, "big") + sid.to_bytes(4, "big") + bytes([kind, flags]) + body
        for sid, kind, flags, body in frames
    )
    conn.receive_data(wire)  # stream-level faults only: nothing may raise
    assert conn.receive_eof() != []
