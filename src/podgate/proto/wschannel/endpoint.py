"""The shared WebSocket layer: RFC 6455 framing, bounded reassembly, control frames, errors.

Framing is podgate's own, on top of websockets' C `apply_mask` (see `frames.py`). The whole
data path of the channel protocols and of the SPDY tunnel runs through here, so it is built
for CPU per byte:

- Receiving parses frames in place in the caller's bytes. A payload piece costs exactly one
  copy: the unmask (C) on the server, a slice on the client. Partial frames are handed on as
  they arrive (the tunnel needs no reassembly); only a channel message that spans several
  reads is joined. The channel byte of a binary message is read out of the first payload
  byte, so the payload is never sliced again.
- Sending queues a header and the caller's buffer, uncopied unless it is mutable; a client
  masks with one C pass. `buffers_to_send()` gives them to `writelines` as they are.

Neither library's protocol object does this. wsproto (used before) unmasks in pure Python
(~1 CPU-s/GB), copies a sent payload three times, and runs a generator parser with a
per-frame cost that dominated kubectl's ~10 KB tunnel messages. websockets' sans-IO
`Protocol` has the C mask, but holds a frame until it is complete (the tunnel would have to
buffer), parses through generators that copy each frame out of a buffer, and serializes
through BytesIO (two copies per payload). Parsing a stream of 10 KB masked frames, in
CPU-s/GB on the benchmark machine: wsproto 1.9-2.0, websockets `Protocol` 0.5, this 0.27.
Sending 256 KiB messages: wsproto 0.9 (server) / 2.1 (client), this 0.003 / 0.03.

On top of framing: automatic pong and close replies, bounded reassembly, and one exception
type (WebSocketError) for everything the peer can do wrong, with a close frame queued
before it is raised.
"""

from __future__ import annotations

import codecs
import os
import struct
from enum import Enum
from typing import NoReturn

from podgate.proto.errors import LocalProtocolError
from podgate.proto.wschannel.errors import CloseCode, WebSocketError
from podgate.proto.wschannel.events import (
    CloseReceived,
    Event,
    PingReceived,
    PongReceived,
)
from podgate.proto.wschannel.frames import (
    FIN,
    LENGTH_16,
    LENGTH_64,
    LENGTH_BITS,
    MASK_BIT,
    MASK_BYTES,
    MAX_CONTROL_PAYLOAD_BYTES,
    MAX_HEADER_BYTES,
    MAX_LENGTH_16,
    OPCODE_BITS,
    RSV_BITS,
    Opcode,
    apply_mask,
    encode_header,
    rotate,
)

Buffer = bytes | bytearray | memoryview

# x/net/websocket's DefaultMaxPayloadBytes, the limit kubelet/CRI servers apply.
MAX_MESSAGE_BYTES = 32 * 1024 * 1024
# A close reason shares its control frame with the 2-byte code.
MAX_CLOSE_REASON_BYTES = MAX_CONTROL_PAYLOAD_BYTES - 2
# Payloads up to this many bytes are joined to their header: one small copy is cheaper than
# another buffer to gather.
SMALL_FRAME_BYTES = 512
# RFC 6455 5.2: the most significant bit of a 64-bit length must be 0.
MAX_FRAME_LENGTH = (1 << 63) - 1

# RFC 6455 7.4: codes a peer may send. 1004, 1005, 1006, 1014 and 1015 are reserved or
# local-only; 3000-4999 are for libraries and applications.
_PEER_CLOSE_CODES = frozenset({1000, 1001, 1002, 1003, *range(1007, 1014)})
_MIN_APP_CLOSE_CODE = 3000
_MAX_APP_CLOSE_CODE = 4999
# Status codes that must never be sent (RFC 6455 7.4.1); a local close() with one sends 1000.
_LOCAL_ONLY_CLOSE_CODES = frozenset({1005, 1006, 1015})
NO_STATUS_CODE = 1005  # a close frame without a payload

