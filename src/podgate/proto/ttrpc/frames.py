"""ttrpc framing (containerd/ttrpc channel.go) and the envelope codec (request.proto).

Every message is a 10-byte header (uint32 BE data length, uint32 BE stream id, uint8 type,
uint8 flags) followed by the data. Request and Response data are protobuf envelopes; Data frames
carry the method's own messages. Pure functions: nothing here keeps state.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum
from typing import TypeAlias

from google.protobuf.message import DecodeError

from podgate.proto.errors import LocalProtocolError
from podgate.proto.ttrpc import envelope_pb2, status_pb2
from podgate.proto.ttrpc.errors import Code, MalformedEnvelopeError, OversizedMessageError

__all__ = [
    "FLAG_NO_DATA",
    "FLAG_REMOTE_CLOSED",
    "FLAG_REMOTE_OPEN",
    "FRAMEABLE_LENGTH_LIMIT",
    "HEADER_LENGTH",
    "MAX_MESSAGE_LENGTH",
    "MAX_STREAM_ID",
    "MAX_TIMEOUT_NANO",
    "BytesLike",
    "FrameHeader",
    "MessageType",
    "ResponseEnvelope",
    "decode_header",
    "decode_request",
    "decode_response",
    "encode_frame",
    "encode_header",
    "encode_request",
    "encode_response",
]

BytesLike: TypeAlias = bytes | bytearray | memoryview

HEADER_LENGTH = 10  # bytes: length(4) + stream id(4) + type(1) + flags(1)
# bytes of data in one frame; containerd/ttrpc messageLengthMax (4 << 20). Bigger frames are
# skipped and answered with RESOURCE_EXHAUSTED on their stream.
MAX_MESSAGE_LENGTH = 4 << 20
# bytes; the limit is under 16 MiB, so the first length byte is reserved and always 0. A length
# at or above this is garbage rather than an oversized message: skipping it is not safe.
FRAMEABLE_LENGTH_LIMIT = 1 << 24
MAX_STREAM_ID = 0xFFFFFFFF  # stream ids are a uint32
MAX_TIMEOUT_NANO = 2**63 - 1  # ns; Request.timeout_nano is an int64
_MIN_TIMEOUT_NANO = -(2**63)
_HEADER = struct.Struct(">IIBB")

FLAG_REMOTE_CLOSED = 0x01  # Request and Data: the sender sends nothing more on this stream
FLAG_REMOTE_OPEN = 0x02  # Request: the client will stream Data frames after the request
FLAG_NO_DATA = 0x04  # Data: the frame carries no message (an empty message is length 0 without it)


class MessageType(IntEnum):
    REQUEST = 0x01
    RESPONSE = 0x02
    DATA = 0x03


@dataclass(frozen=True, slots=True)
class FrameHeader:
    length: int
    stream_id: int
    type: int  # raw byte: unknown types are skipped by the connection, as Go does
    flags: int


@dataclass(frozen=True, slots=True)
class ResponseEnvelope:
    """A decoded Response; a missing status is OK (Go servers omit it on success)."""

    code: int
    message: str
    payload: bytes


def encode_header(length: int, stream_id: int, message_type: int, flags: int = 0) -> bytes:
    _check_range("data length", length, 0, MAX_MESSAGE_LENGTH)
    _check_range("stream id", stream_id, 0, MAX_STREAM_ID)
    _check_range("message type", message_type, 0, 0xFF)
    _check_range("flags", flags, 0, 0xFF)
    return _HEADER.pack(length, stream_id, message_type, flags)


def decode_header(data: BytesLike, offset: int = 0) -> FrameHeader:
    """Decode the header at `offset` (the caller ensures 10 bytes are there)."""
    length, stream_id, message_type, flags = _HEADER.unpack_from(data, offset)
    return FrameHeader(length, stream_id, message_type, flags)


def encode_frame(stream_id: int, message_type: int, flags: int, data: BytesLike) -> bytes:
    """Header plus data; an oversized `data` raises OversizedMessageError (Go's send does too)."""
    if len(data) > MAX_MESSAGE_LENGTH:
        raise OversizedMessageError(len(data), MAX_MESSAGE_LENGTH)
    return encode_header(len(data), stream_id, message_type, flags) + bytes(data)


def encode_request(
    service: str,
    method: str,
    payload: BytesLike,
    *,
    timeout_nano: int = 0,
    metadata: Iterable[tuple[str, str]] = (),
) -> bytes:
    _check_range("timeout_nano", timeout_nano, _MIN_TIMEOUT_NANO, MAX_TIMEOUT_NANO)
    try:
        request = envelope_pb2.Request(
            service=service,
            method=method,
            payload=bytes(payload),
            timeout_nano=timeout_nano,
            metadata=[envelope_pb2.KeyValue(key=key, value=value) for key, value in metadata],
        )
        return request.SerializeToString()
    except (ValueError, TypeError) as exc:  # e.g. strings that are not encodable as UTF-8
        raise LocalProtocolError(f"cannot encode request: {exc}") from exc


def decode_request(data: BytesLike) -> envelope_pb2.Request:
    try:
        return envelope_pb2.Request.FromString(bytes(data))
    except DecodeError as exc:
        raise MalformedEnvelopeError(str(exc)) from exc


def encode_response(payload: BytesLike = b"", *, code: int = Code.OK, message: str = "") -> bytes:
    """An OK response without a message has no status field at all, as Go sends it; so an empty
    OK reply is zero bytes."""
    _check_range("status code", code, -(2**31), 2**31 - 1)
    try:
        response = envelope_pb2.Response(payload=bytes(payload))
        if code != Code.OK or message:
            response.status.CopyFrom(status_pb2.Status(code=code, message=message))
        return response.SerializeToString()
    except (ValueError, TypeError) as exc:
        raise LocalProtocolError(f"cannot encode response: {exc}") from exc


def decode_response(data: BytesLike) -> ResponseEnvelope:
    try:
        response = envelope_pb2.Response.FromString(bytes(data))
    except DecodeError as exc:
        raise MalformedEnvelopeError(str(exc)) from exc
    if not response.HasField("status"):
        return ResponseEnvelope(int(Code.OK), "", response.payload)
    return ResponseEnvelope(response.status.code, response.status.message, response.payload)


def _check_range(what: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise LocalProtocolError(f"{what} {value} out of range [{low}, {high}]")
