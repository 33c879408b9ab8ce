"""ttrpc errors: RPC status errors (gRPC codes) and protocol errors, sorted by who is at fault."""

from __future__ import annotations

from enum import IntEnum
from typing import TYPE_CHECKING

from podgate.proto.errors import LocalProtocolError, RemoteProtocolError

if TYPE_CHECKING:
    from podgate.proto.ttrpc.events import Event

__all__ = [
    "Code",
    "MalformedEnvelopeError",
    "OversizedMessageError",
    "StreamClosedError",
    "TtrpcConnectionError",
    "TtrpcError",
    "code_name",
]


class Code(IntEnum):
    """The gRPC status codes ttrpc carries in `google.rpc.Status.code`."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


def code_name(code: int) -> str:
    """`RESOURCE_EXHAUSTED` for 8; the number itself for codes gRPC does not define."""
    try:
        return Code(code).name
    except ValueError:
        return str(code)


class TtrpcError(Exception):
    """An RPC ended with a non-OK status: raised by handlers, and by clients for a call's result.

    Not a protocol error: the exchange was well formed, the call just failed.
    """

    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(f"ttrpc: {code_name(code)}: {message}")
        self.code = int(code)
        self.message = message


class TtrpcConnectionError(RemoteProtocolError):
    """The peer sent bytes that cannot be framed; the connection is dead and must be closed.

    There is no goodbye frame in ttrpc, so nothing has been queued for the peer: `code` is the
    status a driver reports to the calls that were in flight. `events` holds what the same
    `receive_data` call parsed before the fault.
    """

    def __init__(self, message: str, code: int = Code.UNAVAILABLE) -> None:
        super().__init__(message)
        self.code = int(code)
        self.events: list[Event] = []


class OversizedMessageError(LocalProtocolError):
    """We tried to send a message over the size limit (containerd/ttrpc OversizedMessageErr).

    `code` and `message` are exactly what a Go receiver would have answered.
    """

    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"message length {length} exceed maximum message size of {limit}")
        self.code = int(Code.RESOURCE_EXHAUSTED)
        self.length = length
        self.limit = limit


class StreamClosedError(LocalProtocolError):
    """We used a stream that is finished or was never ours (e.g. one the core already answered
    with an error status). A driver racing the peer may tolerate this; other misuse is a bug."""

    def __init__(self, message: str, stream_id: int) -> None:
        super().__init__(message)
        self.stream_id = stream_id


class MalformedEnvelopeError(RemoteProtocolError):
    """A frame's data is not a valid Request/Response envelope. The framing is intact, so this
    only costs the one stream (containerd/ttrpc answers "unmarshal request error")."""
