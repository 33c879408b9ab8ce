"""The runtime's streaming server: the CRI streaming server of podgate.streaming.tokenserver,
where podgate's own Exec/Attach/PortForward URLs point."""

from podgate.streaming.tokenserver import (
    DEFAULT_STREAM_IDLE_TIMEOUT_SECONDS,
    InsecureAddressError,
    PendingStream,
    StreamingServer,
    check_address,
)

__all__ = [
    "DEFAULT_STREAM_IDLE_TIMEOUT_SECONDS",
    "InsecureAddressError",
    "PendingStream",
    "StreamingServer",
    "check_address",
]
