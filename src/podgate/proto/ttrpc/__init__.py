"""ttrpc, containerd's lightweight RPC (the NRI and shim transport): a sans-IO connection core.

Feed bytes to `TtrpcConnection.receive_data`, act on the returned events, and write out
`data_to_send()`. Nothing here does I/O or reads the clock. The envelope messages are generated
from `envelope.proto` and `status.proto` (`python -m podgate.proto.ttrpc.generate`).
"""

from podgate.proto.ttrpc.connection import (
    CLIENT_TRANSITIONS,
    SERVER_TRANSITIONS,
    Role,
    StreamState,
    TtrpcConnection,
)
from podgate.proto.ttrpc.errors import (
    Code,
    MalformedEnvelopeError,
    OversizedMessageError,
    StreamClosedError,
    TtrpcConnectionError,
    TtrpcError,
    code_name,
)
from podgate.proto.ttrpc.events import (
    ConnectionClosed,
    DataReceived,
    Event,
    RequestMode,
    RequestReceived,
    ResponseReceived,
    StreamAborted,
)
from podgate.proto.ttrpc.frames import (
    FLAG_NO_DATA,
    FLAG_REMOTE_CLOSED,
    FLAG_REMOTE_OPEN,
    FRAMEABLE_LENGTH_LIMIT,
    HEADER_LENGTH,
    MAX_MESSAGE_LENGTH,
    MAX_STREAM_ID,
    FrameHeader,
    MessageType,
)

__all__ = [
    "CLIENT_TRANSITIONS",
    "FLAG_NO_DATA",
    "FLAG_REMOTE_CLOSED",
    "FLAG_REMOTE_OPEN",
    "FRAMEABLE_LENGTH_LIMIT",
    "HEADER_LENGTH",
    "MAX_MESSAGE_LENGTH",
    "MAX_STREAM_ID",
    "SERVER_TRANSITIONS",
    "Code",
    "ConnectionClosed",
    "DataReceived",
    "Event",
    "FrameHeader",
    "MalformedEnvelopeError",
    "MessageType",
    "OversizedMessageError",
    "RequestMode",
    "RequestReceived",
    "ResponseReceived",
    "Role",
    "StreamAborted",
    "StreamClosedError",
    "StreamState",
    "TtrpcConnection",
    "TtrpcConnectionError",
    "TtrpcError",
    "code_name",
]
