"""Port-forward semantics: pairing SPDY streams into requests, and the WebSocket port layout.

Over SPDY (`portforward.k8s.io`, also inside the WebSocket tunnel) each forwarded connection is
an error stream plus a data stream sharing a `requestid`. The server side here mirrors the CRI
streaming server's `portforward/httpstream.go`; the client side mirrors client-go.

podgate's UDP extension (`udp.portforward.podgate.io`, described in `podgate.proto.datagram`)
is negotiated as an extra protocol version; only under it does a pair's `protocol` header
count.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from podgate.proto.errors import LocalProtocolError
from podgate.proto.k8s import REASON_BAD_REQUEST, StatusError, go_quote
from podgate.proto.remotecommand import header_value
from podgate.proto.upgrade import PORTFORWARD_WS_PROTOCOLS, TUNNEL_PROTOCOL_PREFIX

__all__ = [
    "CLIENT_SPDY_PROTOCOLS_WITH_UDP",
    "CLIENT_TUNNEL_PROTOCOLS_WITH_UDP",
    "HEADER_PORT",
    "HEADER_PROTOCOL",
    "HEADER_REQUEST_ID",
    "HEADER_STREAM_TYPE",
    "MAX_PENDING_PAIRS",
    "PORTFORWARD_PROTOCOL",
    "PORTFORWARD_TUNNEL_PROTOCOL",
    "SERVER_SPDY_PROTOCOLS",
    "SERVER_WS_PROTOCOLS",
    "STREAM_CREATION_TIMEOUT",
    "UDP_PORTFORWARD_PROTOCOL",
    "UDP_TUNNEL_PROTOCOL",
    "Duplicate",
    "Expired",
    "ForwardProtocol",
    "Pair",
    "Pending",
    "PortForwardPairing",
    "PortForwardRequestIds",
    "Rejected",
    "StreamType",
    "UnsupportedProtocol",
    "allows_udp",
    "forward_error_message",
    "parse_port",
    "parse_ports",
    "stream_headers",
    "websocket_channels",
    "websocket_port_prefix",
]

PORTFORWARD_PROTOCOL: Final = "portforward.k8s.io"
# podgate's extension: the same pairs, plus UDP pairs (`protocol: udp`). See proto/datagram.py.
UDP_PORTFORWARD_PROTOCOL: Final = "udp.portforward.podgate.io"
# The same two inside the KEP-4006 WebSocket tunnel.
PORTFORWARD_TUNNEL_PROTOCOL: Final = TUNNEL_PROTOCOL_PREFIX + PORTFORWARD_PROTOCOL
UDP_TUNNEL_PROTOCOL: Final = TUNNEL_PROTOCOL_PREFIX + UDP_PORTFORWARD_PROTOCOL
# What a podgate client offers when it wants UDP, in preference order (client order wins).
CLIENT_SPDY_PROTOCOLS_WITH_UDP: Final = (UDP_PORTFORWARD_PROTOCOL, PORTFORWARD_PROTOCOL)
CLIENT_TUNNEL_PROTOCOLS_WITH_UDP: Final = (UDP_TUNNEL_PROTOCOL, PORTFORWARD_TUNNEL_PROTOCOL)
# What podgate's servers accept for port-forward: upstream's lists plus the extension.
SERVER_SPDY_PROTOCOLS: Final = (PORTFORWARD_PROTOCOL, UDP_PORTFORWARD_PROTOCOL)
SERVER_WS_PROTOCOLS: Final = (*PORTFORWARD_WS_PROTOCOLS, UDP_TUNNEL_PROTOCOL)

# kubelet/CRI default: how long the second stream of a pair may lag the first, seconds.
STREAM_CREATION_TIMEOUT: Final = 30.0
# Half-open pairs held per connection; each costs a timer and state, so a peer cannot grow it.
MAX_PENDING_PAIRS: Final = 1000

# Lower-case on the SPDY wire; Go spells them streamType, port, requestID and folds case.
HEADER_STREAM_TYPE: Final = "streamtype"
HEADER_PORT: Final = "port"
HEADER_REQUEST_ID: Final = "requestid"
# podgate's extension only: "tcp" (the default) or "udp".
HEADER_PROTOCOL: Final = "protocol"

# Ports are Go uint16 values; 0 is refused.
_MAX_PORT: Final = 0xFFFF
_DIGITS_RE: Final = re.compile(r"[0-9]+")


class StreamType(StrEnum):
    ERROR = "error"
    DATA = "data"


class ForwardProtocol(StrEnum):
    """What a stream pair forwards to inside the pod."""

    TCP = "tcp"
    UDP = "udp"


def allows_udp(protocol: str) -> bool:
    """Whether the negotiated protocol (the inner one, for the tunnel) carries UDP pairs."""
    return protocol == UDP_PORTFORWARD_PROTOCOL


def parse_port(text: str) -> int:
    """Go's `strconv.ParseUint(text, 10, 16)` plus the `>= 1` check, with upstream's messages.

    Raises ValueError carrying the message the CRI server would give.
    """
    if not _DIGITS_RE.fullmatch(text):
        problem = "invalid syntax"
    elif int(text) > _MAX_PORT:
        problem = "value out of range"
    elif int(text) < 1:
        raise ValueError(f"port {go_quote(text)} must be > 0")
    else:
        return int(text)
    raise ValueError(
        f"unable to parse {go_quote(text)} as a port: "
        f"strconv.ParseUint: parsing {go_quote(text)}: {problem}"
    )


def forward_error_message(port: int, pod: str, uid: str, err: str) -> str:
    """The text the server writes on a pair's error stream when forwarding fails."""
    return f"error forwarding port {port} to pod {pod}, uid {uid}: {err}"


