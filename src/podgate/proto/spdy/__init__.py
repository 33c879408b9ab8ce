"""SPDY/3 as Kubernetes speaks it (moby/spdystream): a sans-IO connection core.

Feed bytes to `SpdyConnection.receive_data`, act on the returned events, and write out
`data_to_send()`. Nothing here does I/O or reads the clock.
"""

from podgate.proto.spdy.connection import (
    DEFAULT_MAX_DATA_FRAME,
    MAX_CONCURRENT_STREAMS,
    MAX_WINDOW_BYTES,
    STREAM_WINDOW_BYTES,
    DataInProgress,
    Role,
    SpdyConnection,
    StreamState,
)
from podgate.proto.spdy.dictionary import HEADER_DICTIONARY
from podgate.proto.spdy.errors import SpdyConnectionError, StreamClosedError
from podgate.proto.spdy.events import (
    ConnectionClosed,
    DataReceived,
    Event,
    GoAwayReceived,
    PingAcknowledged,
    PingReceived,
    SettingsReceived,
    StreamAborted,
    StreamOpened,
    StreamReplied,
    StreamReset,
    WindowUpdated,
    WindowUpdateReceived,
)
from podgate.proto.spdy.frames import (
    FLAG_FIN,
    FLAG_UNIDIRECTIONAL,
    MAX_CONTROL_FRAME_LENGTH,
    MAX_FRAME_LENGTH,
    ControlType,
    GoAwayStatus,
    RstStatus,
    SettingsId,
)
from podgate.proto.spdy.headers import (
    MAX_HEADER_BLOCK_BYTES,
    MAX_HEADER_PAIRS,
    HeaderCompressor,
    HeaderDecompressor,
)

__all__ = [
    "DEFAULT_MAX_DATA_FRAME",
    "FLAG_FIN",
    "FLAG_UNIDIRECTIONAL",
    "HEADER_DICTIONARY",
    "MAX_CONCURRENT_STREAMS",
    "MAX_CONTROL_FRAME_LENGTH",
    "MAX_FRAME_LENGTH",
    "MAX_HEADER_BLOCK_BYTES",
    "MAX_HEADER_PAIRS",
    "MAX_WINDOW_BYTES",
    "STREAM_WINDOW_BYTES",
    "ConnectionClosed",
    "ControlType",
    "DataInProgress",
    "DataReceived",
    "Event",
    "GoAwayReceived",
    "GoAwayStatus",
    "HeaderCompressor",
    "HeaderDecompressor",
    "PingAcknowledged",
    "PingReceived",
    "Role",
    "RstStatus",
    "SettingsId",
    "SettingsReceived",
    "SpdyConnection",
    "SpdyConnectionError",
    "StreamAborted",
    "StreamClosedError",
    "StreamOpened",
    "StreamReplied",
    "StreamReset",
    "StreamState",
    "WindowUpdateReceived",
    "WindowUpdated",
]
