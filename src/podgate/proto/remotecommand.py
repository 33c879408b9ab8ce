"""exec/attach ("remotecommand") semantics shared by the SPDY and WebSocket transports.

Covers what sits above the framing: protocol versions and what each one changes, the request
options and their two query spellings (API server and kubelet), which streams a session needs,
collecting the SPDY streams of one session, terminal resize events, and the error stream.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final
from urllib.parse import unquote_to_bytes

from podgate.proto.errors import LocalProtocolError, RemoteProtocolError
from podgate.proto.k8s import (
    REASON_BAD_REQUEST,
    STATUS_SUCCESS,
    StatusError,
    encode_status,
    status_exit_code,
    status_internal_error,
    status_success,
)

__all__ = [
    "CLIENT_SPDY_PROTOCOLS",
    "MAX_RESIZE_BUFFER",
    "MAX_RESIZE_NESTING",
    "SERVER_SPDY_PROTOCOLS",
    "STREAM_CREATION_TIMEOUT",
    "STREAM_TIMEOUT_MESSAGE",
    "STREAM_TYPE_HEADER",
    "V1",
    "V1_BASE64",
    "V2",
    "V3",
    "V4",
    "V4_BASE64",
    "V5",
    "Accept",
    "ExecOptions",
    "Ignore",
    "InvalidExecOptions",
    "Reject",
    "ResizeDecoder",
    "ResizeProtocolError",
    "SpdyStreamSet",
    "StreamType",
    "TerminalSize",
    "encode_resize",
    "error_stream_payload",
    "expected_streams",
    "has_close_signal",
    "header_value",
    "parse_options",
    "parse_query",
    "parse_target",
    "protocol_version",
    "status_is_json",
    "status_payload",
    "supports_resize",
]

# --- protocol names and versions ---------------------------------------------------------------

V1: Final = "channel.k8s.io"
V2: Final = "v2.channel.k8s.io"
V3: Final = "v3.channel.k8s.io"
V4: Final = "v4.channel.k8s.io"
V5: Final = "v5.channel.k8s.io"
# WebSocket-only text variants: same semantics as V1 and V4, payloads base64-encoded.
V1_BASE64: Final = "base64.channel.k8s.io"
V4_BASE64: Final = "v4.base64.channel.k8s.io"

# What a kubelet/CRI SPDY server offers, best first; kubectl 1.29+ ends up on v4 with it.
SERVER_SPDY_PROTOCOLS: Final = (V4, V3, V2, V1)
# What kubectl 1.29-1.33 offers over SPDY, best first.
CLIENT_SPDY_PROTOCOLS: Final = (V5, V4, V3, V2, V1)

# "" is what a client that skipped negotiation gets: the server falls back to v1.
_VERSIONS: Final[Mapping[str, int]] = {
    "": 1,
    V1: 1,
    V1_BASE64: 1,
    V2: 2,
    V3: 3,
    V4: 4,
    V4_BASE64: 4,
    V5: 5,
}


def protocol_version(protocol: str) -> int:
    """1..5 for a negotiated remotecommand protocol name; anything else is our own bug."""
    try:
        return _VERSIONS[protocol]
    except KeyError:
        raise LocalProtocolError(f"not a remotecommand protocol: {protocol!r}") from None


def supports_resize(protocol: str, *, websocket: bool = False) -> bool:
    """Whether a tty session gets resize events: v3+ over SPDY, always over WebSocket."""
    return websocket or protocol_version(protocol) >= 3


def status_is_json(protocol: str) -> bool:
    """v4+ carry a JSON Status on the error stream; older ones plain text, on failure only."""
    return protocol_version(protocol) >= 4


def has_close_signal(protocol: str) -> bool:
    """v5 adds the WebSocket CLOSE message; over SPDY v5 behaves as v4 (FIN does the job)."""
    return protocol_version(protocol) >= 5


class StreamType(StrEnum):
    """The `streamtype` header of a SPDY stream; each maps to a WebSocket channel."""

    ERROR = "error"
    STDIN = "stdin"
    STDOUT = "stdout"
    STDERR = "stderr"
    RESIZE = "resize"

    @property
    def channel(self) -> int:
        return _CHANNELS[self]


_CHANNELS: Final[Mapping[StreamType, int]] = {
    StreamType.STDIN: 0,
    StreamType.STDOUT: 1,
    StreamType.STDERR: 2,
    StreamType.ERROR: 3,
    StreamType.RESIZE: 4,
}

STREAM_TYPE_HEADER: Final = "streamtype"


def header_value(headers: Mapping[str, str], name: str) -> str:
    """Go's `Header.Get`: names match case-insensitively, the first NUL-joined value wins."""
    value = headers.get(name)
    if value is None:
        lowered = name.lower()
        value = next((v for k, v in headers.items() if k.lower() == lowered), "")
    return value.split("\0", 1)[0]


