"""Framing of a container shim's attach socket (podgate's own protocol, conmon-like).

Every frame is `[type:1][length:4, big-endian][payload]`. Clients send STDIN, STDIN_CLOSE and
RESIZE; the shim sends STDOUT, STDERR and, when the container has exited, one EXIT whose
payload is the exit code in ASCII decimal, after which it closes the connection.

A frame the receiving role may not get, an unknown type or an oversize length is the peer's
fault: the codec raises `AttachProtocolError` and stays broken, and the shim drops that client.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass
from typing import Final

from podgate.proto.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "HEADER_BYTES",
    "MAX_ATTACH_FRAME",
    "MAX_DIMENSION",
    "MAX_EXIT_CODE",
    "AttachCodec",
    "AttachProtocolError",
    "Event",
    "Exit",
    "FrameType",
    "Resize",
    "Role",
    "State",
    "Stderr",
    "Stdin",
    "StdinClose",
    "Stdout",
    "encode_frame",
]

# type byte + 32-bit big-endian payload length.
HEADER_BYTES: Final = 5
# Largest payload of one frame, bytes: bounds what a peer can make us buffer before parsing.
MAX_ATTACH_FRAME: Final = 1024 * 1024
# Terminal sizes go into a struct winsize of unsigned shorts.
MAX_DIMENSION: Final = 0xFFFF
# Exit codes are one byte, or 128 + signal number; anything larger is not a process status.
MAX_EXIT_CODE: Final = 255
# Digits an EXIT payload may carry (no leading sign, no padding beyond this).
_MAX_EXIT_DIGITS: Final = 3

_HEADER: Final = struct.Struct(">BI")


class FrameType(enum.IntEnum):
    STDIN = 0
    STDOUT = 1
    STDERR = 2
    STDIN_CLOSE = 3
    RESIZE = 4
    EXIT = 5


class Role(enum.Enum):
    """Which end of the socket this codec is."""

    CLIENT = "client"
    SHIM = "shim"


class State(enum.Enum):
    """What the peer may still send us."""

    OPEN = "open"
    STDIN_CLOSED = "stdin-closed"  # shim side: the client finished its input
    DONE = "done"  # client side: EXIT arrived; nothing may follow
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class Event:
    pass


@dataclass(frozen=True, slots=True)
class Stdin(Event):
    data: bytes


@dataclass(frozen=True, slots=True)
class Stdout(Event):
    data: bytes


@dataclass(frozen=True, slots=True)
class Stderr(Event):
    data: bytes


@dataclass(frozen=True, slots=True)
class StdinClose(Event):
    pass


@dataclass(frozen=True, slots=True)
class Resize(Event):
    width: int
    height: int


@dataclass(frozen=True, slots=True)
class Exit(Event):
    code: int


class AttachProtocolError(RemoteProtocolError):
    """The peer broke the attach framing; `frame_type` is the offending type byte, if known."""

    def __init__(self, message: str, frame_type: int | None = None) -> None:
        super().__init__(message)
        self.frame_type = frame_type


# (our role, state, frame type received) -> next state. Missing pairs are protocol errors.
_TRANSITIONS: Final[dict[tuple[Role, State, FrameType], State]] = {
    (Role.SHIM, State.OPEN, FrameType.STDIN): State.OPEN,
    (Role.SHIM, State.OPEN, FrameType.STDIN_CLOSE): State.STDIN_CLOSED,
    (Role.SHIM, State.OPEN, FrameType.RESIZE): State.OPEN,
    (Role.SHIM, State.STDIN_CLOSED, FrameType.RESIZE): State.STDIN_CLOSED,
    (Role.CLIENT, State.OPEN, FrameType.STDOUT): State.OPEN,
    (Role.CLIENT, State.OPEN, FrameType.STDERR): State.OPEN,
    (Role.CLIENT, State.OPEN, FrameType.EXIT): State.DONE,
}

# What each role may put on the wire.
_SENDABLE: Final[dict[Role, frozenset[type[Event]]]] = {
    Role.CLIENT: frozenset({Stdin, StdinClose, Resize}),
    Role.SHIM: frozenset({Stdout, Stderr, Exit}),
}


def encode_frame(frame_type: FrameType, payload: bytes = b"") -> bytes:
    """One raw frame; raises LocalProtocolError for an oversize payload."""
    if len(payload) > MAX_ATTACH_FRAME:
        raise LocalProtocolError(f"attach payload of {len(payload)} bytes exceeds one frame")
    return _HEADER.pack(frame_type, len(payload)) + payload


def _encode_data(frame_type: FrameType, data: bytes) -> bytes:
    # Large writes become several frames; empty data sends nothing (b"" is never an event).
    return b"".join(
        encode_frame(frame_type, data[start : start + MAX_ATTACH_FRAME])
        for start in range(0, len(data), MAX_ATTACH_FRAME)
    )


def _check_dimension(value: int) -> None:
    if not 0 <= value <= MAX_DIMENSION:
        raise LocalProtocolError(f"terminal dimension {value} out of range")


class AttachCodec:
    """Sans-IO codec for one end of an attach connection."""

    def __init__(self, role: Role) -> None:
        self.role = role
        self.state = State.OPEN
        self._buffer = bytearray()

    # -- sending
    def send(self, event: Event) -> bytes:
        """The bytes for `event`; raises LocalProtocolError if this role may not send it."""
        if type(event) not in _SENDABLE[self.role]:
            raise LocalProtocolError(f"{self.role.value} may not send {type(event).__name__}")
        if isinstance(event, Stdin):
            return _encode_data(FrameType.STDIN, event.data)
        if isinstance(event, Stdout):
            return _encode_data(FrameType.STDOUT, event.data)
        if isinstance(event, Stderr):
            return _encode_data(FrameType.STDERR, event.data)
        if isinstance(event, StdinClose):
            return encode_frame(FrameType.STDIN_CLOSE)
        if isinstance(event, Resize):
            _check_dimension(event.width)
            _check_dimension(event.height)
            body = json.dumps({"Width": event.width, "Height": event.height}, separators=(",", ":"))
            return encode_frame(FrameType.RESIZE, body.encode("ascii"))
        assert isinstance(event, Exit)
        if not 0 <= event.code <= MAX_EXIT_CODE:
            raise LocalProtocolError(f"exit code {event.code} out of range")
        return encode_frame(FrameType.EXIT, str(event.code).encode("ascii"))

    # -- receiving
    def receive_data(self, data: bytes) -> list[Event]:
        """Parse as many complete frames as `data` finishes. Empty data frames are dropped."""
        if self.state is State.ERROR:
            raise AttachProtocolError("attach connection already failed")
        self._buffer += data
        events: list[Event] = []
        while len(self._buffer) >= HEADER_BYTES:
            raw_type, length = _HEADER.unpack_from(self._buffer)
            frame_type = self._check_header(raw_type, length)
            end = HEADER_BYTES + length
            if len(self._buffer) < end:
                break
            payload = bytes(self._buffer[HEADER_BYTES:end])
            del self._buffer[:end]
            event = self._parse(frame_type, payload)
            if event is not None:
                events.append(event)
        return events

    def receive_eof(self) -> None:
        """The peer closed; a half-received frame is its fault."""
        if self._buffer:
            self.state = State.ERROR
            raise AttachProtocolError(
                f"attach connection ended inside a frame ({len(self._buffer)} bytes pending)"
            )

    def _fail(self, message: str, frame_type: int | None) -> AttachProtocolError:
        self.state = State.ERROR
        self._buffer.clear()
        return AttachProtocolError(message, frame_type)

    def _check_header(self, raw_type: int, length: int) -> FrameType:
        try:
            frame_type = FrameType(raw_type)
        except ValueError:
            raise self._fail(f"unknown attach frame type {raw_type}", raw_type) from None
        if (self.role, self.state, frame_type) not in _TRANSITIONS:
            raise self._fail(
                f"{frame_type.name} frame not allowed for {self.role.value} in state "
                f"{self.state.value}",
                raw_type,
            )
        if length > MAX_ATTACH_FRAME:
            raise self._fail(f"attach frame of {length} bytes exceeds the limit", raw_type)
        return frame_type

    def _parse(self, frame_type: FrameType, payload: bytes) -> Event | None:
        self.state = _TRANSITIONS[(self.role, self.state, frame_type)]
        if frame_type in (FrameType.STDIN, FrameType.STDOUT, FrameType.STDERR):
            if not payload:
                return None
            if frame_type is FrameType.STDIN:
                return Stdin(payload)
            return Stdout(payload) if frame_type is FrameType.STDOUT else Stderr(payload)
        if frame_type is FrameType.STDIN_CLOSE:
            if payload:
                raise self._fail("STDIN_CLOSE frame carries a payload", frame_type)
            return StdinClose()
        if frame_type is FrameType.RESIZE:
            return self._parse_resize(payload)
        return self._parse_exit(payload)

    def _parse_resize(self, payload: bytes) -> Resize:
        try:
            body = json.loads(payload)
        except ValueError:  # also UnicodeDecodeError
            raise self._fail("RESIZE payload is not JSON", FrameType.RESIZE) from None
        if not isinstance(body, dict):
            raise self._fail("RESIZE payload is not a JSON object", FrameType.RESIZE)
        dims = []
        for key in ("Width", "Height"):
            value = body.get(key)
            # bool is an int subclass; JSON true is not a size.
            if type(value) is not int or not 0 <= value <= MAX_DIMENSION:
                raise self._fail(f"RESIZE {key} is not a size: {value!r}", FrameType.RESIZE)
            dims.append(value)
        return Resize(dims[0], dims[1])

    def _parse_exit(self, payload: bytes) -> Exit:
        if not (0 < len(payload) <= _MAX_EXIT_DIGITS and payload.isdigit()):
            raise self._fail(f"EXIT payload is not an exit code: {payload!r}", FrameType.EXIT)
        code = int(payload)
        if code > MAX_EXIT_CODE:
            raise self._fail(f"EXIT code {code} out of range", FrameType.EXIT)
        return Exit(code)
