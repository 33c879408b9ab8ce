"""The KEP-4006 port-forward tunnel: a SPDY byte stream inside WebSocket binary messages.

Message boundaries mean nothing (kubectl splits one frame over 2-, 2-, 4-byte messages and
sends empty ones), so payloads are passed on as they arrive, without reassembly
(k8s-streaming.md section 6.2).
"""

from __future__ import annotations

from collections.abc import Iterable

from podgate.proto.upgrade import TUNNEL_PROTOCOL_PREFIX
from podgate.proto.wschannel.endpoint import (
    Buffer,
    EndpointState,
    Role,
    WebSocketEndpoint,
    frozen,
)
from podgate.proto.wschannel.errors import CloseCode
from podgate.proto.wschannel.events import (
    CloseReceived,
    Event,
    PingReceived,
    PongReceived,
    TunnelData,
)
from podgate.proto.wschannel.frames import FIN, Opcode

__all__ = [
    "TUNNEL_PROTOCOL_PREFIX",
    "CloseReceived",
    "EndpointState",
    "PingReceived",
    "PongReceived",
    "Role",
    "TunnelConnection",
    "TunnelData",
    "tunnel_protocol",
]


def tunnel_protocol(spdy_protocol: str) -> str:
    """The WebSocket subprotocol name for a SPDY protocol: "SPDY/3.1+" + name."""
    return TUNNEL_PROTOCOL_PREFIX + spdy_protocol


class TunnelConnection(WebSocketEndpoint):
    """One side of the tunnel. `receive_data` yields TunnelData (one per received piece of a
    message) and control events; `send(chunk)` puts one chunk in one binary message (the
    caller picks the cuts), `send_buffers` the concatenation of several."""

    def __init__(self, role: Role) -> None:
        # No reassembly, so no message bound: pieces are passed on as they arrive.
        super().__init__(role, max_message_bytes=None)

    def _start_message(self, opcode: Opcode) -> None:
        if opcode is not Opcode.BINARY:
            self._fail("invalid message type received", CloseCode.UNSUPPORTED_DATA)
        super()._start_message(opcode)

    def _on_data(self, piece: bytes, last: bool, out: list[Event]) -> None:
        if piece:
            out.append(TunnelData(data=piece))

    def _on_binary_message(self, lead: int, payload: bytes, out: list[Event]) -> None:
        if payload:
            out.append(TunnelData(data=payload))

    def send(self, data: Buffer) -> None:
        """Queue `data` as one binary message (not copied unless mutable). Empty: nothing."""
        if data:
            self._check_open()
            self._queue(FIN | Opcode.BINARY, frozen(data))

    def send_buffers(self, buffers: Iterable[Buffer]) -> None:
        """Queue the buffers back to back as one binary message. All empty: nothing."""
        views = [frozen(b) for b in buffers if b]
        if views:
            self._check_open()
            self._queue_buffers(FIN | Opcode.BINARY, views)
