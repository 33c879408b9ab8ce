"""Events a SPDY connection emits. Frozen dataclasses; the driver matches on type."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Event:
    pass


@dataclass(frozen=True, slots=True)
class StreamOpened(Event):
    """The peer sent SYN_STREAM. `headers` maps lower-case names to values (NULs kept)."""

    stream_id: int
    headers: dict[str, str] = field(hash=False)
    fin: bool = False
    unidirectional: bool = False


@dataclass(frozen=True, slots=True)
class StreamReplied(Event):
    """The peer sent SYN_REPLY for a stream we opened."""

    stream_id: int
    headers: dict[str, str] = field(hash=False)
    fin: bool = False


@dataclass(frozen=True, slots=True)
class DataReceived(Event):
    """One DATA frame's payload (possibly empty). `fin` means the peer's half ended."""

    stream_id: int
    data: bytes
    fin: bool = False


@dataclass(frozen=True, slots=True)
class StreamReset(Event):
    """The peer sent RST_STREAM."""

    stream_id: int
    status: int


@dataclass(frozen=True, slots=True)
class PingReceived(Event):
    """The peer pinged us; the echo is already queued."""

    ping_id: int


@dataclass(frozen=True, slots=True)
class PingAcknowledged(Event):
    """The peer echoed one of our pings."""

    ping_id: int


@dataclass(frozen=True, slots=True)
class SettingsReceived(Event):
    settings: dict[int, int] = field(hash=False)


@dataclass(frozen=True, slots=True)
class WindowUpdateReceived(Event):
    """Parsed and otherwise ignored: without flow control the send window is treated as
    unlimited; with it, this is a connection-level (stream 0) update, which the extension does
    not use."""

    stream_id: int
    delta: int


@dataclass(frozen=True, slots=True)
class WindowUpdated(Event):
    """Flow control only: the peer granted `delta` more bytes on a live stream's send window."""

    stream_id: int
    delta: int


@dataclass(frozen=True, slots=True)
class StreamAborted(Event):
    """We reset the stream because the peer broke a stream-level rule (so far: flow control).
    The RST_STREAM carrying `status` is already queued; the stream is closed."""

    stream_id: int
    status: int


@dataclass(frozen=True, slots=True)
class GoAwayReceived(Event):
    """The peer is going away; nothing after this frame is read."""

    last_good_stream_id: int
    status: int


@dataclass(frozen=True, slots=True)
class ConnectionClosed(Event):
    """The byte stream ended (receive_eof)."""
