"""SPDY/3 frame layout: constants, header codec and pure per-type encoders/decoders.

Frames carry header blocks already compressed (see `headers.py`); nothing here keeps state.
Decoders raise `SpdyConnectionError` because every framing fault is fatal in spdystream.
Encoders raise `LocalProtocolError` for values the wire cannot carry.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum
from typing import TypeAlias

from podgate.proto.errors import LocalProtocolError
from podgate.proto.spdy.errors import SpdyConnectionError

__all__ = [
    "FLAG_FIN",
    "FLAG_SETTINGS_CLEAR_SETTINGS",
    "FLAG_UNIDIRECTIONAL",
    "FRAME_HEADER_LENGTH",
    "MAX_CONTROL_FRAME_LENGTH",
    "MAX_FRAME_LENGTH",
    "MAX_PING_ID",
    "MAX_STREAM_ID",
    "SETTINGS_FLAG_PERSISTED",
    "SETTINGS_FLAG_PERSIST_VALUE",
    "VERSION",
    "BytesLike",
    "ControlFrame",
    "ControlFrameHeader",
    "ControlType",
    "DataFrameHeader",
    "GoAwayFrame",
    "GoAwayStatus",
    "HeadersFrame",
    "PingFrame",
    "RstStatus",
    "RstStreamFrame",
    "SettingsEntry",
    "SettingsFrame",
    "SettingsId",
    "SynReplyFrame",
    "SynStreamFrame",
    "WindowUpdateFrame",
    "decode_frame_header",
    "encode_control_header",
    "encode_data",
    "encode_data_header",
    "encode_goaway",
    "encode_headers",
    "encode_ping",
    "encode_rst_stream",
    "encode_settings",
    "encode_syn_reply",
    "encode_syn_stream",
    "encode_window_update",
    "parse_control_frame",
]

BytesLike: TypeAlias = bytes | bytearray | memoryview

VERSION = 3  # SPDY draft 3 framing; Kubernetes calls it "SPDY/3.1" but uses none of 3.1
FRAME_HEADER_LENGTH = 8  # bytes; the same size for control and data frames
MAX_FRAME_LENGTH = 2**24 - 1  # bytes; the length field is 24 bits
# bytes; k8s peers only put tiny header blocks in control frames, so a bigger one is an attack
# on our buffering (we must hold a whole control frame before we can parse it).
MAX_CONTROL_FRAME_LENGTH = 1 << 20
MAX_STREAM_ID = 0x7FFFFFFF  # stream ids are 31 bits; the top bit is reserved
MAX_PING_ID = 0xFFFFFFFF  # ping ids are a full uint32
_MAX_UINT32 = 0xFFFFFFFF
_MAX_PRIORITY = 7  # SPDY/3 priority is 3 bits

FLAG_FIN = 0x01  # SYN_STREAM, SYN_REPLY, HEADERS and DATA
FLAG_UNIDIRECTIONAL = 0x02  # SYN_STREAM only: the receiver's half starts closed
FLAG_SETTINGS_CLEAR_SETTINGS = 0x01  # SETTINGS frame flag
SETTINGS_FLAG_PERSIST_VALUE = 0x01  # per-entry SETTINGS flag
SETTINGS_FLAG_PERSISTED = 0x02  # per-entry SETTINGS flag

_CONTROL_BIT = 0x80000000
_HEADER = struct.Struct(">II")
_U32 = struct.Struct(">I")
_U32X2 = struct.Struct(">II")
_SYN_STREAM_FIXED = struct.Struct(">IIBB")  # stream id, associated id, priority<<5, slot
_SYN_STREAM_FIXED_LENGTH = 10
_STREAM_ID_FIXED_LENGTH = 4  # SYN_REPLY / HEADERS: stream id, then the header block
_SETTINGS_ENTRY_LENGTH = 8


class ControlType(IntEnum):
    """The control frame types spdystream understands. 5 (NOOP) and 10 (CREDENTIAL) are absent
    on purpose: spdystream treats them as unknown and drops the connection."""

    SYN_STREAM = 1
    SYN_REPLY = 2
    RST_STREAM = 3
    SETTINGS = 4
    PING = 6
    GOAWAY = 7
    HEADERS = 8
    WINDOW_UPDATE = 9


class RstStatus(IntEnum):
    PROTOCOL_ERROR = 1
    INVALID_STREAM = 2
    REFUSED_STREAM = 3
    UNSUPPORTED_VERSION = 4
    CANCEL = 5
    INTERNAL_ERROR = 6
    FLOW_CONTROL_ERROR = 7
    STREAM_IN_USE = 8
    STREAM_ALREADY_CLOSED = 9
    INVALID_CREDENTIALS = 10
    FRAME_TOO_LARGE = 11


class GoAwayStatus(IntEnum):
    OK = 0
    PROTOCOL_ERROR = 1
    INTERNAL_ERROR = 2


class SettingsId(IntEnum):
    UPLOAD_BANDWIDTH = 1
    DOWNLOAD_BANDWIDTH = 2
    ROUND_TRIP_TIME = 3
    MAX_CONCURRENT_STREAMS = 4
    CURRENT_CWND = 5
    DOWNLOAD_RETRANS_RATE = 6
    INITIAL_WINDOW_SIZE = 7
    CLIENT_CERTIFICATE_VECTOR_SIZE = 8


# --- frame headers -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ControlFrameHeader:
    version: int
    type: int
    flags: int
    length: int


@dataclass(frozen=True, slots=True)
class DataFrameHeader:
    stream_id: int
    flags: int
    length: int


def decode_frame_header(data: BytesLike, offset: int = 0) -> ControlFrameHeader | DataFrameHeader:
    """Decode the 8-byte header at `offset` (the caller ensures 8 bytes are there).

    The version is returned, not checked: spdystream does not validate it on read.
    """
    first, second = _HEADER.unpack_from(data, offset)
    flags = second >> 24
    length = second & 0xFFFFFF
    if first & _CONTROL_BIT:
        return ControlFrameHeader((first >> 16) & 0x7FFF, first & 0xFFFF, flags, length)
    return DataFrameHeader(first & MAX_STREAM_ID, flags, length)


def encode_control_header(frame_type: int, flags: int, length: int) -> bytes:
    _check_range("frame type", frame_type, 0, 0xFFFF)
    _check_flags(flags)
    _check_range("frame length", length, 0, MAX_FRAME_LENGTH)
    return _HEADER.pack(_CONTROL_BIT | (VERSION << 16) | frame_type, (flags << 24) | length)


def encode_data_header(stream_id: int, length: int, *, flags: int = 0) -> bytes:
    _check_stream_id(stream_id)
    _check_flags(flags)
    _check_range("frame length", length, 0, MAX_FRAME_LENGTH)
    return _HEADER.pack(stream_id, (flags << 24) | length)


# --- control frame bodies ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SynStreamFrame:
    stream_id: int
    header_block: BytesLike
    flags: int = 0
    associated_to: int = 0
    priority: int = 0
    slot: int = 0


@dataclass(frozen=True, slots=True)
class SynReplyFrame:
    stream_id: int
    header_block: BytesLike
    flags: int = 0


@dataclass(frozen=True, slots=True)
class RstStreamFrame:
    stream_id: int
    status: int


@dataclass(frozen=True, slots=True)
class SettingsEntry:
    id: int
    value: int
    flags: int = 0


@dataclass(frozen=True, slots=True)
class SettingsFrame:
    entries: tuple[SettingsEntry, ...]
    flags: int = 0


@dataclass(frozen=True, slots=True)
class PingFrame:
    ping_id: int


@dataclass(frozen=True, slots=True)
class GoAwayFrame:
    last_good_stream_id: int
    status: int


@dataclass(frozen=True, slots=True)
class HeadersFrame:
    stream_id: int
    header_block: BytesLike
    flags: int = 0


@dataclass(frozen=True, slots=True)
class WindowUpdateFrame:
    stream_id: int
    delta: int


ControlFrame: TypeAlias = (
    SynStreamFrame
    | SynReplyFrame
    | RstStreamFrame
    | SettingsFrame
    | PingFrame
    | GoAwayFrame
    | HeadersFrame
    | WindowUpdateFrame
)


def parse_control_frame(header: ControlFrameHeader, payload: BytesLike) -> ControlFrame:
    """Decode one control frame body (exactly `header.length` bytes).

    Header blocks are returned as slices of `payload` (a memoryview stays a view), still
    compressed. Enforces spdystream's fatal rules that need no connection state.
    """
    if len(payload) != header.length:
        raise ValueError("payload length does not match the frame header")
    kind = header.type
    if kind == ControlType.SYN_STREAM:
        if header.length < _SYN_STREAM_FIXED_LENGTH:
            raise _fatal("SYN_STREAM too short")
        sid, assoc, prio, slot = _SYN_STREAM_FIXED.unpack_from(payload)
        sid &= MAX_STREAM_ID
        if sid == 0:
            raise _fatal("SYN_STREAM with stream id 0")
        return SynStreamFrame(
            sid,
            payload[_SYN_STREAM_FIXED_LENGTH:],
            header.flags,
            assoc & MAX_STREAM_ID,
            prio >> 5,
            slot,
        )
    if kind in (ControlType.SYN_REPLY, ControlType.HEADERS):
        name = ControlType(kind).name
        if header.length < _STREAM_ID_FIXED_LENGTH:
            raise _fatal(f"{name} too short")
        sid = _U32.unpack_from(payload)[0] & MAX_STREAM_ID
        if sid == 0:
            raise _fatal(f"{name} with stream id 0")
        block = payload[_STREAM_ID_FIXED_LENGTH:]
        if kind == ControlType.SYN_REPLY:
            return SynReplyFrame(sid, block, header.flags)
        return HeadersFrame(sid, block, header.flags)
    if kind == ControlType.RST_STREAM:
        # spdystream reads 8 bytes whatever the length says; any other length desyncs the stream.
        _check_exact_length("RST_STREAM", header, 8)
        sid, status = _U32X2.unpack_from(payload)
        sid &= MAX_STREAM_ID
        if status == 0:
            raise _fatal("RST_STREAM with status 0")
        if sid == 0:
            raise _fatal("RST_STREAM with stream id 0")
        return RstStreamFrame(sid, status)
    if kind == ControlType.SETTINGS:
        if header.length < 4:
            raise _fatal("SETTINGS too short")
        count = _U32.unpack_from(payload)[0]
        # Compare against the bytes present before building anything from `count`.
        if header.length != 4 + count * _SETTINGS_ENTRY_LENGTH:
            raise _fatal("SETTINGS entry count does not match the frame length")
        entries = tuple(
            SettingsEntry(word & 0xFFFFFF, value, word >> 24)
            for word, value in _U32X2.iter_unpack(payload[4:])
        )
        return SettingsFrame(entries, header.flags)
    if kind == ControlType.PING:
        _check_exact_length("PING", header, 4)
        if header.flags != 0:
            raise _fatal("PING with flags set")
        ping_id = _U32.unpack_from(payload)[0]
        if ping_id == 0:
            raise _fatal("PING with id 0")
        return PingFrame(ping_id)
    if kind == ControlType.GOAWAY:
        _check_exact_length("GOAWAY", header, 8)
        if header.flags != 0:
            raise _fatal("GOAWAY with flags set")
        last_good, status = _U32X2.unpack_from(payload)
        return GoAwayFrame(last_good & MAX_STREAM_ID, status)
    if kind == ControlType.WINDOW_UPDATE:
        _check_exact_length("WINDOW_UPDATE", header, 8)
        if header.flags != 0:
            raise _fatal("WINDOW_UPDATE with flags set")
        sid, delta = _U32X2.unpack_from(payload)
        return WindowUpdateFrame(sid & MAX_STREAM_ID, delta & 0x7FFFFFFF)
    raise _fatal(f"unknown control frame type {kind}")


def _check_exact_length(name: str, header: ControlFrameHeader, expected: int) -> None:
    if header.length != expected:
        raise _fatal(f"{name} length {header.length}, expected {expected}")


def _fatal(message: str) -> SpdyConnectionError:
    return SpdyConnectionError(message, GoAwayStatus.PROTOCOL_ERROR)


def encode_syn_stream(
    stream_id: int,
    header_block: BytesLike,
    *,
    flags: int = 0,
    associated_to: int = 0,
    priority: int = 0,
    slot: int = 0,
) -> bytes:
    _check_stream_id(stream_id)
    _check_range("associated stream id", associated_to, 0, MAX_STREAM_ID)
    _check_range("priority", priority, 0, _MAX_PRIORITY)
    _check_range("slot", slot, 0, 0xFF)
    length = _SYN_STREAM_FIXED_LENGTH + len(header_block)
    return b"".join(
        (
            encode_control_header(ControlType.SYN_STREAM, flags, length),
            _SYN_STREAM_FIXED.pack(stream_id, associated_to, priority << 5, slot),
            header_block,
        )
    )


def encode_syn_reply(stream_id: int, header_block: BytesLike, *, flags: int = 0) -> bytes:
    return _encode_stream_block(ControlType.SYN_REPLY, stream_id, header_block, flags)


def encode_headers(stream_id: int, header_block: BytesLike, *, flags: int = 0) -> bytes:
    """Encode a HEADERS frame. Never send one to a Go peer (see the reference, §1.7); this
    exists so that tests can produce what a peer might send."""
    return _encode_stream_block(ControlType.HEADERS, stream_id, header_block, flags)


def _encode_stream_block(kind: ControlType, stream_id: int, block: BytesLike, flags: int) -> bytes:
    _check_stream_id(stream_id)
    length = _STREAM_ID_FIXED_LENGTH + len(block)
    return b"".join((encode_control_header(kind, flags, length), _U32.pack(stream_id), block))


def encode_rst_stream(stream_id: int, status: int) -> bytes:
    _check_stream_id(stream_id)
    _check_range("RST_STREAM status", status, 1, _MAX_UINT32)
    return encode_control_header(ControlType.RST_STREAM, 0, 8) + _U32X2.pack(stream_id, status)


def encode_settings(entries: Iterable[SettingsEntry], *, flags: int = 0) -> bytes:
    body = bytearray()
    count = 0
    for entry in entries:
        _check_range("settings id", entry.id, 0, 0xFFFFFF)
        _check_flags(entry.flags)
        _check_range("settings value", entry.value, 0, _MAX_UINT32)
        body += _U32X2.pack((entry.flags << 24) | entry.id, entry.value)
        count += 1
    header = encode_control_header(ControlType.SETTINGS, flags, 4 + len(body))
    return header + _U32.pack(count) + body


def encode_ping(ping_id: int) -> bytes:
    _check_range("ping id", ping_id, 1, MAX_PING_ID)
    return encode_control_header(ControlType.PING, 0, 4) + _U32.pack(ping_id)


def encode_goaway(last_good_stream_id: int, status: int) -> bytes:
    _check_range("last-good stream id", last_good_stream_id, 0, MAX_STREAM_ID)
    _check_range("GOAWAY status", status, 0, _MAX_UINT32)
    return encode_control_header(ControlType.GOAWAY, 0, 8) + _U32X2.pack(
        last_good_stream_id, status
    )


def encode_window_update(stream_id: int, delta: int) -> bytes:
    _check_range("stream id", stream_id, 0, MAX_STREAM_ID)
    _check_range("window delta", delta, 1, 0x7FFFFFFF)
    return encode_control_header(ControlType.WINDOW_UPDATE, 0, 8) + _U32X2.pack(stream_id, delta)


def encode_data(stream_id: int, data: BytesLike, *, flags: int = 0) -> bytes:
    """One whole DATA frame (header and payload joined). The connection queues the two parts
    separately instead, to avoid copying large payloads."""
    return encode_data_header(stream_id, len(data), flags=flags) + bytes(data)


def _check_stream_id(stream_id: int) -> None:
    _check_range("stream id", stream_id, 1, MAX_STREAM_ID)


def _check_flags(flags: int) -> None:
    _check_range("flags", flags, 0, 0xFF)


def _check_range(what: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise LocalProtocolError(f"{what} {value} outside {low}..{high}")