# --- server side: pairing ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rejected:
    """Reset the stream (RST_STREAM CANCEL) without replying."""

    stream_id: int
    reason: str


@dataclass(frozen=True, slots=True)
class Pending:
    """Reply to the stream; its partner has not arrived yet."""

    request_id: str
    stream_id: int
    stream_type: StreamType


@dataclass(frozen=True, slots=True)
class Duplicate:
    """A second stream of one type for a pending request.

    Write `message` to `error_stream_id` if there is one (upstream does). The duplicate stream
    itself belongs to no pair: reset it.
    """

    request_id: str
    stream_id: int
    stream_type: StreamType
    error_stream_id: int | None
    message: str


@dataclass(frozen=True, slots=True)
class Pair:
    """Both streams arrived: reply to this one and start forwarding `port` (the data stream's)
    over `protocol` (the data stream's; always TCP unless the UDP extension was negotiated)."""

    request_id: str
    port: int
    error_stream_id: int
    data_stream_id: int
    protocol: ForwardProtocol = ForwardProtocol.TCP


@dataclass(frozen=True, slots=True)
class UnsupportedProtocol:
    """Both streams arrived but the data stream asked for a protocol nobody forwards: reply to
    this one, write `message` to the error stream, then reset both."""

    request_id: str
    port: int
    error_stream_id: int
    data_stream_id: int
    message: str


@dataclass(frozen=True, slots=True)
class Expired:
    """A pair stayed incomplete too long. Write `message` to `error_stream_id` if set."""

    request_id: str
    error_stream_id: int | None
    message: str


@dataclass(slots=True)
class _HalfPair:
    created_at: float
    error_stream_id: int | None = None
    data_stream_id: int | None = None
    data_port: int = 0
    data_protocol: str = ForwardProtocol.TCP.value


class PortForwardPairing:
    """Pairs the error and data streams of each port-forward request on one connection.

    Validates each new stream before it is replied to, pairs by exact `requestid`, and
    forgets a pair once it is complete (a later stream with the same id starts a new one, as
    upstream does). `conn_label` names the connection in timeout messages. With `udp` (the
    extension was negotiated) the data stream's `protocol` header picks TCP or UDP; without it
    the header is ignored.
    """

    def __init__(
        self,
        conn_label: str,
        *,
        timeout: float = STREAM_CREATION_TIMEOUT,
        max_pending: int = MAX_PENDING_PAIRS,
        udp: bool = False,
    ) -> None:
        self.conn_label = conn_label
        self.timeout = timeout
        self.max_pending = max_pending
        self.udp = udp
        self._pending: dict[str, _HalfPair] = {}

    def __len__(self) -> int:
        """Number of incomplete pairs."""
        return len(self._pending)

    def add_stream(
        self, stream_id: int, headers: Mapping[str, str], now: float
    ) -> Rejected | Pending | Duplicate | Pair | UnsupportedProtocol:
        port_text = header_value(headers, HEADER_PORT)
        if not port_text:
            return Rejected(stream_id, f'"{HEADER_PORT}" header is required')
        try:
            port = parse_port(port_text)
        except ValueError as exc:
            return Rejected(stream_id, str(exc))
        raw_type = header_value(headers, HEADER_STREAM_TYPE)
        if not raw_type:
            return Rejected(stream_id, '"streamType" header is required')
        try:
            stream_type = StreamType(raw_type)
        except ValueError:
            return Rejected(stream_id, f"invalid stream type {go_quote(raw_type)}")

        request_id = header_value(headers, HEADER_REQUEST_ID)
        if not request_id:
            # Clients that predate requestid open error then data with consecutive ids.
            pseudo = stream_id if stream_type is StreamType.ERROR else stream_id - 2
            request_id = str(pseudo)

        half = self._pending.get(request_id)
        if half is None:
            if len(self._pending) >= self.max_pending:
                return Rejected(
                    stream_id,
                    f"too many port-forward requests waiting for streams ({self.max_pending})",
                )
            half = self._pending[request_id] = _HalfPair(created_at=now)

        if stream_type is StreamType.ERROR:
            if half.error_stream_id is not None:
                return self._duplicate(request_id, stream_id, stream_type, half)
            half.error_stream_id = stream_id
        else:
            if half.data_stream_id is not None:
                return self._duplicate(request_id, stream_id, stream_type, half)
            half.data_stream_id = stream_id
            half.data_port = port
            if self.udp:
                half.data_protocol = header_value(headers, HEADER_PROTOCOL) or "tcp"

        if half.error_stream_id is None or half.data_stream_id is None:
            return Pending(request_id, stream_id, stream_type)
        del self._pending[request_id]
        try:
            protocol = ForwardProtocol(half.data_protocol)
        except ValueError:
            message = (
                f"unsupported port-forward protocol {go_quote(half.data_protocol)}: "
                f'expected "tcp" or "udp"'
            )
            return UnsupportedProtocol(
                request_id, half.data_port, half.error_stream_id, half.data_stream_id, message
            )
        return Pair(request_id, half.data_port, half.error_stream_id, half.data_stream_id, protocol)

    @staticmethod
    def _duplicate(
        request_id: str, stream_id: int, stream_type: StreamType, half: _HalfPair
    ) -> Duplicate:
        message = (
            f"error processing stream for request {request_id}: "
            f"{stream_type.value} stream already assigned"
        )
        return Duplicate(request_id, stream_id, stream_type, half.error_stream_id, message)

    def expire(self, now: float) -> list[Expired]:
        """Forget every pair whose first stream came `timeout` seconds or more before `now`."""
        expired: list[Expired] = []
        for request_id, half in list(self._pending.items()):
            if now - half.created_at >= self.timeout:
                del self._pending[request_id]
                message = (
                    f"(conn={self.conn_label}, request={request_id}) timed out waiting for streams"
                )
                expired.append(Expired(request_id, half.error_stream_id, message))
        return expired

    def next_deadline(self) -> float | None:
        """When `expire` next has work to do, for the driver's timer; None if nothing pends."""
        if not self._pending:
            return None
        return min(half.created_at for half in self._pending.values()) + self.timeout

    def remove(self, request_id: str) -> bool:
        """Forget an incomplete pair (e.g. its stream was reset); False if there was none."""
        return self._pending.pop(request_id, None) is not None


