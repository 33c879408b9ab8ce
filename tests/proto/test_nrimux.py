"""NRI mux framing (containerd/nri pkg/net/multiplex) as byte tables, plus the Go interop rule
for frames written to a Go peer (reference §6.2) and random splits of the trunk."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podgate.proto.errors import LocalProtocolError, RemoteProtocolError
from podgate.proto.nrimux import (
    MAX_PAYLOAD,
    PLUGIN_SERVICE_CONN,
    RUNTIME_SERVICE_CONN,
    MuxDecoder,
    MuxFrame,
    TtrpcFramer,
    encode_frame,
)

SETTINGS = settings(max_examples=150, deadline=None)


def ttrpc_message(length: int, stream_id: int = 1, kind: int = 1, fill: int = 0x5A) -> bytes:
    """A ttrpc frame: 10-byte header (length, stream id, type, flags) and `length` data bytes."""
    return (
        length.to_bytes(4, "big")
        + stream_id.to_bytes(4, "big")
        + bytes([kind, 0])
        + bytes([fill]) * length
    )


def parse_frames(data: bytes) -> list[tuple[int, bytes]]:
    """Independent reference parser: (conn id, payload) for each whole frame in `data`."""
    out = []
    while data:
        conn_id = int.from_bytes(data[0:4], "big")
        length = int.from_bytes(data[4:8], "big")
        assert len(data) >= 8 + length
        out.append((conn_id, data[8 : 8 + length]))
        data = data[8 + length :]
    return out


# --- constants and the header
def test_constants_match_go() -> None:
    assert (PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN) == (1, 2)
    assert MAX_PAYLOAD == 4 * 1024 * 1024 + 10 == 4194314


def test_encode_frame_bytes() -> None:
    assert encode_frame(2, b"abc") == bytes.fromhex("00000002 00000003 616263")
    assert encode_frame(1, b"") == bytes.fromhex("00000001 00000000")
    assert encode_frame(0xFFFFFFFF, b"\x00") == bytes.fromhex("ffffffff 00000001 00")


@pytest.mark.parametrize("conn_id", [0, -1, 1 << 32])
def test_encode_frame_rejects_reserved_or_out_of_range_conn(conn_id: int) -> None:
    with pytest.raises(LocalProtocolError):
        encode_frame(conn_id, b"x")


def test_encode_frame_rejects_oversize() -> None:
    assert len(encode_frame(1, bytes(MAX_PAYLOAD))) == 8 + MAX_PAYLOAD
    with pytest.raises(LocalProtocolError):
        encode_frame(1, bytes(MAX_PAYLOAD + 1))


# --- decoder
def test_decode_one_frame() -> None:
    decoder = MuxDecoder()
    assert decoder.receive_data(bytes.fromhex("00000002 00000003 616263")) == [MuxFrame(2, b"abc")]
    assert decoder.buffered == 0


def test_decode_several_frames_and_a_partial_one() -> None:
    decoder = MuxDecoder()
    data = bytes.fromhex("00000001 00000002 6869 00000002 00000000 00000007 00000004 7a")
    assert decoder.receive_data(data) == [
        MuxFrame(1, b"hi"),
        MuxFrame(2, b""),
    ]
    assert decoder.buffered == 9
    assert decoder.receive_data(b"zzz") == [MuxFrame(7, b"zzzz")]
    assert decoder.buffered == 0


def test_decode_header_split_byte_by_byte() -> None:
    decoder = MuxDecoder()
    data = bytes.fromhex("00000002 00000003 616263")
    got: list[MuxFrame] = []
    for byte in data:
        got += decoder.receive_data(bytes([byte]))
    assert got == [MuxFrame(2, b"abc")]


def test_decode_worked_example_register_plugin() -> None:
    # Reference §5.2: RegisterPlugin(logger, 10) with a 5 s deadline over conn 2.
    payload = bytes.fromhex("0a066c6f67676572 12023130")
    envelope = (
        b"\x0a\x1c"
        + b"nri.pkg.api.v1alpha1.Runtime"
        + b"\x12\x0e"
        + b"RegisterPlugin"
        + b"\x1a\x0c"
        + payload
        + b"\x20"
        + bytes.fromhex("80e497d012")
    )
    assert len(envelope) == 66
    message = bytes.fromhex("00000042 00000001 01 00") + envelope
    frames = TtrpcFramer(RUNTIME_SERVICE_CONN).feed(message)
    assert frames == [bytes.fromhex("00000002 0000004c") + message]
    assert MuxDecoder().receive_data(frames[0]) == [MuxFrame(2, message)]


def test_decode_reserved_conn_id_is_remote_error() -> None:
    decoder = MuxDecoder()
    with pytest.raises(RemoteProtocolError):
        decoder.receive_data(bytes.fromhex("00000000 00000001 41"))
    # The decoder stays dead.
    with pytest.raises(RemoteProtocolError):
        decoder.receive_data(bytes.fromhex("00000001 00000001 41"))


def test_decode_oversize_length_is_remote_error_before_the_payload_arrives() -> None:
    decoder = MuxDecoder()
    assert decoder.receive_data(bytes.fromhex("00000001 0040000a")) == []  # exactly the max
    decoder = MuxDecoder()
    with pytest.raises(RemoteProtocolError):
        decoder.receive_data(bytes.fromhex("00000001 0040000b"))  # MAX_PAYLOAD + 1


def test_decode_truncated_frame_at_eof_is_remote_error() -> None:
    decoder = MuxDecoder()
    decoder.receive_data(bytes.fromhex("00000001 00000004 6162"))
    with pytest.raises(RemoteProtocolError):
        decoder.receive_eof()
    clean = MuxDecoder()
    clean.receive_data(bytes.fromhex("00000001 00000001 61"))
    clean.receive_eof()  # nothing pending: a clean end


@SETTINGS
@given(
    frames=st.lists(
        st.tuples(st.integers(1, 0xFFFFFFFF), st.binary(max_size=200)), min_size=1, max_size=8
    ),
    cuts=st.lists(st.integers(0, 5000), max_size=12),
)
def test_decode_is_split_invariant(frames: list[tuple[int, bytes]], cuts: list[int]) -> None:
    data = b"".join(
        conn.to_bytes(4, "big") + len(payload).to_bytes(4, "big") + payload
        for conn, payload in frames
    )
    decoder = MuxDecoder()
    got: list[MuxFrame] = []
    start = 0
    for cut in [*sorted({c % (len(data) + 1) for c in cuts}), len(data)]:
        got += decoder.receive_data(data[start:cut])
        start = cut
    assert got == [MuxFrame(conn, payload) for conn, payload in frames]
    assert decoder.buffered == 0


@SETTINGS
@given(st.binary(max_size=300))
def test_decode_hostile_input_raises_only_protocol_errors(data: bytes) -> None:
    decoder = MuxDecoder()
    try:
        decoder.receive_data(data)
        decoder.receive_eof()
    except RemoteProtocolError:
        pass


# --- the ttrpc framer (the Go interop rule)
def test_small_message_is_one_frame() -> None:
    message = ttrpc_message(5)
    assert TtrpcFramer(1).feed(message) == [
        bytes.fromhex("00000001 0000000f") + message  # 15 = 10 + 5
    ]


def test_empty_response_is_one_ten_byte_frame() -> None:
    # Reference §5.2: an Empty reply is `00 00 00 00 | 00 00 00 01 | 02 | 00`.
    message = bytes.fromhex("00000000 00000001 02 00")
    assert TtrpcFramer(2).feed(message) == [bytes.fromhex("00000002 0000000a") + message]


def test_message_of_exactly_4096_bytes_is_one_frame() -> None:
    message = ttrpc_message(4086)
    [frame] = TtrpcFramer(1).feed(message)
    assert frame[:8] == bytes.fromhex("00000001 00001000")
    assert frame[8:] == message


def test_ten_thousand_byte_message_is_4096_then_5914() -> None:
    message = ttrpc_message(10_000)
    frames = TtrpcFramer(2).feed(message)
    assert [len(frame) - 8 for frame in frames] == [4096, 5914]
    assert frames[0][:8] == bytes.fromhex("00000002 00001000")
    assert frames[1][:8] == bytes.fromhex("00000002 0000171a")
    assert b"".join(frame[8:] for frame in frames) == message


def test_largest_message_is_4096_then_the_rest_in_one_frame() -> None:
    message = ttrpc_message(4 * 1024 * 1024)
    frames = TtrpcFramer(1).feed(message)
    assert [len(frame) - 8 for frame in frames] == [4096, 4194314 - 4096]
    assert b"".join(frame[8:] for frame in frames) == message


def test_two_messages_in_one_write_are_two_frames() -> None:
    first, second = ttrpc_message(3, 1, fill=0x41), ttrpc_message(4, 3, fill=0x42)
    frames = TtrpcFramer(1).feed(first + second)
    assert frames == [
        bytes.fromhex("00000001 0000000d") + first,
        bytes.fromhex("00000001 0000000e") + second,
    ]


def test_partial_message_is_buffered_until_complete() -> None:
    message = ttrpc_message(20)
    framer = TtrpcFramer(1)
    assert framer.feed(message[:4]) == []  # not even the header
    assert framer.feed(message[4:25]) == []
    assert framer.buffered == 25
    next_message = ttrpc_message(1, 3)
    frames = framer.feed(message[25:] + next_message[:7])
    assert frames == [bytes.fromhex("00000001 0000001e") + message]
    assert framer.buffered == 7
    assert framer.feed(next_message[7:]) == [bytes.fromhex("00000001 0000000b") + next_message]
    assert framer.buffered == 0


def test_large_message_split_across_messages_boundaries() -> None:
    # A big message followed by a small one, written in one call: the big one's last frame
    # must end exactly at its boundary.
    big, small = ttrpc_message(5000, 1), ttrpc_message(2, 3)
    frames = TtrpcFramer(1).feed(big + small)
    assert [len(frame) - 8 for frame in frames] == [4096, 914, 12]


def test_unframeable_ttrpc_stream_is_local_error() -> None:
    with pytest.raises(LocalProtocolError):
        TtrpcFramer(1).feed(bytes.fromhex("01000000 00000001 01 00"))


def test_framer_rejects_reserved_conn() -> None:
    with pytest.raises(LocalProtocolError):
        TtrpcFramer(0)


@SETTINGS
@given(
    lengths=st.lists(st.integers(0, 9000), min_size=1, max_size=5),
    cuts=st.lists(st.integers(0, 50_000), max_size=10),
)
def test_framer_obeys_the_go_rules_for_any_split(lengths: list[int], cuts: list[int]) -> None:
    messages = [ttrpc_message(n, 2 * i + 1, fill=i) for i, n in enumerate(lengths)]
    stream = b"".join(messages)
    framer = TtrpcFramer(2)
    out: list[bytes] = []
    start = 0
    for cut in [*sorted({c % (len(stream) + 1) for c in cuts}), len(stream)]:
        out += framer.feed(stream[start:cut])
        start = cut
    assert framer.buffered == 0
    frames = parse_frames(b"".join(out))
    assert all(conn == 2 for conn, _ in frames)
    # Regroup the frames into messages: each frame belongs to exactly one message, the first
    # frame of each message fits 4096 bytes, no frame is larger than what is left.
    index = 0
    for message in messages:
        left = len(message)
        first = True
        got = b""
        while left:
            payload = frames[index][1]
            index += 1
            assert 0 < len(payload) <= left
            if first:
                assert len(payload) <= 4096
                first = False
            got += payload
            left -= len(payload)
        assert got == message
    assert index == len(frames)
    # And the decoder reads back the same bytes.
    decoded = MuxDecoder().receive_data(b"".join(out))
    assert b"".join(frame.payload for frame in decoded) == stream
