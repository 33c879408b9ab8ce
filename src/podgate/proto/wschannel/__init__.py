"""Kubernetes WebSocket channel protocols and the SPDY tunnel, sans-IO, on podgate's own
RFC 6455 framing with websockets' C masking (see `endpoint.py`)."""

from podgate.proto.wschannel.codec import (
    CLOSE,
    ERROR,
    RESIZE,
    STDERR,
    STDIN,
    STDOUT,
    ChannelCodec,
)
from podgate.proto.wschannel.connection import MAX_SEND_PAYLOAD_BYTES, ChannelConnection
from podgate.proto.wschannel.endpoint import MAX_MESSAGE_BYTES, EndpointState, Role
from podgate.proto.wschannel.errors import CloseCode, WebSocketError
from podgate.proto.wschannel.events import (
    ChannelClosed,
    ChannelData,
    CloseReceived,
    Event,
    PingReceived,
    PongReceived,
    TunnelData,
)
from podgate.proto.wschannel.portforward import (
    InvalidPortsError,
    PortChannel,
    PortForwardChannels,
    encode_port,
    parse_ports,
)
from podgate.proto.wschannel.tunnel import TunnelConnection, tunnel_protocol

__all__ = [
    "CLOSE",
    "ERROR",
    "MAX_MESSAGE_BYTES",
    "MAX_SEND_PAYLOAD_BYTES",
    "RESIZE",
    "STDERR",
    "STDIN",
    "STDOUT",
    "ChannelClosed",
    "ChannelCodec",
    "ChannelConnection",
    "ChannelData",
    "CloseCode",
    "CloseReceived",
    "EndpointState",
    "Event",
    "InvalidPortsError",
    "PingReceived",
    "PongReceived",
    "PortChannel",
    "PortForwardChannels",
    "Role",
    "TunnelConnection",
    "TunnelData",
    "WebSocketError",
    "encode_port",
    "parse_ports",
    "tunnel_protocol",
]