# --- request options ---------------------------------------------------------------------------


class InvalidExecOptions(StatusError):
    """The exec/attach request cannot be served; answered with HTTP 400 before any upgrade."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code=400, reason=REASON_BAD_REQUEST)


@dataclass(frozen=True, slots=True)
class ExecOptions:
    """What an exec/attach request asked for. `command` is empty for attach."""

    command: tuple[str, ...] = ()
    container: str | None = None
    stdin: bool = False
    stdout: bool = False
    stderr: bool = False
    tty: bool = False


# Query parameter names: the API server uses the PodExecOptions names, the kubelet its own.
_API_NAMES: Final = {"stdin": "stdin", "stdout": "stdout", "stderr": "stderr", "tty": "tty"}
_KUBELET_NAMES: Final = {"stdin": "input", "stdout": "output", "stderr": "error", "tty": "tty"}

_PERCENT_RE: Final = re.compile(rb"%(?![0-9A-Fa-f]{2})")


def _unescape(raw: bytes) -> str | None:
    """Go's `url.QueryUnescape`; None where Go fails (a bad `%` escape) and drops the pair."""
    if _PERCENT_RE.search(raw):
        return None
    decoded = unquote_to_bytes(raw.replace(b"+", b" "))
    try:
        return decoded.decode("utf-8")
    except UnicodeDecodeError:
        # Go would carry the raw bytes; refusing beats silently altering a command's arguments.
        raise StatusError(
            "query parameter is not valid UTF-8", code=400, reason=REASON_BAD_REQUEST
        ) from None


def parse_query(query: str | bytes) -> list[tuple[str, str]]:
    """Go's `url.ParseQuery` as `req.URL.Query()` uses it: bad pairs are dropped, not fatal."""
    if isinstance(query, str):
        query = query.encode("utf-8")
    pairs: list[tuple[str, str]] = []
    for part in query.split(b"&"):
        if not part or b";" in part:
            continue
        raw_key, _, raw_value = part.partition(b"=")
        key = _unescape(raw_key)
        value = _unescape(raw_value)
        if key is None or value is None:
            continue
        pairs.append((key, value))
    return pairs


def parse_target(target: str | bytes) -> tuple[str, list[tuple[str, str]]]:
    """Split an HTTP request-target into its raw (still escaped) path and decoded query pairs."""
    if isinstance(target, str):
        target = target.encode("utf-8")
    path, _, query = target.partition(b"?")
    return path.decode("latin-1"), parse_query(query)


def _first(query: Sequence[tuple[str, str]], name: str) -> str | None:
    return next((value for key, value in query if key == name), None)


def _api_bool(value: str | None) -> bool:
    # apimachinery's Convert_Slice_string_To_bool: only absent, "0" and "false" are false.
    return value is not None and value != "0" and value.casefold() != "false"


def _kubelet_bool(value: str | None) -> bool:
    return value == "1"


def parse_options(
    query: Sequence[tuple[str, str]] | str | bytes, *, kubelet_style: bool = False
) -> ExecOptions:
    """Read exec/attach options from decoded query pairs (or a raw query string).

    API-server style reads `stdin`/`stdout`/`stderr`/`tty` leniently (Python clients send
    `True`); kubelet style reads `input`/`output`/`error`/`tty` and only `1` means true (the
    container is in the kubelet's path, not its query). As the kubelet does, stderr is dropped
    when tty is set, then at least one of stdin, stdout, stderr must remain.
    """
    if isinstance(query, str | bytes):
        query = parse_query(query)
    names = _KUBELET_NAMES if kubelet_style else _API_NAMES
    parse = _kubelet_bool if kubelet_style else _api_bool
    flags = {field: parse(_first(query, name)) for field, name in names.items()}
    if flags["tty"] and flags["stderr"]:
        flags["stderr"] = False
    if not (flags["stdin"] or flags["stdout"] or flags["stderr"]):
        raise InvalidExecOptions("you must specify at least 1 of stdin, stdout, stderr")
    container = None if kubelet_style else _first(query, "container")
    return ExecOptions(
        command=tuple(value for key, value in query if key == "command"),
        container=container or None,
        stdin=flags["stdin"],
        stdout=flags["stdout"],
        stderr=flags["stderr"],
        tty=flags["tty"],
    )


