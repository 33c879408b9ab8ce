"""NRI's connection multiplexer (containerd/nri pkg/net/multiplex), sans-IO.

One trunk connection carries several logical connections. Every frame is an 8-byte header
(ConnID uint32 BE, payload length uint32 BE) and the payload; ConnID 0 is reserved. NRI uses
ConnID 1 for the plugin's ttrpc server (`PLUGIN_SERVICE_CONN`) and ConnID 2 for the runtime's
(`RUNTIME_SERVICE_CONN`). "Opening" a connection sends nothing: both ends just assume it.

Reading is simple: `MuxDecoder.receive_data(data)` returns whole frames; the payloads of one
ConnID concatenate into that connection's byte stream.

Writing to a Go peer is not: the Go mux hands one whole frame to each `Read` and fails when the
reader's buffer is smaller, and Go ttrpc reads through a 4096-byte bufio.Reader. So a frame may
never hold bytes of two ttrpc messages, the first frame of a message must fit 4096 bytes, and no
frame may be longer than what is left of its message. `TtrpcFramer` splits the byte stream a
ttrpc endpoint writes at message boundaries and frames it the way Go's own writer does: a whole
message when it fits 4096 bytes, else 4096 bytes and then the rest.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from podgate.proto.errors import LocalProtocolError, RemoteProtocolError
from podgate.proto.ttrpc import frames as ttrpc_frames

__all__ = [
    "FIRST_FRAME_LIMIT",
    "HEADER_LENGTH",
    "MAX_CONN_ID",
    "MAX_PAYLOAD",
    "PLUGIN_SERVICE_CONN",
    "RESERVED_CONN_ID",
    "RUNTIME_SERVICE_CONN",
    "MuxDecoder",
    "MuxFrame",
    "MuxProtocolError",
    "TtrpcFramer",
    "encode_frame",
]

HEADER_LENGTH = 8  # bytes: ConnID(4) + payload length(4)
RESERVED_CONN_ID = 0  # "reserved for future use" in Go; a frame for it is garbage
PLUGIN_SERVICE_CONN = 1  # the plugin serves the Plugin service, the runtime calls it
RUNTIME_SERVICE_CONN = 2  # the runtime serves the Runtime service, the plugin calls it
MAX_CONN_ID = 0xFFFFFFFF  # ConnIDs are a uint32
# bytes per frame; Go's maxPayloadSize, one whole ttrpc message (header + 4 MiB of data).
MAX_PAYLOAD = ttrpc_frames.HEADER_LENGTH + ttrpc_frames.MAX_MESSAGE_LENGTH
# bytes; the size of Go ttrpc's bufio.Reader. A ttrpc message's first frame must fit in it.
FIRST_FRAME_LIMIT = 4096

_TTRPC_HEADER_LENGTH = ttrpc_frames.HEADER_LENGTH
_HEADER = struct.Struct(">II")
_TTRPC_LENGTH = struct.Struct(">I")


class MuxProtocolError(RemoteProtocolError):
    """The peer sent bytes that are not mux frames; the trunk cannot be trusted any more."""


@dataclass(frozen=True, slots=True)
class MuxFrame:
    """One received frame: `payload` belongs to logical connection `conn_id`."""

    conn_id: int
    payload: bytes


def encode_frame(conn_id: int, payload: bytes | bytearray | memoryview) -> bytes:
    """One frame, header and payload."""
    if not RESERVED_CONN_ID < conn_id <= MAX_CONN_ID:
        raise LocalProtocolError(f"ConnID {conn_id} is reserved or out of range")
    if len(payload) > MAX_PAYLOAD:
        raise LocalProtocolError(f"oversized message ({len(payload)} > {MAX_PAYLOAD})")
    return _HEADER.pack(conn_id, len(payload)) + payload


class MuxDecoder:
    """Frames out of trunk bytes that arrive in arbitrary pieces.

    After an error the decoder is dead: every later call raises the same error.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._error: MuxProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete frame held back."""
        return len(self._buffer)

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[MuxFrame]:
        if self._error is not None:
            raise self._error
        self._buffer += data
        try:
            return self._receive()
        except MuxProtocolError:
            self._buffer = bytearray()
            raise

    def _receive(self) -> list[MuxFrame]:
        frames: list[MuxFrame] = []
        buffer = self._buffer
        with memoryview(buffer) as view:
            offset = self._split(buffer, view, frames)
        if offset:
            del buffer[:offset]
        return frames

    def _split(self, buffer: bytearray, view: memoryview, frames: list[MuxFrame]) -> int:
        offset = 0
        while len(buffer) - offset >= HEADER_LENGTH:
            conn_id, length = _HEADER.unpack_from(buffer, offset)
            if conn_id == RESERVED_CONN_ID:
                self._error = MuxProtocolError(f"frame for reserved ConnID {conn_id}")
            elif length > MAX_PAYLOAD:
                self._error = MuxProtocolError(
                    f"frame length {length} exceeds the maximum of {MAX_PAYLOAD}"
                )
            if self._error is not None:
                raise self._error
            end = offset + HEADER_LENGTH + length
            if len(buffer) < end:
                break
            frames.append(MuxFrame(conn_id, bytes(view[offset + HEADER_LENGTH : end])))
            offset = end
        return offset

    def receive_eof(self) -> None:
        """The trunk ended; a frame cut short is the peer's fault."""
        if self._error is not None:
            raise self._error
        if self._buffer:
            self._error = MuxProtocolError(
                f"trunk ended inside a frame ({len(self._buffer)} bytes pending)"
            )
            self._buffer = bytearray()
            raise self._error


