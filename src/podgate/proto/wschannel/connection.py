"""Kubernetes channel protocols over WebSocket (exec/attach, and port-forward framing).

One message is one stream write on one channel (k8s-streaming.md sections 5.2-5.5).
"""

from __future__ import annotations

from podgate.proto.errors import LocalProtocolError
from podgate.proto.wschannel.codec import CLOSE, RESIZE, ChannelCodec
from podgate.proto.wschannel.endpoint import (
    MAX_MESSAGE_BYTES,
    Buffer,
    EndpointState,
    Role,
    WebSocketEndpoint,
    frozen,
)
from podgate.proto.wschannel.errors import CloseCode, WebSocketError
from podgate.proto.wschannel.events import (
    ChannelClosed,
    ChannelData,
    CloseReceived,
    Event,
    PingReceived,
    PongReceived,
)
from podgate.proto.wschannel.frames import FIN, Opcode
from podgate.proto.wschannel.portforward import PortForwardChannels

__all__ = [
    "MAX_MESSAGE_BYTES",
    "MAX_SEND_PAYLOAD_BYTES",
    "ChannelClosed",
    "ChannelConnection",
    "ChannelData",
    "CloseReceived",
    "EndpointState",
    "Event",
    "PingReceived",
    "PongReceived",
    "Role",
]

# Larger writes are split: message boundaries carry no meaning, and this keeps every message
# far below the peer's 32 MiB limit (kubectl itself sends stdin in 32 KiB pieces).
MAX_SEND_PAYLOAD_BYTES = 1024 * 1024
# A v5 CLOSE message is exactly the marker byte plus one channel byte.
CLOSE_MESSAGE_BYTES = 2
# v5 CLOSE may name only the exec/attach channels 0..4 (wsstream drops the connection else).
MAX_CLOSABLE_CHANNEL = RESIZE


class ChannelConnection(WebSocketEndpoint):
    """One side of a channel-protocol WebSocket, after the 101.

    Receiving: `receive_data` returns ChannelData / ChannelClosed / CloseReceived /
    PingReceived / PongReceived; pongs and the close reply are queued automatically.
    Anything the peer gets wrong raises WebSocketError after queueing a close frame.
    """

    def __init__(
        self,
        role: Role,
        protocol: str,
        *,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        port_channels: PortForwardChannels | None = None,
    ) -> None:
        super().__init__(role, max_message_bytes=max_message_bytes)
        self.max_message_bytes: int = max_message_bytes
        self.codec = ChannelCodec(protocol)
        self.protocol = protocol
        # Set for port-forward: received data is filtered and port headers are stripped.
        self.port_channels = port_channels
        # Binary protocols: the first byte of a binary message is its channel.
        self._split_lead = not self.codec.base64

    @property
    def can_close_channels(self) -> bool:
        """Whether close_channel() is available: a client speaking v5."""
        return self.role is Role.CLIENT and self.codec.has_close

    def _on_data(self, piece: bytes, last: bool, out: list[Event]) -> None:
        if piece:
            self._parts.append(piece)
        if not last:
            return
        parts = self._parts
        message = parts[0] if len(parts) == 1 else b"".join(parts)
        if self._message is Opcode.TEXT:
            self._on_message(message.decode("utf-8"), out)  # already validated
        else:
            self._on_binary_message(self._lead, message, out)

    def _on_binary_message(self, lead: int, payload: bytes, out: list[Event]) -> None:
        if not self._split_lead:
            self._on_message(payload, out)
        elif lead >= 0:
            self._on_channel_message(lead, payload, out)
        # else: an empty message, which upstream servers ignore

    def _on_message(self, message: bytes | str, out: list[Event]) -> None:
        """A whole message that still needs the codec: text, or any base64 message."""
        if not message:
            return  # upstream servers ignore empty messages
        if isinstance(message, str) and self.role is Role.CLIENT and self.codec.has_close:
            # kubectl's v5 client accepts binary messages only.
            self._fail("text message on a v5 channel connection", CloseCode.UNSUPPORTED_DATA)
        try:
            channel, payload = self.codec.decode(message)
        except WebSocketError as exc:
            self._fail(exc.message, exc.close_code)
        self._on_channel_message(channel, payload, out)

    def _on_channel_message(self, channel: int, payload: bytes, out: list[Event]) -> None:
        if channel == CLOSE and self.codec.has_close:
            if len(payload) != CLOSE_MESSAGE_BYTES - 1:
                self._fail(f"CLOSE message of {len(payload) + 1} bytes", CloseCode.PROTOCOL_ERROR)
            if payload[0] > MAX_CLOSABLE_CHANNEL:
                self._fail(f"CLOSE names unknown channel {payload[0]}", CloseCode.PROTOCOL_ERROR)
            out.append(ChannelClosed(channel=payload[0]))
            return
        if self.port_channels is not None:
            try:
                kept = self.port_channels.receive(channel, payload)
            except WebSocketError as exc:
                self._fail(exc.message, exc.close_code)
            if kept is None:
                return
            payload = kept[1]
        out.append(ChannelData(channel=channel, data=payload))

    def send(self, channel: int, data: Buffer) -> None:
        """Queue `data` on `channel`; empty data sends nothing, large data goes in pieces.

        Binary protocols queue `data` itself, not a copy, unless it is mutable.
        """
        if channel == CLOSE and self.codec.has_close:
            raise LocalProtocolError("channel 255 is CLOSE under v5; use close_channel()")
        if not 0 <= channel <= self.codec.max_channel:
            raise LocalProtocolError(f"channel {channel} out of range for {self.protocol!r}")
        view = frozen(data)
        size = len(view)
        if not size:
            return
        self._check_open()
        if self.codec.base64:
            for start in range(0, size, MAX_SEND_PAYLOAD_BYTES):
                chunk = bytes(view[start : start + MAX_SEND_PAYLOAD_BYTES])
                self._send_message(self.codec.encode(channel, chunk))
            return
        if size <= MAX_SEND_PAYLOAD_BYTES:
            self._queue(FIN | Opcode.BINARY, view, channel)
            return
        if isinstance(view, bytes):
            view = memoryview(view)
        for start in range(0, size, MAX_SEND_PAYLOAD_BYTES):
            self._queue(FIN | Opcode.BINARY, view[start : start + MAX_SEND_PAYLOAD_BYTES], channel)

    def send_ready(self, channel: int) -> None:
        """The payload-less message upstream servers send first ([ch], or "1" in base64)."""
        self._send_message(self.codec.encode(channel, b""))

    def close_channel(self, channel: int) -> None:
        """v5 client only: tell the server that input `channel` (stdin) has ended."""
        if not self.can_close_channels:
            raise LocalProtocolError("CLOSE is a v5 client-to-server message")
        if not 0 <= channel <= MAX_CLOSABLE_CHANNEL:
            raise LocalProtocolError(f"cannot close channel {channel}")
        self._send_message(bytes((CLOSE, channel)))
