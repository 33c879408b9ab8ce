"""Cheap splitting of simple pipelined request heads, for answering them before h11 sees them.

An unauthenticated client can pipeline requests as fast as it can write; each costs the full
HTTP state machine (parse, response events, validation) about 100 µs, all to say 401. The
`HeadScanner` takes complete heads of the plain shape such clients and kubectl's API calls
have — `METHOD target HTTP/1.1`, one Host, no body, no upgrade — off the front of the buffer
with a few bytes operations. Anything else (a body, an upgrade, folded lines, a head too long
to finish, HTTP/1.0, HEAD) stops the scan, and the bytes not yet taken go to `ServerHandshake`,
which answers or rejects them as before. The scanner never decides what a request means: it
only says "this head is complete, has no body, and reads as this request".
"""

from __future__ import annotations

import re
from typing import Final

from podgate.proto.upgrade import MAX_HEAD_BYTES, Headers, UpgradeRequest

__all__ = ["HeadScanner"]

# Methods taken: those that API clients send without a body here. HEAD is left to h11 (its
# response has no body) and so is anything unusual.
_METHODS: Final = frozenset({b"GET", b"POST", b"PUT", b"PATCH", b"DELETE", b"OPTIONS"})
# Headers that give a request a body, change the connection or ask for something before the
# body: a head with one of them goes the full way.
_FULL_PATH_HEADERS: Final = frozenset(
    {b"content-length", b"transfer-encoding", b"upgrade", b"expect", b"te", b"trailer"}
)
# A request target without spaces or controls; a header line `token: value` (RFC 9110 field
# name and visible value, optional whitespace around it). Folded lines do not match.
_TARGET: Final = re.compile(rb"[\x21-\x7e]+")
_FIELD: Final = re.compile(
    rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*([\t\x20-\x7e\x80-\xff]*?)[ \t]*"
)
_END: Final = b"\r\n\r\n"


class HeadScanner:
    """Buffer of one connection's unparsed bytes; `next_request()` takes simple heads off it."""

    __slots__ = ("_buffer", "_last", "_stopped")

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._last = b""  # the bytes of the head next_request() returned last
        self._stopped = False  # a head that needs the full parser is at the front

    def receive_data(self, data: bytes) -> None:
        self._buffer += data

    @property
    def stopped(self) -> bool:
        """The next head is not simple (or cannot be a head within the size limit): hand the
        rest over."""
        return self._stopped

    def next_request(self) -> UpgradeRequest | None:
        """The request at the front if it is complete and simple (its bytes are consumed);
        None if more data is needed or the scan stopped."""
        if self._stopped:
            return None
        buffer = self._buffer
        end = buffer.find(_END, 0, MAX_HEAD_BYTES + len(_END))
        if end < 0:
            if len(buffer) > MAX_HEAD_BYTES or buffer.startswith(b"\r\n"):
                self._stopped = True
            return None
        request = _simple(bytes(buffer[:end]))
        if request is None:
            self._stopped = True
            return None
        self._last = bytes(buffer[: end + len(_END)])
        del buffer[: end + len(_END)]
        return request

    def take_rest(self, *, with_last: bool = False) -> bytes:
        """Everything not consumed, for the full parser (after the head returned last, when
        the caller leaves that one to the full parser too); the scanner is empty afterwards."""
        rest = (self._last if with_last else b"") + bytes(self._buffer)
        self._buffer.clear()
        self._last = b""
        self._stopped = True
        return rest


def _simple(head: bytes) -> UpgradeRequest | None:
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[2] != b"HTTP/1.1" or parts[0] not in _METHODS:
        return None
    target = parts[1]
    if _TARGET.fullmatch(target) is None:
        return None
    headers: list[tuple[bytes, bytes]] = []
    hosts = 0
    for line in lines[1:]:
        field = _FIELD.fullmatch(line)
        if field is None:
            return None
        name, value = field[1].lower(), field[2]
        if name in _FULL_PATH_HEADERS:
            return None
        if name == b"connection" and value.lower() != b"keep-alive":
            return None
        hosts += name == b"host"
        headers.append((name, value))
    if hosts != 1:
        return None
    result: Headers = tuple(headers)
    return UpgradeRequest(parts[0].decode("ascii"), target.decode("ascii"), result)
