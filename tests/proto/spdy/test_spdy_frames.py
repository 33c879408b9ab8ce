"""Frame codec tables. Expected bytes are written out from the layout in the reference (§1.1,
§1.2) or copied from the kubectl trace (§1.5), never produced by the code under test."""

from __future__ import annotations

import pytest
from spdy_support import h

from podgate.proto.errors import LocalProtocolError
from podgate.proto.spdy import SpdyConnectionError
from podgate.proto.spdy.frames import (
    FLAG_FIN,
    FLAG_UNIDIRECTIONAL,
    SETTINGS_FLAG_PERSIST_VALUE,
    ControlFrame,
    ControlFrameHeader,
    DataFrameHeader,
    GoAwayFrame,
    GoAwayStatus,
    HeadersFrame,
    PingFrame,
    RstStatus,
    RstStreamFrame,
    SettingsEntry,
    SettingsFrame,
    SettingsId,
    SynReplyFrame,
    SynStreamFrame,
    WindowUpdateFrame,
    decode_frame_header,
    encode_data,
    encode_data_header,
    encode_goaway,
    encode_headers,
    encode_ping,
    encode_rst_stream,
    encode_settings,
    encode_syn_reply,
    encode_syn_stream,
    encode_window_update,
    parse_control_frame,
)


def test_constant_values() -> None:
    assert [int(s) for s in RstStatus] == list(range(1, 12))
    assert int(RstStatus.CANCEL) == 5
    assert int(RstStatus.STREAM_ALREADY_CLOSED) == 9
    assert [int(s) for s in GoAwayStatus] == [0, 1, 2]
    assert int(SettingsId.MAX_CONCURRENT_STREAMS) == 4
    assert int(SettingsId.INITIAL_WINDOW_SIZE) == 7
    assert (FLAG_FIN, FLAG_UNIDIRECTIONAL) == (1, 2)


# (wire bytes, encoded by, decoded frame)
CONTROL_TABLE: list[tuple[str, bytes, ControlFrame]] = [
    (
        "syn_stream",
        h("80 03 00 01 00 00 00 0c | 00 00 00 01 | 00 00 00 00 | 00 | 00 | aa bb"),
        SynStreamFrame(1, b"\xaa\xbb"),
    ),
    (
        "syn_stream all fields",
        h("80 03 00 01 03 00 00 0b | 00 00 00 07 | 00 00 00 05 | e0 | 09 | cc"),
        SynStreamFrame(7, b"\xcc", FLAG_FIN | FLAG_UNIDIRECTIONAL, 5, 7, 9),
    ),
    (
        "syn_reply",
        h("80 03 00 02 00 00 00 05 | 00 00 00 03 | aa"),
        SynReplyFrame(3, b"\xaa"),
    ),
    (
        "syn_reply fin",
        h("80 03 00 02 01 00 00 04 | 7f ff ff ff"),
        SynReplyFrame(0x7FFFFFFF, b"", FLAG_FIN),
    ),
    (
        "rst_stream (kubectl trace)",
        h("80 03 00 03 00 00 00 08 00 00 00 05 00 00 00 05"),
        RstStreamFrame(5, RstStatus.CANCEL),
    ),
    (
        "settings",
        h("80 03 00 04 00 00 00 0c | 00 00 00 01 | 01 00 00 04 | 00 00 00 64"),
        SettingsFrame((SettingsEntry(4, 100, SETTINGS_FLAG_PERSIST_VALUE),)),
    ),
    (
        "settings empty, clear flag",
        h("80 03 00 04 01 00 00 04 | 00 00 00 00"),
        SettingsFrame((), 1),
    ),
    (
        "ping (kubectl trace)",
        h("80 03 00 06 00 00 00 04 00 00 00 01"),
        PingFrame(1),
    ),
    (
        "ping max id",
        h("80 03 00 06 00 00 00 04 ff ff ff ff"),
        PingFrame(0xFFFFFFFF),
    ),
    (
        "goaway (kubectl trace)",
        h("80 03 00 07 00 00 00 08 00 00 00 00 00 00 00 00"),
        GoAwayFrame(0, GoAwayStatus.OK),
    ),
    (
        "goaway protocol error",
        h("80 03 00 07 00 00 00 08 00 00 00 03 00 00 00 01"),
        GoAwayFrame(3, GoAwayStatus.PROTOCOL_ERROR),
    ),
    (
        "headers",
        h("80 03 00 08 00 00 00 05 | 00 00 00 01 | aa"),
        HeadersFrame(1, b"\xaa"),
    ),
    (
        "window_update",
        h("80 03 00 09 00 00 00 08 | 00 00 00 01 | 00 01 00 00"),
        WindowUpdateFrame(1, 65536),
    ),
]