def expected_streams(opts: ExecOptions, protocol: str) -> frozenset[StreamType]:
    """The SPDY streams a session waits for: error always, resize for a tty on v3+."""
    streams = {StreamType.ERROR}
    if opts.stdin:
        streams.add(StreamType.STDIN)
    if opts.stdout:
        streams.add(StreamType.STDOUT)
    if opts.stderr:
        streams.add(StreamType.STDERR)
    if opts.tty and supports_resize(protocol):
        streams.add(StreamType.RESIZE)
    return frozenset(streams)


# --- SPDY stream setup -------------------------------------------------------------------------

# kubelet/CRI default: how long a client may take to open every stream of a session, seconds.
STREAM_CREATION_TIMEOUT: Final = 30.0
STREAM_TIMEOUT_MESSAGE: Final = "timed out waiting for client to create streams"


@dataclass(frozen=True, slots=True)
class Accept:
    """Reply to the stream and use it as `stream_type`."""

    stream_id: int
    stream_type: StreamType


@dataclass(frozen=True, slots=True)
class Ignore:
    """Reply to the stream, then leave it unused (an unknown or unrequested type)."""

    stream_id: int
    stream_type: str


@dataclass(frozen=True, slots=True)
class Reject:
    """Reset the stream (RST_STREAM CANCEL) without replying."""

    stream_id: int
    reason: str


class SpdyStreamSet:
    """Collects the streams of one SPDY exec/attach session until every expected one arrived.

    Time is passed in. The session has STREAM_CREATION_TIMEOUT seconds from `now` at
    creation, or, without it, from the first `deadline`/`expired` call. Upstream gives up
    silently on timeout (STREAM_TIMEOUT_MESSAGE is only logged).
    """

    def __init__(
        self,
        expected: frozenset[StreamType],
        now: float | None = None,
        *,
        timeout: float = STREAM_CREATION_TIMEOUT,
    ) -> None:
        if StreamType.ERROR not in expected:
            raise LocalProtocolError("every remotecommand session has an error stream")
        self.expected = expected
        self.timeout = timeout
        self._started_at = now
        self._streams: dict[StreamType, int] = {}

    def add(self, stream_id: int, headers: Mapping[str, str]) -> Accept | Ignore | Reject:
        raw = header_value(headers, STREAM_TYPE_HEADER)
        try:
            stream_type = StreamType(raw)
        except ValueError:
            return Ignore(stream_id, raw)
        if stream_type not in self.expected:
            return Ignore(stream_id, raw)
        if stream_type in self._streams:
            return Reject(stream_id, f"duplicate {raw} stream")
        self._streams[stream_type] = stream_id
        return Accept(stream_id, stream_type)

    @property
    def streams(self) -> Mapping[StreamType, int]:
        """Stream id of each accepted stream type."""
        return dict(self._streams)

    @property
    def missing(self) -> frozenset[StreamType]:
        return self.expected - self._streams.keys()

    @property
    def complete(self) -> bool:
        return len(self._streams) == len(self.expected)

    def deadline(self, now: float) -> float:
        """When the set must be complete; starts the clock at `now` if it is not running."""
        if self._started_at is None:
            self._started_at = now
        return self._started_at + self.timeout

    def expired(self, now: float) -> bool:
        return not self.complete and now >= self.deadline(now)


# --- terminal resize ---------------------------------------------------------------------------

# A resize event is ~30 bytes; more than this unfinished means the peer is not sending them.
MAX_RESIZE_BUFFER: Final = 4096
# Resize events are flat; deep nesting would only feed the JSON parser's recursion.
MAX_RESIZE_NESTING: Final = 32
# Width and height are Go uint16 values.
_MAX_DIMENSION: Final = 0xFFFF

_JSON_SPACE: Final = b" \t\r\n"
_OPEN: Final = b"{["
_CLOSE: Final = b"}]"


class ResizeProtocolError(RemoteProtocolError):
    """The resize stream held something other than a series of TerminalSize objects."""


@dataclass(frozen=True, slots=True)
class TerminalSize:
    width: int
    height: int


def encode_resize(width: int, height: int) -> bytes:
    """One resize event exactly as kubectl writes it."""
    for value in (width, height):
        if not 0 <= value <= _MAX_DIMENSION:
            raise LocalProtocolError(f"terminal dimension {value} is outside 0..{_MAX_DIMENSION}")
    return b'{"Width":%d,"Height":%d}\n' % (width, height)


