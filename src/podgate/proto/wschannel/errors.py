"""WebSocket errors, each carrying the close code that goes on the wire."""

from __future__ import annotations

from enum import IntEnum

from podgate.proto.errors import RemoteProtocolError


class CloseCode(IntEnum):
    """RFC 6455 section 7.4.1 status codes podgate sends or expects."""

    NORMAL = 1000
    GOING_AWAY = 1001
    PROTOCOL_ERROR = 1002
    UNSUPPORTED_DATA = 1003
    ABNORMAL = 1006  # never on the wire: the TCP connection ended without a close frame
    INVALID_PAYLOAD = 1007
    POLICY_VIOLATION = 1008
    MESSAGE_TOO_BIG = 1009
    INTERNAL_ERROR = 1011


class WebSocketError(RemoteProtocolError):
    """The peer broke the WebSocket or channel protocol; the connection is finished.

    A close frame with `close_code` has been queued when the state still allowed one.
    """

    def __init__(self, message: str, close_code: int = CloseCode.PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.close_code = int(close_code)