# Plain ints for the per-frame code: cheaper than IntEnum attribute lookups.
_CLOSE = int(Opcode.CLOSE)
_FIN_BINARY = FIN | Opcode.BINARY
_U16 = struct.Struct("!H")
_U64 = struct.Struct("!Q")
_BYTE = [bytes((i,)) for i in range(256)]


class Role(Enum):
    CLIENT = "client"
    SERVER = "server"


class EndpointState(Enum):
    OPEN = "open"
    CLOSING = "closing"  # we sent a close frame and wait for the peer's
    CLOSED = "closed"  # close frames crossed, or the stream ended
    FAILED = "failed"  # the peer broke the protocol


def _short_reason(text: str) -> str:
    return text.encode("utf-8")[:MAX_CLOSE_REASON_BYTES].decode("utf-8", "ignore")


def _peer_may_send(code: int) -> bool:
    return code in _PEER_CLOSE_CODES or _MIN_APP_CLOSE_CODE <= code <= _MAX_APP_CLOSE_CODE


def frozen(data: Buffer) -> memoryview | bytes:
    """`data` as a byte view safe to queue: a mutable buffer is copied, since its owner may
    reuse it before the transport has written it (uvloop keeps references to unsent data)."""
    if isinstance(data, bytes):
        return data
    view = memoryview(data).cast("B")
    return view if view.readonly else bytes(view)