class _Negative:
    """Stands in for a negative JSON integer, which a Go uint16 refuses."""


def _parse_int(literal: str) -> int | _Negative:
    return _Negative() if literal.startswith("-") else int(literal)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _dimension(key: str, value: Any) -> int:
    if type(value) is not int or value > _MAX_DIMENSION:
        raise ResizeProtocolError(f"resize {key} is not an integer in 0..{_MAX_DIMENSION}")
    return value


def _terminal_size(obj: bytes) -> TerminalSize:
    try:
        pairs = json.loads(
            obj.decode("utf-8", "replace"),
            object_pairs_hook=list,
            parse_int=_parse_int,
            parse_constant=_reject_constant,
        )
    except ValueError as exc:
        raise ResizeProtocolError(f"invalid resize event: {exc}") from None
    width = height = 0
    # Go matches struct fields case-insensitively and lets a later duplicate key win.
    for key, value in pairs:
        name = key.lower()
        if value is None or name not in ("width", "height"):
            continue
        if name == "width":
            width = _dimension(key, value)
        else:
            height = _dimension(key, value)
    return TerminalSize(width, height)


class ResizeDecoder:
    """Streaming decoder for a resize stream (SPDY `resize` or WebSocket channel 4).

    Accepts JSON objects back to back, with or without whitespace between them, as Go's
    `json.Decoder` does. After the first error the decoder stays failed.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0  # next byte to scan
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._error: ResizeProtocolError | None = None

    def feed(self, data: bytes) -> list[TerminalSize]:
        if self._error is not None:
            raise self._error
        try:
            return self._feed(data)
        except ResizeProtocolError as exc:
            self._error = exc
            raise

    def end(self) -> None:
        """The stream ended: raise if an event was left unfinished."""
        if self._error is not None:
            raise self._error
        if self._buf.strip(_JSON_SPACE):
            self._error = ResizeProtocolError("resize stream ended inside an event")
            raise self._error

    def _feed(self, data: bytes) -> list[TerminalSize]:
        self._buf += data
        sizes: list[TerminalSize] = []
        buf = self._buf
        while True:
            if self._depth == 0:
                start = len(buf) - len(buf.lstrip(_JSON_SPACE))
                del buf[:start]
                if not buf:
                    return sizes
                if buf[0] != ord("{"):
                    raise ResizeProtocolError(
                        f"invalid character {chr(buf[0])!r} where a resize event should start"
                    )
                self._depth, self._pos = 1, 1
            end = self._scan()
            if end is None:
                if len(buf) > MAX_RESIZE_BUFFER:
                    raise ResizeProtocolError(f"resize event longer than {MAX_RESIZE_BUFFER} bytes")
                return sizes
            sizes.append(_terminal_size(bytes(buf[:end])))
            del buf[:end]
            self._pos = 0

    def _scan(self) -> int | None:
        """Advance to the end of the current top-level object; its length, or None if partial."""
        buf = self._buf
        for i in range(self._pos, len(buf)):
            byte = buf[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif byte == 0x5C:  # backslash
                    self._escaped = True
                elif byte == 0x22:  # quote
                    self._in_string = False
            elif byte == 0x22:
                self._in_string = True
            elif byte in _OPEN:
                self._depth += 1
                if self._depth > MAX_RESIZE_NESTING:
                    raise ResizeProtocolError("resize event nested too deeply")
            elif byte in _CLOSE:
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        self._pos = len(buf)
        return None


# --- error stream ------------------------------------------------------------------------------


def status_payload(protocol: str, status: Mapping[str, Any]) -> bytes | None:
    """What the server writes on the error stream for `status`, or None for nothing.

    v4+ always write the Status JSON. v1-v3 write its message as text, and only on failure.
    """
    if status_is_json(protocol):
        return encode_status(status)
    if status.get("status") == STATUS_SUCCESS:
        return None
    message = str(status.get("message") or "")
    return message.encode("utf-8") or None


def error_stream_payload(
    protocol: str, exit_code: int | None, message: str | None = None
) -> bytes | None:
    """The error stream payload for how a command ended.

    `exit_code` 0 is success; 1..255 is a non-zero exit with `message` as the runtime's text;
    None is a failure to run at all, described by `message`.
    """
    if exit_code == 0:
        status = status_success()
    elif exit_code is not None:
        status = status_exit_code(exit_code, message or f"exit code {exit_code}")
    elif message:
        status = status_internal_error(message)
    else:
        raise LocalProtocolError("a failure without an exit code needs a message")
    return status_payload(protocol, status)