# --- client side -------------------------------------------------------------------------------


class PortForwardRequestIds(Iterator[str]):
    """Request ids as kubectl makes them: a per-connection counter "0", "1", "2", ..."""

    def __init__(self) -> None:
        self._next = 0

    def next(self) -> str:
        value = str(self._next)
        self._next += 1
        return value

    def __next__(self) -> str:
        return self.next()


def stream_headers(
    stream_type: StreamType | str, port: int, request_id: str, protocol: str = "tcp"
) -> dict[str, str]:
    """The SYN_STREAM headers of one stream of a pair (open error first, then data).

    A TCP pair's headers are exactly kubectl's; a UDP pair's add `protocol: udp` (only valid
    under the UDP extension)."""
    kind = StreamType(stream_type)
    if not 1 <= port <= _MAX_PORT:
        raise LocalProtocolError(f"port {port} is outside 1..{_MAX_PORT}")
    try:
        forward = ForwardProtocol(protocol)
    except ValueError:
        raise LocalProtocolError(f"protocol {protocol!r} is neither tcp nor udp") from None
    headers = {
        HEADER_STREAM_TYPE: kind.value,
        HEADER_PORT: str(port),
        HEADER_REQUEST_ID: request_id,
    }
    if forward is ForwardProtocol.UDP:
        headers[HEADER_PROTOCOL] = forward.value
    return headers


# --- WebSocket channel layout (v4.channel.k8s.io) ----------------------------------------------


def websocket_channels(index: int) -> tuple[int, int]:
    """(data, error) channel numbers of the `index`-th requested port."""
    return 2 * index, 2 * index + 1


def websocket_port_prefix(port: int) -> bytes:
    """Payload of the first server message on both channels of a port: uint16 little-endian."""
    if not 1 <= port <= _MAX_PORT:
        raise LocalProtocolError(f"port {port} is outside 1..{_MAX_PORT}")
    return port.to_bytes(2, "little")


# Ports one WebSocket port-forward request may name: the channel protocol's own limit (two
# channels a port, channel numbers 0-79 in base64 mode), so a longer list is refused up front.
MAX_PORTS_PER_REQUEST = 40


def parse_ports(query: Sequence[tuple[str, str]], *, name: str = "ports") -> tuple[int, ...]:
    """Ports of a WebSocket port-forward request: repeated and/or comma-separated values.

    The API server reads `ports`, the kubelet `port`. Errors are HTTP 400 before the upgrade.
    """
    values = [value for key, value in query if key == name]
    if not values:
        raise StatusError(
            f"query parameter {go_quote(name)} is required", code=400, reason=REASON_BAD_REQUEST
        )
    ports: list[int] = []
    for value in values:
        if not value:
            raise StatusError(
                f"query parameter {go_quote(name)} cannot be empty",
                code=400,
                reason=REASON_BAD_REQUEST,
            )
        for item in value.split(","):
            if len(ports) == MAX_PORTS_PER_REQUEST:
                raise StatusError(
                    f"at most {MAX_PORTS_PER_REQUEST} ports per request",
                    code=400,
                    reason=REASON_BAD_REQUEST,
                )
            try:
                ports.append(parse_port(item))
            except ValueError as exc:
                raise StatusError(str(exc), code=400, reason=REASON_BAD_REQUEST) from None
    return tuple(ports)
