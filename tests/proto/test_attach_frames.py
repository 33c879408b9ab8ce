"""The shim attach socket framing: [type:1][length:4 BE][payload] (proto/attach.py)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podgate.proto.attach import (
    HEADER_BYTES,
    MAX_ATTACH_FRAME,
    AttachCodec,
    AttachProtocolError,
    Event,
    Exit,
    FrameType,
    Resize,
    Role,
    State,
    Stderr,
    Stdin,
    StdinClose,
    Stdout,
    encode_frame,
)
from podgate.proto.errors import LocalProtocolError, RemoteProtocolError

# Hand-written from the frame layout: type byte, 4-byte big-endian length, payload.
CLIENT_TABLE: list[tuple[Event, bytes]] = [
    (Stdin(b"hi"), b"\x00\x00\x00\x00\x02hi"),
    (Stdin(b"\n"), b"\x00\x00\x00\x00\x01\n"),
    (StdinClose(), b"\x03\x00\x00\x00\x00"),
    (Resize(80, 24), b'\x04\x00\x00\x00\x18{"Width":80,"Height":24}'),
    (Resize(0, 65535), b'\x04\x00\x00\x00\x1a{"Width":0,"Height":65535}'),
]
SHIM_TABLE: list[tuple[Event, bytes]] = [
    (Stdout(b"out\n"), b"\x01\x00\x00\x00\x04out\n"),
    (Stderr(b"err"), b"\x02\x00\x00\x00\x03err"),
    (Exit(0), b"\x05\x00\x00\x00\x010"),
    (Exit(7), b"\x05\x00\x00\x00\x017"),
    (Exit(137), b"\x05\x00\x00\x00\x03137"),
]


def test_constants() -> None:
    assert HEADER_BYTES == 5
    assert MAX_ATTACH_FRAME == 1024 * 1024
    assert [t.value for t in FrameType] == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize(("event", "wire"), CLIENT_TABLE)
def test_client_encodes(event: Event, wire: bytes) -> None:
    assert AttachCodec(Role.CLIENT).send(event) == wire


@pytest.mark.parametrize(("event", "wire"), SHIM_TABLE)
def test_shim_encodes(event: Event, wire: bytes) -> None:
    assert AttachCodec(Role.SHIM).send(event) == wire


@pytest.mark.parametrize(("event", "wire"), CLIENT_TABLE)
def test_shim_decodes_client_frames(event: Event, wire: bytes) -> None:
    assert AttachCodec(Role.SHIM).receive_data(wire) == [event]


@pytest.mark.parametrize(("event", "wire"), SHIM_TABLE)
def test_client_decodes_shim_frames(event: Event, wire: bytes) -> None:
    assert AttachCodec(Role.CLIENT).receive_data(wire) == [event]


def test_resize_json_may_have_spaces_and_extra_keys() -> None:
    body = b'{ "Height": 5, "Width": 6, "x": null }'
    wire = b"\x04" + len(body).to_bytes(4, "big") + body
    assert AttachCodec(Role.SHIM).receive_data(wire) == [Resize(6, 5)]


def test_byte_at_a_time_and_several_frames_in_one_read() -> None:
    wire = b"".join(w for _, w in CLIENT_TABLE)
    codec = AttachCodec(Role.SHIM)
    events: list[Event] = []
    for i in range(len(wire)):
        events += codec.receive_data(wire[i : i + 1])
    assert events == [e for e, _ in CLIENT_TABLE]
    # The table ends with STDIN_CLOSE followed by resizes, which stay allowed.
    assert codec.state is State.STDIN_CLOSED


def test_empty_data_frames_are_dropped_and_never_sent() -> None:
    assert AttachCodec(Role.SHIM).receive_data(b"\x00\x00\x00\x00\x00") == []
    assert AttachCodec(Role.CLIENT).receive_data(b"\x01\x00\x00\x00\x00") == []
    assert AttachCodec(Role.CLIENT).send(Stdin(b"")) == b""


def test_large_data_is_split_into_max_frames() -> None:
    data = bytes(range(256)) * (MAX_ATTACH_FRAME // 256) + b"tail"
    wire = AttachCodec(Role.SHIM).send(Stdout(data))
    assert wire[:HEADER_BYTES] == b"\x01\x00\x10\x00\x00"
    second = HEADER_BYTES + MAX_ATTACH_FRAME
    assert wire[second : second + HEADER_BYTES + 4] == b"\x01\x00\x00\x00\x04tail"
    events = AttachCodec(Role.CLIENT).receive_data(wire)
    assert events == [Stdout(data[:MAX_ATTACH_FRAME]), Stdout(b"tail")]


def test_max_frame_is_accepted_one_more_is_not() -> None:
    codec = AttachCodec(Role.SHIM)
    header = b"\x00" + MAX_ATTACH_FRAME.to_bytes(4, "big")
    assert codec.receive_data(header) == []  # waiting for the payload
    assert codec.receive_data(b"x" * MAX_ATTACH_FRAME) == [Stdin(b"x" * MAX_ATTACH_FRAME)]
    codec = AttachCodec(Role.SHIM)
    with pytest.raises(AttachProtocolError, match="exceeds"):
        # The header alone is enough to refuse: nothing is buffered for it.
        codec.receive_data(b"\x00" + (MAX_ATTACH_FRAME + 1).to_bytes(4, "big"))
    assert codec.state is State.ERROR


@pytest.mark.parametrize(
    ("role", "wire", "match"),
    [
        (Role.SHIM, b"\x06\x00\x00\x00\x00", "unknown attach frame type 6"),
        (Role.SHIM, b"\xff\x00\x00\x00\x00", "unknown attach frame type 255"),
        (Role.SHIM, b"\x01\x00\x00\x00\x01x", "STDOUT frame not allowed"),
        (Role.SHIM, b"\x05\x00\x00\x00\x010", "EXIT frame not allowed"),
        (Role.CLIENT, b"\x00\x00\x00\x00\x01x", "STDIN frame not allowed"),
        (Role.CLIENT, b"\x04\x00\x00\x00\x02{}", "RESIZE frame not allowed"),
        (Role.SHIM, b"\x03\x00\x00\x00\x01x", "carries a payload"),
        (Role.SHIM, b"\x04\x00\x00\x00\x03{x}", "not JSON"),
        (Role.SHIM, b"\x04\x00\x00\x00\x02[]", "not a JSON object"),
        (Role.SHIM, b'\x04\x00\x00\x00\x0c{"Width":80}', "Height"),
        (Role.SHIM, b'\x04\x00\x00\x00\x17{"Width":-1,"Height":1}', "Width"),
        (Role.SHIM, b'\x04\x00\x00\x00\x1a{"Width":65536,"Height":1}', "Width"),
        (Role.SHIM, b'\x04\x00\x00\x00\x19{"Width":true,"Height":1}', "Width"),
        (Role.SHIM, b'\x04\x00\x00\x00\x18{"Width":1.5,"Height":1}', "Width"),
        (Role.SHIM, b"\x04\x00\x00\x00\x02\xff\xfe", "not JSON"),
        (Role.CLIENT, b"\x05\x00\x00\x00\x00", "not an exit code"),
        (Role.CLIENT, b"\x05\x00\x00\x00\x02-1", "not an exit code"),
        (Role.CLIENT, b"\x05\x00\x00\x00\x03 12", "not an exit code"),
        (Role.CLIENT, b"\x05\x00\x00\x00\x04" + b"1000", "not an exit code"),
        (Role.CLIENT, b"\x05\x00\x00\x00\x03256", "out of range"),
    ],
)
def test_garbage_is_a_protocol_error(role: Role, wire: bytes, match: str) -> None:
    codec = AttachCodec(role)
    with pytest.raises(AttachProtocolError, match=match) as info:
        codec.receive_data(wire)
    assert isinstance(info.value, RemoteProtocolError)
    assert info.value.frame_type == wire[0]
    assert codec.state is State.ERROR
    # A failed codec stays failed: the connection is dropped.
    with pytest.raises(AttachProtocolError):
        codec.receive_data(b"")


def test_events_before_the_bad_frame_are_lost_with_the_connection() -> None:
    codec = AttachCodec(Role.SHIM)
    with pytest.raises(AttachProtocolError):
        codec.receive_data(b"\x00\x00\x00\x00\x01a" + b"\x09\x00\x00\x00\x00")


def test_stdin_after_stdin_close_is_refused() -> None:
    codec = AttachCodec(Role.SHIM)
    assert codec.receive_data(b"\x03\x00\x00\x00\x00") == [StdinClose()]
    with pytest.raises(AttachProtocolError, match="STDIN frame not allowed"):
        codec.receive_data(b"\x00\x00\x00\x00\x01a")


def test_nothing_may_follow_exit() -> None:
    codec = AttachCodec(Role.CLIENT)
    assert codec.receive_data(b"\x05\x00\x00\x00\x010") == [Exit(0)]
    assert codec.state is State.DONE
    with pytest.raises(AttachProtocolError, match="STDOUT frame not allowed"):
        codec.receive_data(b"\x01\x00\x00\x00\x01a")


def test_eof_inside_a_frame() -> None:
    codec = AttachCodec(Role.CLIENT)
    codec.receive_data(b"\x01\x00\x00")
    with pytest.raises(AttachProtocolError, match="inside a frame"):
        codec.receive_eof()
    clean = AttachCodec(Role.CLIENT)
    clean.receive_data(b"\x01\x00\x00\x00\x01a")
    clean.receive_eof()  # between frames: fine


@pytest.mark.parametrize(
    ("role", "event"),
    [
        (Role.CLIENT, Stdout(b"x")),
        (Role.CLIENT, Exit(0)),
        (Role.SHIM, Stdin(b"x")),
        (Role.SHIM, Resize(1, 1)),
        (Role.CLIENT, Resize(65536, 1)),
        (Role.CLIENT, Resize(1, -1)),
        (Role.SHIM, Exit(256)),
        (Role.SHIM, Exit(-1)),
    ],
)
def test_local_misuse(role: Role, event: Event) -> None:
    with pytest.raises(LocalProtocolError):
        AttachCodec(role).send(event)


def test_encode_frame_limit() -> None:
    assert encode_frame(FrameType.STDOUT, b"ab") == b"\x01\x00\x00\x00\x02ab"
    with pytest.raises(LocalProtocolError):
        encode_frame(FrameType.STDOUT, b"x" * (MAX_ATTACH_FRAME + 1))


_data = st.binary(min_size=1, max_size=64)
_client_events = st.lists(
    st.one_of(
        st.builds(Stdin, _data),
        st.builds(Resize, st.integers(0, 0xFFFF), st.integers(0, 0xFFFF)),
    ),
    max_size=20,
)
_shim_events = st.lists(st.one_of(st.builds(Stdout, _data), st.builds(Stderr, _data)), max_size=20)


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges)]


@settings(max_examples=200, deadline=None)
@given(_client_events, st.booleans(), st.lists(st.integers(0, 10_000), max_size=12))
def test_client_to_shim_round_trip_with_random_splits(
    events: list[Event], close: bool, cuts: list[int]
) -> None:
    sent = [*events, StdinClose()] if close else events
    client = AttachCodec(Role.CLIENT)
    wire = b"".join(client.send(e) for e in sent)
    shim = AttachCodec(Role.SHIM)
    got: list[Event] = []
    for piece in _split(wire, cuts):
        got += shim.receive_data(piece)
    shim.receive_eof()
    assert got == sent


@settings(max_examples=200, deadline=None)
@given(_shim_events, st.integers(0, 255), st.lists(st.integers(0, 10_000), max_size=12))
def test_shim_to_client_round_trip_with_random_splits(
    events: list[Event], code: int, cuts: list[int]
) -> None:
    sent = [*events, Exit(code)]
    shim = AttachCodec(Role.SHIM)
    wire = b"".join(shim.send(e) for e in sent)
    client = AttachCodec(Role.CLIENT)
    got: list[Event] = []
    for piece in _split(wire, cuts):
        got += client.receive_data(piece)
    assert got == sent
    assert client.state is State.DONE


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(list(Role)), st.lists(st.binary(max_size=40), max_size=8))
def test_random_bytes_give_events_or_protocol_errors_only(role: Role, chunks: list[bytes]) -> None:
    codec = AttachCodec(role)
    try:
        for chunk in chunks:
            for event in codec.receive_data(chunk):
                assert isinstance(event, Event)
        codec.receive_eof()
    except AttachProtocolError:
        assert codec.state is State.ERROR