class TtrpcFramer:
    """Frames for one logical connection out of the ttrpc byte stream written to it.

    `feed(data)` buffers until a ttrpc message is complete, then returns its encoded frames:
    the whole message when it fits `FIRST_FRAME_LIMIT`, else `FIRST_FRAME_LIMIT` bytes followed
    by the rest in frames of at most `MAX_PAYLOAD`. Two messages never share a frame.
    """

    def __init__(self, conn_id: int) -> None:
        if not RESERVED_CONN_ID < conn_id <= MAX_CONN_ID:
            raise LocalProtocolError(f"ConnID {conn_id} is reserved or out of range")
        self.conn_id = conn_id
        self._header = _HEADER.pack(conn_id, 0)[:4]
        self._buffer = bytearray()

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete ttrpc message held back."""
        return len(self._buffer)

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        self._buffer += data
        frames: list[bytes] = []
        buffer = self._buffer
        view = memoryview(buffer)
        offset = 0
        try:
            while len(buffer) - offset >= _TTRPC_HEADER_LENGTH:
                (length,) = _TTRPC_LENGTH.unpack_from(buffer, offset)
                if length >= ttrpc_frames.FRAMEABLE_LENGTH_LIMIT:
                    # Our own ttrpc endpoint wrote something that is not a ttrpc frame.
                    raise LocalProtocolError(f"ttrpc message length {length} is not frameable")
                end = offset + _TTRPC_HEADER_LENGTH + length
                if len(buffer) < end:
                    break
                frames.extend(self._frames(view[offset:end]))
                offset = end
        finally:
            view.release()
        if offset:
            del buffer[:offset]
        return frames

    def _frames(self, message: memoryview) -> list[bytes]:
        first = min(len(message), FIRST_FRAME_LIMIT)
        frames = [self._frame(message[:first])]
        for start in range(first, len(message), MAX_PAYLOAD):
            frames.append(self._frame(message[start : start + MAX_PAYLOAD]))
        return frames

    def _frame(self, payload: memoryview) -> bytes:
        return b"".join((self._header, _TTRPC_LENGTH.pack(len(payload)), payload))
