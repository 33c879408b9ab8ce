"""HTTP/2 frames (RFC 9113 §4.1) and gRPC message framing, for a relay that passes frames on
unchanged and looks into few of them: a frame splitter, the header block of a HEADERS frame,
the data of a DATA frame, and DATA frames rebuilt with the same flow-controlled length.

Sans-IO: bytes in, frames out.
"""

from __future__ import annotations

import struct
from typing import Final, NamedTuple

from podgate.proto.errors import ProtocolError

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEADER_BYTES: Final = 9
# RFC 9113 §4.2: the largest frame size either side may allow.
MAX_FRAME_PAYLOAD_BYTES: Final = (1 << 24) - 1
# RFC 9113 §6.5.2: SETTINGS_MAX_FRAME_SIZE's initial value; a peer accepts this much at least.
DEFAULT_MAX_FRAME_BYTES: Final = 16384

DATA: Final = 0x0
HEADERS: Final = 0x1
SETTINGS: Final = 0x4
WINDOW_UPDATE: Final = 0x8
CONTINUATION: Final = 0x9
RST_STREAM: Final = 0x3
GOAWAY: Final = 0x7

END_STREAM: Final = 0x1
ACK: Final = 0x1
END_HEADERS: Final = 0x4
PADDED: Final = 0x8
PRIORITY: Final = 0x20

SETTINGS_HEADER_TABLE_SIZE: Final = 0x1

# FrameSplitter.split's `kinds`: every frame type (a mask with every `1 << type` bit set).
ALL_KINDS: Final = -1


def kinds(*types: int) -> int:
    """The `kinds` mask of FrameSplitter.split for these frame types."""
    mask = 0
    for kind in types:
        mask |= 1 << kind
    return mask


# Padding one frame may carry (its pad length is one byte).
_MAX_PAD: Final = 255

# gRPC (PROTOCOL-HTTP2.md): each message is a compressed flag, a 4-byte length, the message.
GRPC_PREFIX_BYTES: Final = 5

_HEADER = struct.Struct(">I")


class Frame(NamedTuple):
    type: int
    flags: int
    stream_id: int
    payload: memoryview
    raw: memoryview  # the whole frame as it arrived

    @property
    def end_stream(self) -> bool:
        return bool(self.flags & END_STREAM) and self.type in (DATA, HEADERS)


class FrameSplitter:
    """Cuts a byte stream into frames; the client preface first when `preface` is set."""

    def __init__(self, *, preface: bool = False, max_payload: int = MAX_FRAME_PAYLOAD_BYTES):
        self._buffer = bytearray()  # the start of a frame not yet whole
        self._need = 0  # bytes the buffer must hold before that frame is whole
        self._want_preface = preface
        self._max_payload = max_payload

    @property
    def pending(self) -> int:
        """Bytes held of a frame (or of the preface) still arriving."""
        return len(self._buffer)

    def feed(self, data: bytes | bytearray | memoryview) -> tuple[bytes, list[Frame]]:
        """(the preface if it completed now, the frames that completed)."""
        wanted = self._want_preface
        _, frames = self.split(data)
        return (PREFACE if wanted and not self._want_preface else b""), frames

    def split(
        self, data: bytes | bytearray | memoryview, kinds: int = ALL_KINDS
    ) -> tuple[bytes | memoryview, list[Frame]]:
        """(every byte that completed now, in order: the preface if it did, then the frames;
        the frames that completed and whose type is in `kinds`, a mask of `1 << type` bits).
        A relay that passes frames on unchanged sends the first as it is, without joining
        the frames again, and asks only for the frames it looks into: the others cost a
        look at their 9-byte header and nothing more."""
        if self._buffer:
            self._buffer += data
            if len(self._buffer) < self._need:  # a long frame still arriving: no copy
                return b"", []
            data = bytes(self._buffer)
            self._buffer = bytearray()
        elif not isinstance(data, bytes):
            data = bytes(data)
        end = len(data)
        offset = 0
        if self._want_preface:
            if end < len(PREFACE):
                if not PREFACE.startswith(data):
                    raise ProtocolError("not an HTTP/2 connection preface")
                self._buffer += data
                return b"", []
            if not data.startswith(PREFACE):
                raise ProtocolError("not an HTTP/2 connection preface")
            offset, self._want_preface = len(PREFACE), False
        frames = []
        view = None
        self._need = 0
        # Indexing bytes gives ints without a slice or an object per field: this loop runs
        # for every frame the relay passes on.
        while end - offset >= FRAME_HEADER_BYTES:
            length = data[offset] << 16 | data[offset + 1] << 8 | data[offset + 2]
            if length > self._max_payload:
                raise ProtocolError(f"frame of {length} bytes exceeds the maximum")
            stop = offset + FRAME_HEADER_BYTES + length
            if end < stop:
                self._need = FRAME_HEADER_BYTES + length
                break
            kind = data[offset + 3]
            if kinds >> kind & 1:
                if view is None:
                    view = memoryview(data)
                frames.append(
                    Frame(
                        kind,
                        data[offset + 4],
                        _HEADER.unpack_from(data, offset + 5)[0] & 0x7FFFFFFF,
                        view[offset + FRAME_HEADER_BYTES : stop],
                        view[offset:stop],
                    )
                )
            offset = stop
        if offset == end:
            return data, frames
        self._buffer += data[offset:]
        return memoryview(data)[:offset], frames


