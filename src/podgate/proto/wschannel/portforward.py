"""Port-forward over plain WebSocket channels (kubelet/CRI `portforward/websocket.go`).

Port i uses channel 2i for data (both ways) and 2i+1 for error text (server to client).
The server's first message on both channels of every pair is the port as uint16
little-endian; the client never sends a prefix (k8s-streaming.md section 5.6).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import parse_qsl

from podgate.proto.errors import LocalProtocolError, RemoteProtocolError
from podgate.proto.wschannel.codec import MAX_BASE64_CHANNEL
from podgate.proto.wschannel.endpoint import Role
from podgate.proto.wschannel.errors import CloseCode, WebSocketError

# The port header is a little-endian uint16.
PORT_PREFIX_BYTES = 2
MIN_PORT = 1
MAX_PORT = 65535
# Two channels per port must fit the channel byte; base64 framing caps this further.
MAX_PORTS = (MAX_BASE64_CHANNEL + 1) // 2


class InvalidPortsError(RemoteProtocolError):
    """The request's port list is unusable; answer with HTTP `status` (400)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def encode_port(port: int) -> bytes:
    return port.to_bytes(PORT_PREFIX_BYTES, "little")


def _parse_port(text: str, original: str) -> int:
    # strconv.ParseUint(p, 10, 16) accepts ASCII digits only.
    if not text.isascii() or not text.isdigit():
        raise InvalidPortsError(f'unable to parse "{original}" as a port')
    port = int(text)
    if port > MAX_PORT:
        raise InvalidPortsError(f'unable to parse "{original}" as a port: value out of range')
    if port < MIN_PORT:
        raise InvalidPortsError(f'port "{original}" must be > 0')
    return port


def parse_ports(query: str) -> list[int]:
    """Ports from a query string: `ports=80&ports=8080`, `ports=80,8080` (API server) or
    the kubelet's `port=80,8080`, in order of appearance."""
    values = [v for k, v in parse_qsl(query, keep_blank_values=True) if k in ("ports", "port")]
    if not values:
        raise InvalidPortsError('query parameter "port" is required')
    ports: list[int] = []
    for value in values:
        if not value:
            raise InvalidPortsError('query parameter "port" cannot be empty')
        ports += [_parse_port(p.strip(), value) for p in value.split(",")]
    if len(ports) > MAX_PORTS:
        raise InvalidPortsError(f"at most {MAX_PORTS} ports per connection")
    return ports


@dataclass(frozen=True, slots=True)
class PortChannel:
    """What a channel number means: which requested port, and data or error."""

    index: int
    port: int
    is_error: bool


class PortForwardChannels:
    """Channel bookkeeping for one port-forward WebSocket; pairs with a ChannelConnection."""

    def __init__(self, ports: Sequence[int], role: Role) -> None:
        if not ports:
            raise LocalProtocolError("port-forward needs at least one port")
        if len(ports) > MAX_PORTS:
            raise LocalProtocolError(f"at most {MAX_PORTS} ports per connection")
        for port in ports:
            if not MIN_PORT <= port <= MAX_PORT:
                raise LocalProtocolError(f"invalid port {port}")
        self.ports = tuple(ports)
        self.role = role
        # Client side: prefix bytes still expected per channel (kept until complete).
        self._pending: dict[int, bytearray] = (
            {ch: bytearray() for ch in range(2 * len(self.ports))} if role is Role.CLIENT else {}
        )

    @staticmethod
    def data_channel(index: int) -> int:
        return 2 * index

    @staticmethod
    def error_channel(index: int) -> int:
        return 2 * index + 1

    def lookup(self, channel: int) -> PortChannel | None:
        index, is_error = divmod(channel, 2)
        if index >= len(self.ports):
            return None
        return PortChannel(index=index, port=self.ports[index], is_error=bool(is_error))

    def initial_messages(self) -> list[tuple[int, bytes]]:
        """Server: the (channel, payload) port headers to send right after the 101."""
        if self.role is not Role.SERVER:
            raise LocalProtocolError("only the server sends port headers")
        messages: list[tuple[int, bytes]] = []
        for index, port in enumerate(self.ports):
            messages.append((self.data_channel(index), encode_port(port)))
            messages.append((self.error_channel(index), encode_port(port)))
        return messages

    def receive(self, channel: int, data: bytes) -> tuple[PortChannel, bytes] | None:
        """Classify one received ChannelData. Returns None for what must be dropped:
        unknown channels, client writes to error channels, and (client side) the port
        header itself. A header naming the wrong port raises WebSocketError."""
        target = self.lookup(channel)
        if target is None:
            return None
        if self.role is Role.SERVER:
            return None if target.is_error else (target, data)
        pending = self._pending.get(channel)
        if pending is not None:
            need = PORT_PREFIX_BYTES - len(pending)
            pending += data[:need]
            data = data[need:]
            if len(pending) < PORT_PREFIX_BYTES:
                return None
            del self._pending[channel]
            got = int.from_bytes(pending, "little")
            if got != target.port:
                raise WebSocketError(
                    f"port header {got} on channel {channel}, expected {target.port}",
                    CloseCode.PROTOCOL_ERROR,
                )
        return (target, data) if data else None

    def outbound(self, index: int, data: bytes) -> tuple[int, bytes]:
        """Client: (channel, payload) for bytes to port `index` (data channel, no prefix)."""
        if not 0 <= index < len(self.ports):
            raise LocalProtocolError(f"no port index {index}")
        return self.data_channel(index), data
