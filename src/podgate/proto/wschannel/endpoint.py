"""The shared WebSocket layer: wsproto framing plus message reassembly, limits and errors.

wsproto's post-handshake `Connection` does framing, masking and close frames. This class adds
what both the channel and tunnel protocols need on top: automatic pong and close replies,
bounded reassembly, and one exception type (WebSocketError) for everything the peer can do
wrong, with a close frame queued before it is raised.
"""

from __future__ import annotations

from enum import Enum
from typing import NoReturn

from wsproto.connection import Connection, ConnectionState, ConnectionType
from wsproto.events import (
    BytesMessage,
    CloseConnection,
    Ping,
    Pong,
    TextMessage,
)
from wsproto.events import Event as WsEvent
from wsproto.utilities import ProtocolError as WsProtocolError

from podgate.proto.errors import LocalProtocolError
from podgate.proto.wschannel.errors import CloseCode, WebSocketError
from podgate.proto.wschannel.events import (
    CloseReceived,
    Event,
    PingReceived,
    PongReceived,
)

# x/net/websocket's DefaultMaxPayloadBytes, the limit kubelet/CRI servers apply.
MAX_MESSAGE_BYTES = 32 * 1024 * 1024
# RFC 6455 5.5: control frame payloads are at most 125 bytes.
MAX_CONTROL_PAYLOAD_BYTES = 125
# A close reason shares its control frame with the 2-byte code.
MAX_CLOSE_REASON_BYTES = MAX_CONTROL_PAYLOAD_BYTES - 2


class Role(Enum):
    CLIENT = "client"
    SERVER = "server"


class EndpointState(Enum):
    OPEN = "open"
    CLOSING = "closing"  # we sent a close frame and wait for the peer's
    CLOSED = "closed"  # close frames crossed, or the stream ended
    FAILED = "failed"  # the peer broke the protocol


def _short_reason(text: str) -> str:
    return text.encode("utf-8")[:MAX_CLOSE_REASON_BYTES].decode("utf-8", "ignore")