def _unpadded(frame: Frame) -> memoryview:
    payload = frame.payload
    if frame.flags & PADDED:
        if not payload:
            raise ProtocolError("padded frame without a pad length")
        pad = payload[0]
        if pad >= len(payload):
            raise ProtocolError("padding exceeds the frame")
        payload = payload[1 : len(payload) - pad]
    return payload


def data_of(frame: Frame) -> memoryview:
    """A DATA frame's data, without its padding."""
    return _unpadded(frame)


def header_fragment(frame: Frame) -> memoryview:
    """A HEADERS or CONTINUATION frame's header block fragment."""
    payload = _unpadded(frame) if frame.type == HEADERS else frame.payload
    if frame.type == HEADERS and frame.flags & PRIORITY:
        if len(payload) < 5:
            raise ProtocolError("HEADERS priority fields truncated")
        payload = payload[5:]
    return payload


def header_table_size(frame: Frame) -> int | None:
    """SETTINGS_HEADER_TABLE_SIZE in a (non-ACK) SETTINGS frame, if it sets it."""
    if frame.type != SETTINGS or frame.flags & ACK:
        return None
    found = None
    payload = frame.payload
    for i in range(0, len(payload) - len(payload) % 6, 6):
        if int.from_bytes(payload[i : i + 2], "big") == SETTINGS_HEADER_TABLE_SIZE:
            found = int.from_bytes(payload[i + 2 : i + 6], "big")
    return found


def window_increment(frame: Frame) -> int:
    return int(_HEADER.unpack_from(frame.payload)[0]) & 0x7FFFFFFF


def encode_frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return (
        len(payload).to_bytes(3, "big")
        + bytes((kind, flags))
        + _HEADER.pack(stream_id & 0x7FFFFFFF)
        + payload
    )


def data_frames_like(stream_id: int, data: bytes, flow_length: int, end_stream: bool) -> bytes:
    """DATA frames carrying `data` that count exactly `flow_length` bytes against flow control
    (RFC 9113 §6.1: padding counts), so both ends' windows stay as the original frames left
    them. The first frame carries the data, padded; empty padded frames take up the rest.
    ValueError when `data` is longer than `flow_length` or will not fit one frame."""
    if len(data) > flow_length or len(data) > DEFAULT_MAX_FRAME_BYTES - _MAX_PAD - 1:
        raise ValueError(f"cannot carry {len(data)} bytes in {flow_length}")
    frames: list[tuple[bytes, int]] = []  # (data, pad length or -1 for none)
    left = flow_length - len(data)
    chunk = data
    while True:
        if left == 0:
            frames.append((chunk, -1))
            break
        pad = min(left - 1, _MAX_PAD)
        frames.append((chunk, pad))
        left -= pad + 1
        chunk = b""
    out = bytearray()
    for i, (body, pad) in enumerate(frames):
        flags = END_STREAM if end_stream and i == len(frames) - 1 else 0
        if pad < 0:
            out += encode_frame(DATA, flags, stream_id, body)
        else:
            payload = bytes((pad,)) + body + bytes(pad)
            out += encode_frame(DATA, flags | PADDED, stream_id, payload)
    return bytes(out)


def encode_window_update(stream_id: int, increment: int) -> bytes:
    return encode_frame(WINDOW_UPDATE, 0, stream_id, _HEADER.pack(increment))


def grpc_message(buffer: bytes | bytearray) -> tuple[bool, bytes] | None:
    """(compressed, message) once `buffer` holds one whole gRPC message, else None."""
    if len(buffer) < GRPC_PREFIX_BYTES:
        return None
    length = _HEADER.unpack_from(buffer, 1)[0]
    if len(buffer) < GRPC_PREFIX_BYTES + length:
        return None
    return bool(buffer[0]), bytes(buffer[GRPC_PREFIX_BYTES : GRPC_PREFIX_BYTES + length])


def only_indexed(block: bytes) -> bool:
    """Whether an HPACK header block is made of indexed fields alone (RFC 7541 §6.1): its
    decoding leaves the dynamic table as it was, so the same bytes mean the same headers
    until another block changes the table."""
    i, end = 0, len(block)
    while i < end:
        first = block[i]
        if not first & 0x80:
            return False
        i += 1
        if first & 0x7F == 0x7F:  # the index goes on in the next bytes (§5.1)
            while i < end and block[i] & 0x80:
                i += 1
            i += 1
    return i == end


def encode_grpc_message(message: bytes) -> bytes:
    return b"\x00" + _HEADER.pack(len(message)) + message
