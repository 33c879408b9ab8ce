"""Channel framing of the Kubernetes WebSocket subprotocols (k8s-streaming.md section 5.2).

Binary protocols: one channel byte, then the payload. base64 protocols: text messages whose
first character is the ASCII digit '0'+channel and whose rest is padded standard base64.
"""

from __future__ import annotations

import base64
import binascii

from podgate.proto.errors import LocalProtocolError
from podgate.proto.wschannel.errors import CloseCode, WebSocketError

STDIN = 0
STDOUT = 1
STDERR = 2
ERROR = 3
RESIZE = 4
# v5 only: [CLOSE, ch] half-closes input channel ch.
CLOSE = 255

PROTOCOL_V1 = "channel.k8s.io"
PROTOCOL_V4 = "v4.channel.k8s.io"
PROTOCOL_V5 = "v5.channel.k8s.io"
PROTOCOL_BASE64 = "base64.channel.k8s.io"
PROTOCOL_V4_BASE64 = "v4.base64.channel.k8s.io"
PROTOCOL_NONE = ""

BINARY_PROTOCOLS = frozenset({PROTOCOL_NONE, PROTOCOL_V1, PROTOCOL_V4, PROTOCOL_V5})
BASE64_PROTOCOLS = frozenset({PROTOCOL_BASE64, PROTOCOL_V4_BASE64})
CHANNEL_PROTOCOLS = BINARY_PROTOCOLS | BASE64_PROTOCOLS

# One byte names the channel in binary mode.
MAX_CHANNEL = 255
# In base64 mode the channel is the character '0'+channel, which must stay 7-bit ASCII.
MAX_BASE64_CHANNEL = 0x7F - ord("0")


class ChannelCodec:
    """Encodes and decodes single channel messages for one negotiated subprotocol."""

    def __init__(self, protocol: str) -> None:
        if protocol not in CHANNEL_PROTOCOLS:
            raise LocalProtocolError(f"not a channel protocol: {protocol!r}")
        self.protocol = protocol
        self.base64 = protocol in BASE64_PROTOCOLS
        self.has_close = protocol == PROTOCOL_V5
        self.max_channel = MAX_BASE64_CHANNEL if self.base64 else MAX_CHANNEL

    def encode(self, channel: int, data: bytes) -> bytes | str:
        """One message: bytes for binary protocols, str (a text message) for base64 ones."""
        if not 0 <= channel <= self.max_channel:
            raise LocalProtocolError(f"channel {channel} out of range for {self.protocol!r}")
        if self.base64:
            return chr(ord("0") + channel) + base64.b64encode(data).decode("ascii")
        return bytes((channel,)) + data

    def decode(self, message: bytes | str) -> tuple[int, bytes]:
        """(channel, payload) of a non-empty message; text or binary opcode alike."""
        if not message:
            raise WebSocketError("empty channel message")
        if not self.base64:
            raw = message.encode("utf-8") if isinstance(message, str) else message
            return raw[0], bytes(raw[1:])
        try:
            text = message if isinstance(message, str) else message.decode("ascii")
            channel = ord(text[0]) - ord("0")
            if not 0 <= channel <= MAX_BASE64_CHANNEL:
                raise ValueError(f"bad channel character {text[0]!r}")
            return channel, base64.b64decode(text[1:].encode("ascii"), validate=True)
        except (ValueError, binascii.Error) as exc:
            # UnicodeError is a ValueError too.
            raise WebSocketError(
                f"bad base64 channel message: {exc}", CloseCode.INVALID_PAYLOAD
            ) from exc