class WebSocketEndpoint:
    """Base for ChannelConnection and TunnelConnection. Subclasses handle message data."""

    def __init__(self, role: Role, *, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        kind = ConnectionType.CLIENT if role is Role.CLIENT else ConnectionType.SERVER
        self.role = role
        self.max_message_bytes = max_message_bytes
        self._ws = Connection(kind)
        self._out = bytearray()
        self._state = EndpointState.OPEN
        self._parts: list[bytes | str] = []
        self._size = 0

    @property
    def state(self) -> EndpointState:
        return self._state

    # --- input ----------------------------------------------------------------------------

    def receive_data(self, data: bytes | None) -> list[Event]:
        """Feed bytes from the peer; returns the events they complete.

        None means the byte stream ended, as in wsproto (the same as receive_eof()).
        """
        if data is None:
            return self.receive_eof()
        if self._state is EndpointState.FAILED:
            raise LocalProtocolError("the connection already failed")
        if self._state is EndpointState.CLOSED:
            if data:
                raise WebSocketError("data after the close handshake")
            return []
        events: list[Event] = []
        try:
            self._ws.receive_data(data)
            for event in self._ws.events():
                self._dispatch(event, events)
        except WsProtocolError as exc:
            self._fail(f"websocket: {exc}", CloseCode.PROTOCOL_ERROR)
        return events

    def receive_eof(self) -> list[Event]:
        """The byte stream ended. Without a prior close frame that is a 1006 closure."""
        if self._state in (EndpointState.CLOSED, EndpointState.FAILED):
            return []
        self._state = EndpointState.CLOSED
        self._parts.clear()
        return [CloseReceived(code=CloseCode.ABNORMAL, reason="")]

    def _dispatch(self, event: WsEvent, out: list[Event]) -> None:
        if isinstance(event, (BytesMessage, TextMessage)):
            if self._state is EndpointState.CLOSED:
                return
            self._on_fragment(event, out)
        elif isinstance(event, Ping):
            if self._ws.state is ConnectionState.OPEN:
                self._out += self._ws.send(event.response())
            out.append(PingReceived(payload=bytes(event.payload)))
        elif isinstance(event, Pong):
            out.append(PongReceived(payload=bytes(event.payload)))
        elif isinstance(event, CloseConnection):
            self._on_close(event, out)

    def _on_close(self, event: CloseConnection, out: list[Event]) -> None:
        if self._ws.state in (ConnectionState.OPEN, ConnectionState.LOCAL_CLOSING):
            # wsproto reports a framing error as a CloseConnection without changing state.
            self._fail(f"websocket: {event.reason}", event.code)
        if self._ws.state is ConnectionState.REMOTE_CLOSING:
            self._out += self._ws.send(event.response())
        self._state = EndpointState.CLOSED
        self._parts.clear()
        out.append(CloseReceived(code=int(event.code), reason=event.reason or ""))

    def _on_fragment(self, event: BytesMessage | TextMessage, out: list[Event]) -> None:
        """Default: reassemble whole messages, bounded, and hand them to _on_message."""
        chunk = event.data
        if chunk:
            self._size += len(chunk.encode("utf-8")) if isinstance(chunk, str) else len(chunk)
            if self._size > self.max_message_bytes:
                self._fail(
                    f"message larger than {self.max_message_bytes} bytes",
                    CloseCode.MESSAGE_TOO_BIG,
                )
            self._parts.append(chunk if isinstance(chunk, str) else bytes(chunk))
        if not event.message_finished:
            return
        parts, self._parts, self._size = self._parts, [], 0
        if isinstance(event, TextMessage):
            self._on_message("".join(p for p in parts if isinstance(p, str)), out)
        else:
            assert isinstance(event, BytesMessage)
            self._on_message(b"".join(p for p in parts if isinstance(p, bytes)), out)

    def _on_message(self, message: bytes | str, out: list[Event]) -> None:
        raise NotImplementedError

    def _fail(self, message: str, code: int) -> NoReturn:
        """Queue a close frame if we still may, mark the connection failed, raise."""
        if self._ws.state is ConnectionState.OPEN:
            self._out += self._ws.send(CloseConnection(code=code, reason=_short_reason(message)))
        self._state = EndpointState.FAILED
        self._parts.clear()
        raise WebSocketError(message, code)

    # --- output ---------------------------------------------------------------------------

    def _send_message(self, message: bytes | str) -> None:
        if self._state is not EndpointState.OPEN or self._ws.state is not ConnectionState.OPEN:
            raise LocalProtocolError(f"cannot send in state {self._state.name}")
        if isinstance(message, str):
            self._out += self._ws.send(TextMessage(data=message))
        else:
            self._out += self._ws.send(BytesMessage(data=message))

    def ping(self, payload: bytes = b"") -> None:
        """Queue a ping. A no-op once closing has begun, so keep-alive timers may race close."""
        if len(payload) > MAX_CONTROL_PAYLOAD_BYTES:
            raise LocalProtocolError(f"ping payload over {MAX_CONTROL_PAYLOAD_BYTES} bytes")
        if self._state is EndpointState.OPEN and self._ws.state is ConnectionState.OPEN:
            self._out += self._ws.send(Ping(payload=payload))

    def close(self, code: int = CloseCode.NORMAL, reason: str = "") -> None:
        """Start the closing handshake. A no-op once closing has begun or the peer is gone."""
        if self._state is not EndpointState.OPEN or self._ws.state is not ConnectionState.OPEN:
            return
        self._out += self._ws.send(CloseConnection(code=code, reason=_short_reason(reason)))
        self._state = EndpointState.CLOSING

    def data_to_send(self) -> bytes:
        out, self._out = bytes(self._out), bytearray()
        return out