def _encode(frame: ControlFrame) -> bytes:
    if isinstance(frame, SynStreamFrame):
        return encode_syn_stream(
            frame.stream_id,
            frame.header_block,
            flags=frame.flags,
            associated_to=frame.associated_to,
            priority=frame.priority,
            slot=frame.slot,
        )
    if isinstance(frame, SynReplyFrame):
        return encode_syn_reply(frame.stream_id, frame.header_block, flags=frame.flags)
    if isinstance(frame, RstStreamFrame):
        return encode_rst_stream(frame.stream_id, frame.status)
    if isinstance(frame, SettingsFrame):
        return encode_settings(frame.entries, flags=frame.flags)
    if isinstance(frame, PingFrame):
        return encode_ping(frame.ping_id)
    if isinstance(frame, GoAwayFrame):
        return encode_goaway(frame.last_good_stream_id, frame.status)
    if isinstance(frame, HeadersFrame):
        return encode_headers(frame.stream_id, frame.header_block, flags=frame.flags)
    return encode_window_update(frame.stream_id, frame.delta)


@pytest.mark.parametrize(
    ("wire", "frame"), [row[1:] for row in CONTROL_TABLE], ids=[row[0] for row in CONTROL_TABLE]
)
def test_control_frame_encode(wire: bytes, frame: ControlFrame) -> None:
    assert _encode(frame) == wire


@pytest.mark.parametrize(
    ("wire", "frame"), [row[1:] for row in CONTROL_TABLE], ids=[row[0] for row in CONTROL_TABLE]
)
def test_control_frame_decode(wire: bytes, frame: ControlFrame) -> None:
    header = decode_frame_header(wire)
    assert isinstance(header, ControlFrameHeader)
    assert header.version == 3
    assert header.length == len(wire) - 8
    assert parse_control_frame(header, wire[8:]) == frame


def test_decode_keeps_memoryview_slices_as_views() -> None:
    wire = CONTROL_TABLE[0][1]
    view = memoryview(wire)
    header = decode_frame_header(view)
    assert isinstance(header, ControlFrameHeader)
    frame = parse_control_frame(header, view[8:])
    assert isinstance(frame, SynStreamFrame)
    assert isinstance(frame.header_block, memoryview)
    assert bytes(frame.header_block) == b"\xaa\xbb"


def test_reserved_bits_are_masked_and_version_is_not_checked() -> None:
    # Version 2 in the header, reserved bit set in the stream id: spdystream ignores both.
    wire = h("80 02 00 03 00 00 00 08 80 00 00 05 00 00 00 05")
    header = decode_frame_header(wire)
    assert header == ControlFrameHeader(2, 3, 0, 8)
    assert isinstance(header, ControlFrameHeader)
    assert parse_control_frame(header, wire[8:]) == RstStreamFrame(5, 5)
    assert decode_frame_header(h("ff ff ff ff 01 00 00 00")) == ControlFrameHeader(
        0x7FFF, 0xFFFF, 1, 0
    )


DATA_TABLE = [
    (h("00 00 00 01 01 00 00 00"), 1, b"", FLAG_FIN),  # kubectl half-close
    (h("00 00 00 03 00 00 00 02 68 69"), 3, b"hi", 0),
    (h("7f ff ff ff 01 00 00 01 00"), 0x7FFFFFFF, b"\x00", FLAG_FIN),
]


