"""Events the WebSocket channel and tunnel connections emit."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Event:
    pass


@dataclass(frozen=True, slots=True)
class ChannelData(Event):
    """One message's payload. Empty data is the one-byte "ready" message upstream sends."""

    channel: int
    data: bytes


@dataclass(frozen=True, slots=True)
class ChannelClosed(Event):
    """v5: the peer sent [0xFF, channel], so that input has ended (stdin EOF)."""

    channel: int


@dataclass(frozen=True, slots=True)
class TunnelData(Event):
    """The next bytes of the SPDY stream carried inside the tunnel (never empty)."""

    data: bytes


@dataclass(frozen=True, slots=True)
class CloseReceived(Event):
    """The peer closed the WebSocket; the close reply is already queued.

    Code 1006 means the byte stream ended without a close frame (see receive_eof).
    """

    code: int
    reason: str


@dataclass(frozen=True, slots=True)
class PingReceived(Event):
    """The peer pinged; the pong is already queued."""

    payload: bytes


@dataclass(frozen=True, slots=True)
class PongReceived(Event):
    payload: bytes
