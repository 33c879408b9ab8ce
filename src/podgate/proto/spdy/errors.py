"""SPDY errors: connection errors carry the GOAWAY status that was queued for the peer."""

from __future__ import annotations

from typing import TYPE_CHECKING

from podgate.proto.errors import LocalProtocolError, RemoteProtocolError

if TYPE_CHECKING:
    from podgate.proto.spdy.events import Event

__all__ = ["SpdyConnectionError", "StreamClosedError"]

# Mirrors GoAwayStatus.PROTOCOL_ERROR without importing frames (frames imports this module).
_GOAWAY_PROTOCOL_ERROR = 1


class SpdyConnectionError(RemoteProtocolError):
    """The peer broke the framing or a connection-level rule; the connection is dead.

    `goaway_status` is the status of the GOAWAY queued for the peer. `events` holds the events
    parsed from the same `receive_data` call before the fault, so the driver can still deliver
    data that arrived intact (spdystream also delivers frames read before a read error).
    """

    def __init__(self, message: str, goaway_status: int = _GOAWAY_PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.goaway_status = goaway_status
        self.events: list[Event] = []


class StreamClosedError(LocalProtocolError):
    """We tried to use a stream that is already closed (reset by either side, or fully ended).

    Raised instead of the plain LocalProtocolError so a driver can tell "the peer reset it while
    we were busy" (a race to tolerate) from other misuse (a bug).
    """

    def __init__(self, message: str, stream_id: int) -> None:
        super().__init__(message)
        self.stream_id = stream_id