@pytest.mark.parametrize(("wire", "sid", "payload", "flags"), DATA_TABLE)
def test_data_frame_table(wire: bytes, sid: int, payload: bytes, flags: int) -> None:
    assert encode_data(sid, payload, flags=flags) == wire
    assert encode_data_header(sid, len(payload), flags=flags) == wire[:8]
    assert decode_frame_header(wire) == DataFrameHeader(sid, flags, len(payload))


def test_data_header_max_length() -> None:
    assert encode_data_header(1, 2**24 - 1) == h("00 00 00 01 00 ff ff ff")
    assert decode_frame_header(h("00 00 00 01 00 ff ff ff")) == DataFrameHeader(1, 0, 2**24 - 1)


FATAL_TABLE = [
    ("syn_stream too short", "80 03 00 01 00 00 00 09 00 00 00 01 00 00 00 00 00"),
    ("syn_stream id 0", "80 03 00 01 00 00 00 0a 00 00 00 00 00 00 00 00 00 00"),
    ("syn_reply too short", "80 03 00 02 00 00 00 03 00 00 01"),
    ("syn_reply id 0", "80 03 00 02 00 00 00 04 00 00 00 00"),
    ("headers id 0", "80 03 00 08 00 00 00 04 80 00 00 00"),
    ("rst status 0", "80 03 00 03 00 00 00 08 00 00 00 01 00 00 00 00"),
    ("rst stream 0", "80 03 00 03 00 00 00 08 00 00 00 00 00 00 00 05"),
    ("rst short", "80 03 00 03 00 00 00 04 00 00 00 01"),
    ("rst long", "80 03 00 03 00 00 00 0c 00 00 00 01 00 00 00 05 00 00 00 00"),
    ("settings short", "80 03 00 04 00 00 00 02 00 00"),
    ("settings count too big", "80 03 00 04 00 00 00 0c 00 00 00 02 01 00 00 04 00 00 00 64"),
    ("settings count 2**32-1", "80 03 00 04 00 00 00 04 ff ff ff ff"),
    ("ping id 0", "80 03 00 06 00 00 00 04 00 00 00 00"),
    ("ping flags", "80 03 00 06 01 00 00 04 00 00 00 01"),
    ("ping long", "80 03 00 06 00 00 00 08 00 00 00 01 00 00 00 01"),
    ("goaway short", "80 03 00 07 00 00 00 04 00 00 00 00"),
    ("goaway flags", "80 03 00 07 01 00 00 08 00 00 00 00 00 00 00 00"),
    ("window_update long", "80 03 00 09 00 00 00 0c 00 00 00 01 00 00 00 01 00 00 00 00"),
    ("window_update flags", "80 03 00 09 01 00 00 08 00 00 00 01 00 00 00 01"),
    ("noop", "80 03 00 05 00 00 00 00"),
    ("credential", "80 03 00 0a 00 00 00 00"),
    ("unknown type", "80 03 ff ff 00 00 00 00"),
]


@pytest.mark.parametrize(
    "wire", [h(row[1]) for row in FATAL_TABLE], ids=[row[0] for row in FATAL_TABLE]
)
def test_fatal_control_frames(wire: bytes) -> None:
    header = decode_frame_header(wire)
    assert isinstance(header, ControlFrameHeader)
    with pytest.raises(SpdyConnectionError) as info:
        parse_control_frame(header, wire[8:])
    assert info.value.goaway_status == GoAwayStatus.PROTOCOL_ERROR


@pytest.mark.parametrize(
    "call",
    [
        lambda: encode_syn_stream(0, b""),
        lambda: encode_syn_stream(0x80000000, b""),
        lambda: encode_syn_stream(1, b"", priority=8),
        lambda: encode_syn_stream(1, b"", flags=256),
        lambda: encode_syn_reply(1, bytes(2**24 - 4)),
        lambda: encode_rst_stream(1, 0),
        lambda: encode_ping(0),
        lambda: encode_ping(2**32),
        lambda: encode_goaway(-1, 0),
        lambda: encode_window_update(1, 0),
        lambda: encode_data_header(1, 2**24),
        lambda: encode_settings([SettingsEntry(2**24, 0)]),
    ],
)
def test_encoders_refuse_unrepresentable_values(call: object) -> None:
    assert callable(call)
    with pytest.raises(LocalProtocolError):
        call()
