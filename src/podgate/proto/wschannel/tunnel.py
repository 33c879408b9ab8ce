"""The KEP-4006 port-forward tunnel: a SPDY byte stream inside WebSocket binary messages.

Message boundaries mean nothing (kubectl splits one frame over 2-, 2-, 4-byte messages and
sends empty ones), so payloads are passed on as they arrive, without reassembly
(k8s-streaming.md section 6.2).
"""

from __future__ import annotations

from wsproto.events import BytesMessage, TextMessage

from podgate.proto.upgrade import TUNNEL_PROTOCOL_PREFIX
from podgate.proto.wschannel.endpoint import EndpointState, Role, WebSocketEndpoint
from podgate.proto.wschannel.errors import CloseCode
from podgate.proto.wschannel.events import (
    CloseReceived,
    Event,
    PingReceived,
    PongReceived,
    TunnelData,
)

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
    """One side of the tunnel. `receive_data` yields TunnelData and control events;
    `send(chunk)` puts one chunk in one binary message (the caller picks the cuts)."""

    def __init__(self, role: Role) -> None:
        super().__init__(role)

    def _on_fragment(self, event: BytesMessage | TextMessage, out: list[Event]) -> None:
        data = event.data
        if isinstance(event, TextMessage) or isinstance(data, str):
            self._fail("invalid message type received", CloseCode.UNSUPPORTED_DATA)
        if data:
            out.append(TunnelData(data=bytes(data)))

    def send(self, data: bytes) -> None:
        """Queue `data` as one binary message. Empty data sends nothing."""
        if data:
            self._send_message(bytes(data))