class WebSocketEndpoint:
    """Base for ChannelConnection and TunnelConnection. Subclasses handle message data.

    `max_message_bytes=None` turns reassembly bounds off (the tunnel streams pieces on).
    """

    def __init__(self, role: Role, *, max_message_bytes: int | None = MAX_MESSAGE_BYTES) -> None:
        self.role = role
        self.max_message_bytes = max_message_bytes
        self._state = EndpointState.OPEN
        self._out: list[bytes | memoryview] = []
        # Peers mask exactly the client-to-server frames (RFC 6455 5.3).
        self._masked_in = role is Role.SERVER
        # Frame being received: header bytes carried over, then payload bytes still to come.
        self._head = b""
        self._left = 0
        self._opcode = 0
        self._fin = False
        self._mask: bytes | None = None
        self._offset = 0  # payload bytes of this frame already consumed
        self._control = b""
        # Message being received.
        self._message: Opcode | None = None
        self._size = 0
        self._utf8: codecs.IncrementalDecoder | None = None
        self._parts: list[bytes] = []
        # Subclasses set _split_lead to get the first byte of each binary message apart, in
        # _lead (-1 until it arrived), and the rest without it.
        self._split_lead = False
        self._lead = -1

    @property
    def state(self) -> EndpointState:
        return self._state

    # --- input ----------------------------------------------------------------------------

    def receive_data(self, data: bytes | None) -> list[Event]:
        """Feed bytes from the peer; returns the events they complete.

        None means the byte stream ended (the same as receive_eof()).
        """
        if data is None:
            return self.receive_eof()
        if self._state is EndpointState.FAILED:
            raise LocalProtocolError("the connection already failed")
        if self._state is EndpointState.CLOSED:
            if data:
                raise WebSocketError("data after the close handshake")
            return []
        events: list[Event] = []
        if data:
            self._parse(data if type(data) is bytes else bytes(data), events)
        return events

    def receive_eof(self) -> list[Event]:
        """The byte stream ended. Without a prior close frame that is a 1006 closure."""
        if self._state in (EndpointState.CLOSED, EndpointState.FAILED):
            return []
        self._state = EndpointState.CLOSED
        self._drop_message()
        return [CloseReceived(code=CloseCode.ABNORMAL, reason="")]

    def _parse(self, data: bytes, out: list[Event]) -> None:
        end = len(data)
        pos = 0
        view: memoryview | None = None
        masked_in = self._masked_in
        limit = self.max_message_bytes
        while True:
            left = self._left
            if left:
                take = min(left, end - pos)
                if not take:
                    return
                self._left = left - take
                if self._opcode < _CLOSE:
                    self._data_piece(data, pos, take, out)
                    pos += take
                    continue
                self._control += data[pos : pos + take]
                pos += take
                if self._left:
                    return
                self._control_frame(out)
                if self._state is EndpointState.CLOSED:
                    return  # nothing after the peer's close frame counts
                continue
            if pos == end:
                return
            if (
                data[pos] == _FIN_BINARY
                and end - pos >= MAX_HEADER_BYTES
                and self._message is None
                and not self._head
            ):
                # Fast path: a whole one-frame binary message in hand (what kubectl and
                # podgate send). Anything unusual takes the general path below, which checks.
                second = data[pos + 1]
                if bool(second & MASK_BIT) is masked_in:
                    size = second & LENGTH_BITS
                    start = pos + 2
                    if size == LENGTH_16:
                        size = _U16.unpack_from(data, start)[0]
                        start += 2
                        usual = size >= LENGTH_16
                    elif size == LENGTH_64:
                        size = _U64.unpack_from(data, start)[0]
                        start += 8
                        usual = MAX_LENGTH_16 < size <= MAX_FRAME_LENGTH
                    else:
                        usual = True
                    stop = start + size + (MASK_BYTES if masked_in else 0)
                    if usual and stop <= end and (limit is None or size <= limit):
                        key = None
                        if masked_in:
                            key = data[start : start + MASK_BYTES]
                            start += MASK_BYTES
                        lead = -1
                        if self._split_lead and size:
                            lead = data[start] if key is None else data[start] ^ key[0]
                            start += 1
                            if key is not None:
                                key = key[1:] + key[:1]
                        if key is None:
                            piece = data[start:stop]
                        elif start == stop:
                            piece = b""
                        else:
                            if view is None:
                                view = memoryview(data)
                            piece = apply_mask(view[start:stop], key)
                        self._on_binary_message(lead, piece, out)
                        pos = stop
                        continue
            head = self._head
            if head:
                buf = head + data[pos : pos + MAX_HEADER_BYTES]
                used = self._header(buf, 0, len(buf))
                if not used:
                    self._head = buf
                    return
                pos += used - len(head)
                self._head = b""
            else:
                used = self._header(data, pos, end)
                if not used:
                    self._head = data[pos:]
                    return
                pos += used
            if not self._left:  # an empty frame is complete at once
                if self._opcode < _CLOSE:
                    self._data_piece(data, pos, 0, out)
                else:
                    self._control_frame(out)
                    if self._state is EndpointState.CLOSED:
                        return

    def _header(self, buf: bytes, pos: int, end: int) -> int:
        """Take the frame header at buf[pos:end]: its size, or 0 while it is incomplete."""
        if end - pos < 2:
            return 0
        first = buf[pos]
        second = buf[pos + 1]
        opcode = first & OPCODE_BITS
        length = second & LENGTH_BITS
        if first & RSV_BITS:
            self._framing_error("reserved bit set")
        if opcode >= Opcode.CLOSE:
            if opcode > Opcode.PONG:
                self._framing_error(f"invalid opcode {opcode:#x}")
            if not first & FIN:
                self._framing_error("fragmented control frame")
            if length > MAX_CONTROL_PAYLOAD_BYTES:
                self._framing_error("control frame payload over 125 bytes")
        elif opcode > Opcode.BINARY:
            self._framing_error(f"invalid opcode {opcode:#x}")
        masked = bool(second & MASK_BIT)
        if masked is not self._masked_in:
            self._framing_error(
                "unmasked frame from a client" if self._masked_in else "masked frame from a server"
            )
        size = 2
        if length == LENGTH_16:
            size = 4
        elif length == LENGTH_64:
            size = 10
        if masked:
            size += MASK_BYTES
        if end - pos < size:
            return 0
        if length == LENGTH_16:
            length = _U16.unpack_from(buf, pos + 2)[0]
            if length < LENGTH_16:
                self._framing_error("payload length not in its shortest form")
        elif length == LENGTH_64:
            length = _U64.unpack_from(buf, pos + 2)[0]
            if length <= MAX_LENGTH_16:
                self._framing_error("payload length not in its shortest form")
            if length > MAX_FRAME_LENGTH:
                self._framing_error("64-bit payload length with the top bit set")
        if opcode < Opcode.CLOSE:
            if opcode == Opcode.CONTINUATION:
                if self._message is None:
                    self._framing_error("continuation frame outside a message")
            elif self._message is not None:
                self._framing_error("new message before the previous one ended")
            else:
                self._start_message(Opcode(opcode))
        self._opcode = opcode
        self._fin = bool(first & FIN)
        self._left = length
        self._mask = buf[pos + size - MASK_BYTES : pos + size] if masked else None
        self._offset = 0
        return size

    def _start_message(self, opcode: Opcode) -> None:
        self._message = opcode
        if opcode is Opcode.TEXT:
            self._utf8 = codecs.getincrementaldecoder("utf-8")()

    def _data_piece(self, data: bytes, pos: int, take: int, out: list[Event]) -> None:
        """The next `take` payload bytes of a data frame, at data[pos:]."""
        offset = self._offset
        self._offset = offset + take
        last = self._fin and not self._left
        mask = self._mask
        limit = self.max_message_bytes
        if limit is not None:
            self._size += take
            if self._size > limit:
                self._fail(f"message larger than {limit} bytes", CloseCode.MESSAGE_TOO_BIG)
        if take and self._split_lead and self._lead < 0 and self._message is Opcode.BINARY:
            lead = data[pos]
            self._lead = lead if mask is None else lead ^ mask[offset % MASK_BYTES]
            pos += 1
            take -= 1
            offset += 1
        if not take:
            piece = b""
        elif mask is None:
            piece = data[pos : pos + take]  # the whole of `data` comes back uncopied
        elif pos == 0 and take == len(data):
            piece = apply_mask(data, rotate(mask, offset))
        else:
            piece = apply_mask(memoryview(data)[pos : pos + take], rotate(mask, offset))
        if self._utf8 is not None:
            try:
                self._utf8.decode(piece, last)
            except UnicodeDecodeError as exc:
                self._framing_error(str(exc), CloseCode.INVALID_PAYLOAD)
        self._on_data(piece, last, out)
        if last:
            self._drop_message()

    def _on_binary_message(self, lead: int, payload: bytes, out: list[Event]) -> None:
        """A whole binary message that came in one frame: `lead` is its first byte if split
        off (-1 if not, or if the message is empty), `payload` the rest, unmasked."""
        raise NotImplementedError

    def _on_data(self, piece: bytes, last: bool, out: list[Event]) -> None:
        """One piece of a data message (unmasked; without the lead byte if split off).
        `last` marks the end of the message; `_message` and `_lead` describe it until then."""
        raise NotImplementedError

    def _drop_message(self) -> None:
        self._message = None
        self._size = 0
        self._utf8 = None
        self._parts = []
        self._lead = -1

    def _control_frame(self, out: list[Event]) -> None:
        payload = self._control
        self._control = b""
        if self._mask is not None and payload:
            payload = apply_mask(payload, self._mask)
        if self._opcode == Opcode.PING:
            if self._state is EndpointState.OPEN:
                self._queue(FIN | Opcode.PONG, payload)
            out.append(PingReceived(payload=payload))
        elif self._opcode == Opcode.PONG:
            out.append(PongReceived(payload=payload))
        else:
            self._on_close(payload, out)

    def _on_close(self, payload: bytes, out: list[Event]) -> None:
        code, reason = NO_STATUS_CODE, ""
        if len(payload) == 1:
            self._framing_error("close frame with a 1-byte payload")
        if payload:
            code = _U16.unpack_from(payload)[0]
            if not _peer_may_send(code):
                self._framing_error(f"close frame with invalid code {code}")
            try:
                reason = payload[2:].decode("utf-8")
            except UnicodeDecodeError as exc:
                self._framing_error(f"close reason: {exc}", CloseCode.INVALID_PAYLOAD)
        if self._state is EndpointState.OPEN:
            # The reply echoes the peer's close (empty if it carried no code).
            self._queue_close(None if code == NO_STATUS_CODE else code, reason)
        self._state = EndpointState.CLOSED
        self._drop_message()
        out.append(CloseReceived(code=code, reason=reason))

    def _framing_error(self, message: str, code: int = CloseCode.PROTOCOL_ERROR) -> NoReturn:
        self._fail(f"websocket: {message}", code)

    def _fail(self, message: str, code: int) -> NoReturn:
        """Queue a close frame if we still may, mark the connection failed, raise."""
        if self._state is EndpointState.OPEN:
            self._queue_close(code, _short_reason(message))
        self._state = EndpointState.FAILED
        self._drop_message()
        raise WebSocketError(message, code)

    # --- output ---------------------------------------------------------------------------

    def _queue(self, first: int, payload: bytes | memoryview, lead: int = -1) -> None:
        """Queue one frame: `lead` (if >= 0) is a byte put before the immutable `payload`."""
        size = len(payload)
        total = size + 1 if lead >= 0 else size
        if self.role is Role.SERVER:
            head = encode_header(first, total)
            if lead >= 0:
                head += _BYTE[lead]
            body: bytes | memoryview = payload
        else:
            # RFC 6455 5.3: a fresh, unpredictable key for every frame.
            mask = os.urandom(MASK_BYTES)
            head = encode_header(first, total, mask)
            key = mask
            if lead >= 0:
                head += _BYTE[lead ^ mask[0]]
                key = rotate(mask, 1)
            body = apply_mask(payload, key) if size else b""
        if size > SMALL_FRAME_BYTES:
            self._out += (head, body)
        else:
            self._out.append(head + body if size else head)

    def _queue_buffers(self, first: int, buffers: list[bytes | memoryview]) -> None:
        """Queue one frame whose payload is the immutable `buffers` back to back."""
        total = sum(len(b) for b in buffers)
        if self.role is Role.SERVER:
            self._out.append(encode_header(first, total))
            self._out += buffers
            return
        mask = os.urandom(MASK_BYTES)
        self._out.append(encode_header(first, total, mask))
        offset = 0
        for buf in buffers:
            if buf:
                self._out.append(apply_mask(buf, rotate(mask, offset)))
                offset += len(buf)

    def _queue_close(self, code: int | None, reason: str) -> None:
        if code is None:
            payload = b""
        else:
            if code in _LOCAL_ONLY_CLOSE_CODES:
                code = CloseCode.NORMAL
            payload = _U16.pack(code) + _short_reason(reason).encode("utf-8")
        self._queue(FIN | Opcode.CLOSE, payload)

    def _check_open(self) -> None:
        if self._state is not EndpointState.OPEN:
            raise LocalProtocolError(f"cannot send in state {self._state.name}")

    def _send_message(self, message: bytes | str) -> None:
        """Queue one whole message: str as text, bytes as binary."""
        self._check_open()
        if isinstance(message, str):
            self._queue(FIN | Opcode.TEXT, message.encode("utf-8"))
        else:
            self._queue(FIN | Opcode.BINARY, message)

    def ping(self, payload: bytes = b"") -> None:
        """Queue a ping. A no-op once closing has begun, so keep-alive timers may race close."""
        if len(payload) > MAX_CONTROL_PAYLOAD_BYTES:
            raise LocalProtocolError(f"ping payload over {MAX_CONTROL_PAYLOAD_BYTES} bytes")
        if self._state is EndpointState.OPEN:
            self._queue(FIN | Opcode.PING, bytes(payload))

    def close(self, code: int = CloseCode.NORMAL, reason: str = "") -> None:
        """Start the closing handshake. A no-op once closing has begun or the peer is gone."""
        if self._state is not EndpointState.OPEN:
            return
        self._queue_close(code, _short_reason(reason))
        self._state = EndpointState.CLOSING

    def data_to_send(self) -> bytes:
        """Everything queued, as one bytes object."""
        out = b"".join(self._out)
        self._out = []
        return out

    def buffers_to_send(self) -> list[bytes | memoryview]:
        """Everything queued, as buffers for `writelines` (payloads are not copied)."""
        out = self._out
        self._out = []
        return out
