"""HTTP/2 frame splitting and the DATA frames the proxy's relay rebuilds (RFC 9113)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from podgate.proto import h2frames as h2
from podgate.proto.errors import ProtocolError


def frame_bytes() -> bytes:
    return (
        h2.encode_frame(h2.SETTINGS, 0, 0, b"\x00\x01\x00\x00\x10\x00")
        + h2.encode_frame(h2.HEADERS, h2.END_HEADERS, 1, b"\x82\x86")
        + h2.encode_frame(h2.DATA, h2.END_STREAM, 1, h2.encode_grpc_message(b"hello"))
    )


@given(st.lists(st.integers(min_value=1, max_value=40), max_size=20))
def test_frames_come_out_whole_however_the_bytes_are_cut(cuts: list[int]) -> None:
    data = h2.PREFACE + frame_bytes()
    splitter = h2.FrameSplitter(preface=True)
    preface, frames, pos = b"", [], 0
    for cut in [*cuts, len(data)]:
        got_preface, got = splitter.feed(data[pos : pos + cut])
        preface += got_preface
        frames += [(f.type, f.flags, f.stream_id, bytes(f.payload), bytes(f.raw)) for f in got]
        pos += cut
        if pos >= len(data):
            break
    assert preface == h2.PREFACE
    assert b"".join(raw for *_, raw in frames) == frame_bytes()
    assert [(t, s) for t, _, s, _, _ in frames] == [(h2.SETTINGS, 0), (h2.HEADERS, 1), (h2.DATA, 1)]
    assert h2.grpc_message(frames[2][3]) == (False, b"hello")


def test_a_connection_that_is_not_http2_is_refused() -> None:
    with pytest.raises(ProtocolError, match="preface"):
        h2.FrameSplitter(preface=True).feed(b"GET / HTTP/1.1\r\n\r\n")


def test_a_frame_longer_than_allowed_is_refused() -> None:
    splitter = h2.FrameSplitter(max_payload=16)
    with pytest.raises(ProtocolError, match="exceeds"):
        splitter.feed(h2.encode_frame(h2.DATA, 0, 1, bytes(17)))


@pytest.mark.parametrize(("data", "flow"), [(b"abc", 3), (b"abc", 4), (b"abc", 40), (b"", 1000)])
def test_rebuilt_data_frames_count_exactly_the_original_flow(data: bytes, flow: int) -> None:
    out = h2.data_frames_like(3, data, flow, end_stream=True)
    _, frames = h2.FrameSplitter().feed(out)
    assert sum(len(f.payload) for f in frames) == flow  # what flow control counts
    assert b"".join(bytes(h2.data_of(f)) for f in frames) == data
    assert [f.end_stream for f in frames] == [False] * (len(frames) - 1) + [True]
    assert all(f.type == h2.DATA and f.stream_id == 3 for f in frames)


def test_data_longer_than_the_flow_cannot_be_padded() -> None:
    with pytest.raises(ValueError):
        h2.data_frames_like(1, b"abcd", 3, end_stream=False)


def test_padding_and_priority_are_stripped() -> None:
    padded = h2.encode_frame(h2.DATA, h2.PADDED, 1, b"\x02xy\x00\x00")
    (frame,) = h2.FrameSplitter().feed(padded)[1]
    assert bytes(h2.data_of(frame)) == b"xy"
    headers = h2.encode_frame(
        h2.HEADERS, h2.PADDED | h2.PRIORITY | h2.END_HEADERS, 1, b"\x01" + bytes(5) + b"\x82\x00"
    )
    (frame,) = h2.FrameSplitter().feed(headers)[1]
    assert bytes(h2.header_fragment(frame)) == b"\x82"
    bad = h2.encode_frame(h2.DATA, h2.PADDED, 1, b"\x05x")
    (frame,) = h2.FrameSplitter().feed(bad)[1]
    with pytest.raises(ProtocolError):
        h2.data_of(frame)


def test_settings_and_window_updates() -> None:
    settings = h2.encode_frame(
        h2.SETTINGS, 0, 0, b"\x00\x01\x00\x00\x20\x00\x00\x04\x00\x01\x00\x00"
    )
    (frame,) = h2.FrameSplitter().feed(settings)[1]
    assert h2.header_table_size(frame) == 8192
    ack = h2.encode_frame(h2.SETTINGS, h2.ACK, 0, b"")
    (frame,) = h2.FrameSplitter().feed(ack)[1]
    assert h2.header_table_size(frame) is None
    (frame,) = h2.FrameSplitter().feed(h2.encode_window_update(0, 12345))[1]
    assert h2.window_increment(frame) == 12345


def test_grpc_messages_need_all_their_bytes() -> None:
    whole = h2.encode_grpc_message(b"abc")
    assert h2.grpc_message(whole[:-1]) is None
    assert h2.grpc_message(whole) == (False, b"abc")
    assert h2.grpc_message(b"\x01" + whole[1:]) == (True, b"abc")


@given(st.lists(st.integers(min_value=1, max_value=40), max_size=20))
def test_split_hands_out_every_completed_byte_in_order(cuts: list[int]) -> None:
    data = h2.PREFACE + frame_bytes()
    splitter = h2.FrameSplitter(preface=True)
    out, pos = b"", 0
    for cut in [*cuts, len(data)]:
        whole, frames = splitter.split(data[pos : pos + cut])
        # The completed bytes are the frames' own (after the preface, once it is whole).
        assert bytes(whole).endswith(b"".join(bytes(f.raw) for f in frames))
        out += bytes(whole)
        pos += cut
        if pos >= len(data):
            break
    assert out == data


@given(st.lists(st.integers(min_value=1, max_value=40), max_size=20))
def test_split_hands_out_only_the_kinds_asked_for_but_every_byte(cuts: list[int]) -> None:
    # An unknown frame type (0xfa) and a stream id with the reserved bit set pass as they are.
    unknown = h2.encode_frame(0xFA, 0x3, 5, b"extension")
    reserved = bytearray(h2.encode_frame(h2.HEADERS, h2.END_HEADERS, 7, b"\x82"))
    reserved[5] |= 0x80
    data = h2.PREFACE + frame_bytes() + unknown + bytes(reserved)
    splitter = h2.FrameSplitter(preface=True)
    wanted = h2.kinds(h2.HEADERS, 0xFA)
    out, frames, pos = b"", [], 0
    for cut in [*cuts, len(data)]:
        whole, got = splitter.split(data[pos : pos + cut], wanted)
        out += bytes(whole)
        frames += [(f.type, f.flags, f.stream_id, bytes(f.payload), bytes(f.raw)) for f in got]
        pos += cut
        if pos >= len(data):
            break
    assert out == data
    assert frames == [
        (
            h2.HEADERS,
            h2.END_HEADERS,
            1,
            b"\x82\x86",
            h2.encode_frame(h2.HEADERS, 4, 1, b"\x82\x86"),
        ),
        (0xFA, 0x3, 5, b"extension", unknown),
        (h2.HEADERS, h2.END_HEADERS, 7, b"\x82", bytes(reserved)),
    ]


def test_a_read_of_whole_frames_is_handed_back_as_it_came() -> None:
    data = frame_bytes()
    whole, frames = h2.FrameSplitter().split(data, h2.kinds(h2.SETTINGS))
    assert whole is data
    assert [f.type for f in frames] == [h2.SETTINGS]
    assert h2.FrameSplitter().split(data, 0) == (data, [])


def test_a_long_frame_arriving_in_pieces_comes_out_once() -> None:
    frame = h2.encode_frame(h2.DATA, 0, 1, bytes(range(256)) * 64)
    splitter = h2.FrameSplitter()
    pieces = [frame[i : i + 1000] for i in range(0, len(frame), 1000)]
    got = [splitter.split(piece) for piece in pieces]
    assert [len(frames) for _, frames in got] == [0] * (len(pieces) - 1) + [1]
    whole, (only,) = got[-1]
    assert bytes(whole) == bytes(only.raw) == frame


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        (b"\x82\x86\x84", True),  # static-table indices
        (b"\xbe\xbf", True),  # dynamic-table indices
        (b"\xff\x81\x01", True),  # an index continued over two more bytes (RFC 7541 §5.1)
        (b"", True),
        (b"\x82\x44\x03abc", False),  # a literal that enters the dynamic table
        (b"\x82\x04\x03abc", False),  # a literal outside it
        (b"\x3f\xe1\x1f", False),  # a dynamic table size update
        (b"\x82\xff\x80", False),  # an index cut short
    ],
)
def test_blocks_of_indexed_fields_alone_are_recognised(block: bytes, expected: bool) -> None:
    assert h2.only_indexed(block) is expected
