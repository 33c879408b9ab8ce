"""Events a ttrpc connection emits. Frozen dataclasses; the driver matches on type."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from podgate.proto.ttrpc.frames import FLAG_REMOTE_CLOSED, FLAG_REMOTE_OPEN

__all__ = [
    "ConnectionClosed",
    "DataReceived",
    "Event",
    "RequestMode",
    "RequestReceived",
    "ResponseReceived",
    "StreamAborted",
]


class RequestMode(Enum):
    """How the client uses a stream; the value is the Request frame's flags."""

    UNARY = 0x00  # one request, one Response
    SERVER_STREAMING = FLAG_REMOTE_CLOSED  # the client sends nothing after the request
    CLIENT_STREAMING = FLAG_REMOTE_OPEN  # the client streams Data (also bidirectional calls)

    @classmethod
    def from_flags(cls, flags: int) -> RequestMode:
        if flags & FLAG_REMOTE_OPEN:
            return cls.CLIENT_STREAMING
        if flags & FLAG_REMOTE_CLOSED:
            return cls.SERVER_STREAMING
        return cls.UNARY


@dataclass(frozen=True, slots=True)
class Event:
    pass


@dataclass(frozen=True, slots=True)
class RequestReceived(Event):
    """Server: a client opened a stream. `timeout_nano` 0 means no deadline."""

    stream_id: int
    service: str
    method: str
    payload: bytes
    timeout_nano: int = 0
    metadata: tuple[tuple[str, str], ...] = ()
    mode: RequestMode = RequestMode.UNARY


@dataclass(frozen=True, slots=True)
class ResponseReceived(Event):
    """Client: a call finished. `code` 0 is OK. The stream is forgotten."""

    stream_id: int
    code: int
    message: str
    payload: bytes


@dataclass(frozen=True, slots=True)
class DataReceived(Event):
    """A Data frame. `payload` None is the no-data flag (a bare close), b"" an empty message;
    `end` means the peer sends nothing more on the stream."""

    stream_id: int
    payload: bytes | None
    end: bool = False


@dataclass(frozen=True, slots=True)
class StreamAborted(Event):
    """Server: the core answered a live stream with this error status itself (the client broke a
    stream rule, or sent an oversized frame on it). The stream is gone: stop its handler."""

    stream_id: int
    code: int
    message: str


@dataclass(frozen=True, slots=True)
class ConnectionClosed(Event):
    """The byte stream ended cleanly (receive_eof between frames)."""
