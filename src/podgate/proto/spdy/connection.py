"""A sans-IO SPDY/3 connection that behaves like moby/spdystream, the library behind every
Kubernetes SPDY endpoint (exec, attach, port-forward).

Bytes go in through `receive_data`, events come out; API calls queue frames that the driver
collects with `data_to_send` / `buffers_to_send`. Receiving may queue frames too (PING echoes,
RST_STREAM answers to bad streams).

Faults are sorted by blast radius. A broken frame or header block is a connection error: GOAWAY
(PROTOCOL_ERROR) is queued, `SpdyConnectionError` raised, and the connection stays dead. A bad
stream only costs that stream a RST_STREAM. Misuse of this API raises `LocalProtocolError`.

Flow control is off by default: Go peers never send WINDOW_UPDATE, so a sender that honoured
the nominal 64 KiB window would deadlock against every Kubernetes peer (k8s-streaming.md §1.8).
Off, the connection sends and accepts any amount and never writes WINDOW_UPDATE.

`flow_control_window=N` turns on SPDY/3.1 per-stream flow control, for peers known to do it too
(podgate's port-forward extension; see podgate.proto.datagram). Both ends start every stream
with N bytes of window each way; nothing is announced (no SETTINGS) and there is no
connection-level window. `send_data` refuses more than `send_window(stream_id)`; a WINDOW_UPDATE
from the peer grows it (`WindowUpdated`). The receiver hands window back with `window_update`
as its application consumes data. A peer that sends past the window, or grows ours past 2^31-1,
costs only that stream: RST_STREAM(FLOW_CONTROL_ERROR) and `StreamAborted`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum, auto

from podgate.proto.errors import LocalProtocolError
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
    FRAME_HEADER_LENGTH,
    MAX_CONTROL_FRAME_LENGTH,
    MAX_FRAME_LENGTH,
    MAX_STREAM_ID,
    BytesLike,
    ControlFrameHeader,
    ControlType,
    DataFrameHeader,
    GoAwayFrame,
    GoAwayStatus,
    HeadersFrame,
    PingFrame,
    RstStatus,
    RstStreamFrame,
    SettingsFrame,
    SynReplyFrame,
    SynStreamFrame,
    WindowUpdateFrame,
    decode_frame_header,
    encode_data_header,
    encode_goaway,
    encode_ping,
    encode_rst_stream,
    encode_syn_reply,
    encode_syn_stream,
    encode_window_update,
    parse_control_frame,
)
from podgate.proto.spdy.headers import (
    SYN_REPLY_FORBIDDEN_HEADERS,
    SYN_STREAM_FORBIDDEN_HEADERS,
    HeaderCompressor,
    HeaderDecompressor,
)

__all__ = [
    "DEFAULT_MAX_DATA_FRAME",
    "LOCAL_INPUTS",
    "MAX_CONCURRENT_STREAMS",
    "MAX_WINDOW_BYTES",
    "STREAM_WINDOW_BYTES",
    "TRANSITIONS",
    "DataInProgress",
    "Reaction",
    "Role",
    "SpdyConnection",
    "StreamInput",
    "StreamState",
]

# bytes of payload per DATA frame we send; Go peers send at most this (the io.Copy buffer).
DEFAULT_MAX_DATA_FRAME = 32 * 1024
# peer-opened streams alive at once; each one costs the driver a queue, so cap them.
MAX_CONCURRENT_STREAMS = 1000
# bytes of per-stream window each way when both ends are podgate (flow control on): the most
# a stalled stream holds in the receiver's memory. On loopback 1-2 MiB cost a single stream
# 5-20 % of its throughput (`make bench`, podgate-spdy/-tunnel); 8 MiB gained nothing more.
STREAM_WINDOW_BYTES = 4 * 1024 * 1024
# bytes; SPDY/3.1 caps every window at 2^31 - 1 (growing past it is FLOW_CONTROL_ERROR).
MAX_WINDOW_BYTES = 0x7FFFFFFF
_KNOWN_CONTROL_TYPES = frozenset(int(kind) for kind in ControlType)
# spdystream's ping counter wraps once it passes this value (client 0x7fffffff -> 1).
_PING_ID_WRAP = 0x7FFFFFFE


@dataclass(frozen=True, slots=True)
class DataInProgress:
    """Where the input stands inside a DATA frame: its stream, the payload bytes still to
    come, and whether they will be delivered (see SpdyConnection.data_in_progress)."""

    stream_id: int
    remaining: int
    deliver: bool


class Role(Enum):
    """CLIENT dialled the HTTP upgrade: odd stream and ping ids. SERVER: even ids."""

    CLIENT = "client"
    SERVER = "server"


class StreamState(Enum):
    """Where a stream is, from our side. The SYN_REPLY handshake is part of the state because
    spdystream drops DATA on a stream it has not seen replied, in both directions."""

    IDLE = auto()  # never opened (or an id not yet reached)
    AWAITING_REPLY = auto()  # we sent SYN_STREAM; no SYN_REPLY yet
    AWAITING_REPLY_HALF_CLOSED_LOCAL = auto()  # ... and we already sent FIN
    REPLY_PENDING = auto()  # the peer sent SYN_STREAM; we have not replied
    REPLY_PENDING_HALF_CLOSED_REMOTE = auto()  # ... and the peer already sent FIN
    OPEN = auto()
    HALF_CLOSED_LOCAL = auto()  # we sent FIN (or the peer opened it unidirectional)
    HALF_CLOSED_REMOTE = auto()  # the peer sent FIN
    CLOSED = auto()  # both FINs, or RST_STREAM either way; forgotten afterwards


class StreamInput(Enum):
    SEND_SYN_STREAM = auto()
    SEND_SYN_REPLY = auto()
    SEND_DATA = auto()
    SEND_FIN = auto()
    SEND_RST = auto()
    RECV_SYN_STREAM = auto()
    RECV_SYN_STREAM_UNIDIRECTIONAL = auto()
    RECV_SYN_REPLY = auto()
    RECV_DATA = auto()
    RECV_FIN = auto()
    RECV_RST = auto()


# States in which the peer may still send DATA we deliver: window handed back here is useful.
_PEER_SENDING = frozenset(
    {
        StreamState.AWAITING_REPLY,
        StreamState.AWAITING_REPLY_HALF_CLOSED_LOCAL,
        StreamState.REPLY_PENDING,
        StreamState.OPEN,
        StreamState.HALF_CLOSED_LOCAL,
    }
)


class Reaction(Enum):
    ACCEPT = auto()  # act on it: emit the event, or send the frame
    IGNORE = auto()  # drop silently, as spdystream does
    RESET = auto()  # answer RST_STREAM(STREAM_ALREADY_CLOSED): data after the peer's FIN


LOCAL_INPUTS = frozenset(
    {
        StreamInput.SEND_SYN_STREAM,
        StreamInput.SEND_SYN_REPLY,
        StreamInput.SEND_DATA,
        StreamInput.SEND_FIN,
        StreamInput.SEND_RST,
    }
)

_S = StreamState
_I = StreamInput
_A, _IG, _R = Reaction.ACCEPT, Reaction.IGNORE, Reaction.RESET

# (state, input) -> (new state, reaction). A local input missing from the table is API misuse.
# Remote inputs other than SYN_STREAM are listed for every state, so the peer can never make
# us raise for a stream-level matter; a SYN_STREAM only ever meets IDLE because ids increase.
TRANSITIONS: dict[tuple[StreamState, StreamInput], tuple[StreamState, Reaction]] = {
    # never opened, or already forgotten
    (_S.IDLE, _I.SEND_SYN_STREAM): (_S.AWAITING_REPLY, _A),
    (_S.IDLE, _I.RECV_SYN_STREAM): (_S.REPLY_PENDING, _A),
    (_S.IDLE, _I.RECV_SYN_STREAM_UNIDIRECTIONAL): (_S.HALF_CLOSED_LOCAL, _A),
    (_S.IDLE, _I.RECV_SYN_REPLY): (_S.IDLE, _IG),
    (_S.IDLE, _I.RECV_DATA): (_S.IDLE, _IG),
    (_S.IDLE, _I.RECV_FIN): (_S.IDLE, _IG),
    (_S.IDLE, _I.RECV_RST): (_S.IDLE, _IG),
    # we opened it; the peer's DATA before its SYN_REPLY is dropped (spdystream)
    (_S.AWAITING_REPLY, _I.SEND_DATA): (_S.AWAITING_REPLY, _A),
    (_S.AWAITING_REPLY, _I.SEND_FIN): (_S.AWAITING_REPLY_HALF_CLOSED_LOCAL, _A),
    (_S.AWAITING_REPLY, _I.SEND_RST): (_S.CLOSED, _A),
    (_S.AWAITING_REPLY, _I.RECV_SYN_REPLY): (_S.OPEN, _A),
    (_S.AWAITING_REPLY, _I.RECV_DATA): (_S.AWAITING_REPLY, _IG),
    (_S.AWAITING_REPLY, _I.RECV_FIN): (_S.AWAITING_REPLY, _IG),
    (_S.AWAITING_REPLY, _I.RECV_RST): (_S.CLOSED, _A),
    (_S.AWAITING_REPLY_HALF_CLOSED_LOCAL, _I.SEND_RST): (_S.CLOSED, _A),
    (_S.AWAITING_REPLY_HALF_CLOSED_LOCAL, _I.RECV_SYN_REPLY): (_S.HALF_CLOSED_LOCAL, _A),
    (_S.AWAITING_REPLY_HALF_CLOSED_LOCAL, _I.RECV_DATA): (
        _S.AWAITING_REPLY_HALF_CLOSED_LOCAL,
        _IG,
    ),
    (_S.AWAITING_REPLY_HALF_CLOSED_LOCAL, _I.RECV_FIN): (
        _S.AWAITING_REPLY_HALF_CLOSED_LOCAL,
        _IG,
    ),
    (_S.AWAITING_REPLY_HALF_CLOSED_LOCAL, _I.RECV_RST): (_S.CLOSED, _A),
    # the peer opened it; we must reply before sending DATA (a Go client drops it otherwise)
    (_S.REPLY_PENDING, _I.SEND_SYN_REPLY): (_S.OPEN, _A),
    (_S.REPLY_PENDING, _I.SEND_RST): (_S.CLOSED, _A),
    (_S.REPLY_PENDING, _I.RECV_SYN_REPLY): (_S.REPLY_PENDING, _IG),
    (_S.REPLY_PENDING, _I.RECV_DATA): (_S.REPLY_PENDING, _A),
    (_S.REPLY_PENDING, _I.RECV_FIN): (_S.REPLY_PENDING_HALF_CLOSED_REMOTE, _A),
    (_S.REPLY_PENDING, _I.RECV_RST): (_S.CLOSED, _A),
    (_S.REPLY_PENDING_HALF_CLOSED_REMOTE, _I.SEND_SYN_REPLY): (_S.HALF_CLOSED_REMOTE, _A),
    (_S.REPLY_PENDING_HALF_CLOSED_REMOTE, _I.SEND_RST): (_S.CLOSED, _A),
    (_S.REPLY_PENDING_HALF_CLOSED_REMOTE, _I.RECV_SYN_REPLY): (
        _S.REPLY_PENDING_HALF_CLOSED_REMOTE,
        _IG,
    ),
    (_S.REPLY_PENDING_HALF_CLOSED_REMOTE, _I.RECV_DATA): (_S.CLOSED, _R),
    (_S.REPLY_PENDING_HALF_CLOSED_REMOTE, _I.RECV_FIN): (_S.CLOSED, _R),
    (_S.REPLY_PENDING_HALF_CLOSED_REMOTE, _I.RECV_RST): (_S.CLOSED, _A),
    # both halves open
    (_S.OPEN, _I.SEND_DATA): (_S.OPEN, _A),
    (_S.OPEN, _I.SEND_FIN): (_S.HALF_CLOSED_LOCAL, _A),
    (_S.OPEN, _I.SEND_RST): (_S.CLOSED, _A),
    (_S.OPEN, _I.RECV_SYN_REPLY): (_S.OPEN, _IG),
    (_S.OPEN, _I.RECV_DATA): (_S.OPEN, _A),
    (_S.OPEN, _I.RECV_FIN): (_S.HALF_CLOSED_REMOTE, _A),
    (_S.OPEN, _I.RECV_RST): (_S.CLOSED, _A),
    # we are done sending
    (_S.HALF_CLOSED_LOCAL, _I.SEND_RST): (_S.CLOSED, _A),
    (_S.HALF_CLOSED_LOCAL, _I.RECV_SYN_REPLY): (_S.HALF_CLOSED_LOCAL, _IG),
    (_S.HALF_CLOSED_LOCAL, _I.RECV_DATA): (_S.HALF_CLOSED_LOCAL, _A),
    (_S.HALF_CLOSED_LOCAL, _I.RECV_FIN): (_S.CLOSED, _A),
    (_S.HALF_CLOSED_LOCAL, _I.RECV_RST): (_S.CLOSED, _A),
    # the peer is done sending
    (_S.HALF_CLOSED_REMOTE, _I.SEND_DATA): (_S.HALF_CLOSED_REMOTE, _A),
    (_S.HALF_CLOSED_REMOTE, _I.SEND_FIN): (_S.CLOSED, _A),
    (_S.HALF_CLOSED_REMOTE, _I.SEND_RST): (_S.CLOSED, _A),
    (_S.HALF_CLOSED_REMOTE, _I.RECV_SYN_REPLY): (_S.HALF_CLOSED_REMOTE, _IG),
    (_S.HALF_CLOSED_REMOTE, _I.RECV_DATA): (_S.CLOSED, _R),
    (_S.HALF_CLOSED_REMOTE, _I.RECV_FIN): (_S.CLOSED, _R),
    (_S.HALF_CLOSED_REMOTE, _I.RECV_RST): (_S.CLOSED, _A),
    # gone: late frames from the peer are dropped (spdystream no longer knows the stream)
    (_S.CLOSED, _I.RECV_SYN_REPLY): (_S.CLOSED, _IG),
    (_S.CLOSED, _I.RECV_DATA): (_S.CLOSED, _IG),
    (_S.CLOSED, _I.RECV_FIN): (_S.CLOSED, _IG),
    (_S.CLOSED, _I.RECV_RST): (_S.CLOSED, _IG),
}


class SpdyConnection:
    """One SPDY/3 connection, either end. See the module docstring for the error model."""

    def __init__(
        self,
        role: Role,
        *,
        max_concurrent_streams: int = MAX_CONCURRENT_STREAMS,
        max_data_frame: int = DEFAULT_MAX_DATA_FRAME,
        flow_control_window: int | None = None,
    ) -> None:
        if not 1 <= max_data_frame <= MAX_FRAME_LENGTH:
            raise ValueError(f"max_data_frame must be 1..{MAX_FRAME_LENGTH}")
        if max_concurrent_streams < 0:
            raise ValueError("max_concurrent_streams must not be negative")
        if flow_control_window is not None and not 1 <= flow_control_window <= MAX_WINDOW_BYTES:
            raise ValueError(f"flow_control_window must be 1..{MAX_WINDOW_BYTES}")
        self._role = role
        self._window = flow_control_window
        # Live streams only, and only with flow control on: bytes we may still send, and bytes
        # the peer may still send before we hand window back.
        self._send_windows: dict[int, int] = {}
        self._receive_windows: dict[int, int] = {}
        self._max_concurrent_streams = max_concurrent_streams
        self._max_data_frame = max_data_frame
        client = role is Role.CLIENT
        self._our_parity = 1 if client else 0
        self._next_stream_id = 1 if client else 2
        # spdystream's receivedStreamId: a new peer stream id must be >= this.
        self._next_peer_stream_id = 2 if client else 1
        self._last_peer_stream_id = 0
        self._next_ping_id = 1 if client else 2

        self._streams: dict[int, StreamState] = {}  # live streams only
        self._peer_streams_alive = 0
        self._compressor = HeaderCompressor()
        self._decompressor = HeaderDecompressor()
        self._outbox: list[bytes | memoryview] = []

        self._inbuf = bytearray()  # unparsed input: at most one partial frame header/control frame
        self._data_stream = 0  # the DATA frame whose payload is being received, if any
        self._data_remaining = 0
        self._data_fin = False
        self._data_deliver = False

        self._error: SpdyConnectionError | None = None
        self._eof = False
        self._goaway_sent = False
        self._goaway_received = False

    # --- properties ----------------------------------------------------------------------

    @property
    def role(self) -> Role:
        return self._role

    @property
    def closed(self) -> bool:
        """No more input will be processed: a connection error, GOAWAY received, or EOF."""
        return self._error is not None or self._goaway_received or self._eof

    @property
    def flow_control_window(self) -> int | None:
        """Every stream's initial window each way, or None when flow control is off."""
        return self._window

    def send_window(self, stream_id: int) -> int:
        """Bytes `send_data` may still send on the stream (flow control only).

        Raises StreamClosedError for a closed stream, LocalProtocolError for one never opened
        or when flow control is off."""
        return self._window_of(self._send_windows, stream_id)

    def receive_window(self, stream_id: int) -> int:
        """Bytes the peer may still send on the stream before we hand window back."""
        return self._window_of(self._receive_windows, stream_id)

    def _window_of(self, windows: dict[int, int], stream_id: int) -> int:
        if self._window is None:
            raise LocalProtocolError("flow control is off on this connection")
        window = windows.get(stream_id)
        if window is not None:
            return window
        state = self.stream_state(stream_id)
        if state is StreamState.CLOSED:
            raise StreamClosedError(f"stream {stream_id} is closed", stream_id)
        raise LocalProtocolError(f"stream {stream_id} was never opened")

    @property
    def last_peer_stream_id(self) -> int:
        """The highest stream id the peer opened that passed the id check (0 if none)."""
        return self._last_peer_stream_id

    def stream_state(self, stream_id: int) -> StreamState:
        state = self._streams.get(stream_id)
        if state is not None:
            return state
        # Ids below the counters were used (or skipped, which SPDY treats as closed).
        if stream_id % 2 == self._our_parity:
            limit = self._next_stream_id
        else:
            limit = self._next_peer_stream_id
        return StreamState.CLOSED if 0 < stream_id < limit else StreamState.IDLE

    # --- output --------------------------------------------------------------------------

    def data_to_send(self) -> bytes:
        out = b"".join(self._outbox)
        self._outbox.clear()
        return out

    def buffers_to_send(self) -> list[bytes | memoryview]:
        out = self._outbox
        self._outbox = []
        return out

    # --- input ---------------------------------------------------------------------------

    def receive_data(self, data: BytesLike) -> list[Event]:
        if self._error is not None:
            raise SpdyConnectionError(
                f"connection already failed: {self._error.message}", self._error.goaway_status
            )
        if self._eof:
            raise LocalProtocolError("receive_data after receive_eof")
        events: list[Event] = []
        if self._goaway_received or not data:
            return events
        buffered = bool(self._inbuf)
        if buffered:
            self._inbuf += data
            view = memoryview(self._inbuf)
        else:
            view = memoryview(data).cast("B")  # parse straight from the caller's buffer
        try:
            consumed = self._parse(view, events)
        except SpdyConnectionError as exc:
            self._fail(exc)
            exc.events = events
            raise
        if self._goaway_received:
            consumed = len(view)  # spdystream stops reading at GOAWAY
        if consumed < len(view):
            if consumed or not buffered:
                # A fresh buffer rather than resizing the old one, which a surviving slice of
                # `view` would forbid. What is left is at most one partial frame.
                self._inbuf = bytearray(view[consumed:])
        else:
            self._inbuf = bytearray()
        return events

    def receive_eof(self) -> list[Event]:
        if self._eof:
            return []
        self._eof = True
        return [ConnectionClosed()]

    def _fail(self, exc: SpdyConnectionError) -> None:
        self._error = exc
        self._inbuf = bytearray()
        if not self._goaway_sent:
            self._goaway_sent = True
            self._outbox.append(encode_goaway(self._last_peer_stream_id, exc.goaway_status))

    def _parse(self, view: memoryview, events: list[Event]) -> int:
        """Consume whole frames (and DATA payload as it comes); return the bytes consumed."""
        pos = 0
        end = len(view)
        while not self._goaway_received:
            if self._data_remaining:
                if pos == end:
                    break
                take = min(self._data_remaining, end - pos)
                self._data_remaining -= take
                self._data_piece(view[pos : pos + take], events)
                pos += take
                continue
            if end - pos < FRAME_HEADER_LENGTH:
                break
            header = decode_frame_header(view, pos)
            if isinstance(header, DataFrameHeader):
                pos += FRAME_HEADER_LENGTH
                self._data_header(header, events)
                continue
            if header.type not in _KNOWN_CONTROL_TYPES:
                # spdystream fails on the type before reading the body; so do we.
                raise SpdyConnectionError(
                    f"unknown control frame type {header.type}", GoAwayStatus.PROTOCOL_ERROR
                )
            if header.length > MAX_CONTROL_FRAME_LENGTH:
                raise SpdyConnectionError(
                    f"control frame of {header.length} bytes exceeds {MAX_CONTROL_FRAME_LENGTH}",
                    GoAwayStatus.PROTOCOL_ERROR,
                )
            frame_end = pos + FRAME_HEADER_LENGTH + header.length
            if frame_end > end:
                break
            self._control_frame(header, view[pos:frame_end], events)
            pos = frame_end
        return pos

    # --- DATA payload moved by the driver itself ----------------------------------------
    #
    # A driver that can move bytes between sockets without reading them (os.splice) lets
    # the payload of a DATA frame go around the core: it asks where the input stands, moves
    # the payload itself, and tells the core how much it moved. Frame headers and control
    # frames still come through receive_data, so stream state, flow-control windows and FIN
    # stay exact.

    def data_in_progress(self) -> DataInProgress | None:
        """The DATA frame whose payload the input is in the middle of, or None at a frame
        boundary (or after the connection ended). `deliver` is False when its payload would be
        dropped (a stream reset since, or one the peer may not send on)."""
        if not self._data_remaining or self.closed:
            return None
        deliver = self._data_deliver
        if deliver:
            state = self.stream_state(self._data_stream)
            deliver = TRANSITIONS[state, StreamInput.RECV_DATA][1] is Reaction.ACCEPT
        return DataInProgress(self._data_stream, self._data_remaining, deliver)

    def bytes_wanted(self) -> int:
        """How many input bytes would complete what the input stands in: the rest of a frame
        header (FRAME_HEADER_LENGTH at a boundary), of a control frame, or of the current DATA
        payload. A driver that splices payload reads no further than this, so that no payload
        of the next frame enters Python."""
        if self._data_remaining:
            return self._data_remaining
        buffered = len(self._inbuf)
        if buffered < FRAME_HEADER_LENGTH:
            return FRAME_HEADER_LENGTH - buffered
        # Only a control frame is ever left buffered past its header (DATA payload streams).
        header = decode_frame_header(memoryview(self._inbuf), 0)
        return FRAME_HEADER_LENGTH + header.length - buffered

    def skip_data(self, size: int) -> list[Event]:
        """Count `size` payload bytes of the current DATA frame as delivered by the driver
        (they never reach receive_data). Ends the frame when they were its last; its FIN then
        comes out as an empty DataReceived(fin=True), as from receive_data. The window was
        charged when the frame's header arrived: the driver hands it back (window_update) as
        its application consumes the bytes, as for bytes it received."""
        self._check_usable()
        progress = self.data_in_progress()
        if progress is None or not progress.deliver:
            raise LocalProtocolError("no deliverable DATA payload in progress")
        if not 1 <= size <= progress.remaining:
            raise LocalProtocolError(
                f"cannot skip {size} of the {progress.remaining} payload bytes left"
            )
        self._data_remaining -= size
        events: list[Event] = []
        if self._data_remaining == 0 and self._data_fin:
            self._receive(self._data_stream, StreamInput.RECV_FIN)
            events.append(DataReceived(self._data_stream, b"", fin=True))
        return events

    def data_header(self, stream_id: int, size: int) -> bytes:
        """The header of a DATA frame of `size` payload bytes whose payload the driver writes
        itself, right after this header (no FIN: end_stream sends that). Accounted as
        send_data accounts it (state, send window). Everything queued must be taken first
        (buffers_to_send), or the frame would overtake it."""
        self._check_usable()
        if self._outbox:
            raise LocalProtocolError("queued frames must be sent before a spliced DATA frame")
        if not 1 <= size <= MAX_FRAME_LENGTH:
            raise LocalProtocolError(f"DATA payload of {size} bytes outside 1..{MAX_FRAME_LENGTH}")
        self._plan(stream_id, StreamInput.SEND_DATA)
        if self._window is not None:
            window = self._send_windows[stream_id]
            if size > window:
                raise LocalProtocolError(
                    f"{size} bytes exceed the send window of stream {stream_id} ({window})"
                )
            self._send_windows[stream_id] = window - size
        return encode_data_header(stream_id, size)

    # --- DATA ----------------------------------------------------------------------------

    def _data_header(self, header: DataFrameHeader, events: list[Event]) -> None:
        # The 24-bit length cannot exceed MAX_FRAME_LENGTH, and the payload is streamed out,
        # so no size limit applies here.
        sid = header.stream_id
        if sid == 0:
            raise SpdyConnectionError("DATA frame with stream id 0", GoAwayStatus.PROTOCOL_ERROR)
        fin = bool(header.flags & FLAG_FIN)
        if header.length == 0:
            kind = StreamInput.RECV_FIN if fin else StreamInput.RECV_DATA
            if self._receive(sid, kind) is Reaction.ACCEPT and fin:
                events.append(DataReceived(sid, b"", fin=True))
            return
        reaction = self._receive(sid, StreamInput.RECV_DATA)
        self._data_stream = sid
        self._data_remaining = header.length
        self._data_fin = fin
        self._data_deliver = reaction is Reaction.ACCEPT
        if self._window is not None and self._data_deliver:
            window = self._receive_windows[sid]
            if header.length > window:
                # The frame's payload is skipped as it arrives; the rest of the connection
                # is fine.
                self._data_deliver = False
                self._abort(sid, RstStatus.FLOW_CONTROL_ERROR, events)
            else:
                self._receive_windows[sid] = window - header.length

    def _data_piece(self, piece: memoryview, events: list[Event]) -> None:
        sid = self._data_stream
        if not self._data_deliver:
            return
        # We may have reset the stream since the frame began.
        state = self.stream_state(sid)
        if TRANSITIONS[state, StreamInput.RECV_DATA][1] is not Reaction.ACCEPT:
            self._data_deliver = False
            return
        last = self._data_remaining == 0
        if last and self._data_fin:
            self._receive(sid, StreamInput.RECV_FIN)
            events.append(DataReceived(sid, bytes(piece), fin=True))
        else:
            events.append(DataReceived(sid, bytes(piece)))

    # --- control frames ------------------------------------------------------------------

    def _control_frame(
        self, header: ControlFrameHeader, raw: memoryview, events: list[Event]
    ) -> None:
        frame = parse_control_frame(header, raw[FRAME_HEADER_LENGTH:])
        if isinstance(frame, SynStreamFrame):
            self._syn_stream(frame, events)
        elif isinstance(frame, SynReplyFrame):
            headers = self._decompressor.decompress(
                frame.header_block, forbidden=SYN_REPLY_FORBIDDEN_HEADERS
            )
            sid = frame.stream_id
            if self._receive(sid, StreamInput.RECV_SYN_REPLY) is not Reaction.ACCEPT:
                return  # unknown stream or duplicate reply: ignored, as spdystream does
            fin = bool(frame.flags & FLAG_FIN)
            if fin:
                self._receive(sid, StreamInput.RECV_FIN)
            events.append(StreamReplied(sid, headers, fin))
        elif isinstance(frame, RstStreamFrame):
            if self._receive(frame.stream_id, StreamInput.RECV_RST) is Reaction.ACCEPT:
                events.append(StreamReset(frame.stream_id, frame.status))
        elif isinstance(frame, PingFrame):
            if frame.ping_id % 2 == self._our_parity:
                events.append(PingAcknowledged(frame.ping_id))
            else:
                self._outbox.append(bytes(raw))  # echo the identical frame
                events.append(PingReceived(frame.ping_id))
        elif isinstance(frame, SettingsFrame):
            events.append(SettingsReceived({entry.id: entry.value for entry in frame.entries}))
        elif isinstance(frame, WindowUpdateFrame):
            if self._window is None or frame.stream_id == 0:
                events.append(WindowUpdateReceived(frame.stream_id, frame.delta))
            else:
                self._window_update_received(frame, events)
        elif isinstance(frame, GoAwayFrame):
            self._goaway_received = True
            events.append(GoAwayReceived(frame.last_good_stream_id, frame.status))
        elif isinstance(frame, HeadersFrame):
            # Inflate only to keep the shared zlib context in step; k8s never reads these.
            # spdystream picks the forbidden list by stream id parity.
            forbidden = (
                SYN_STREAM_FORBIDDEN_HEADERS
                if frame.stream_id % 2 == 0
                else SYN_REPLY_FORBIDDEN_HEADERS
            )
            self._decompressor.decompress(frame.header_block, forbidden=forbidden)

    def _window_update_received(self, frame: WindowUpdateFrame, events: list[Event]) -> None:
        sid = frame.stream_id
        window = self._send_windows.get(sid)
        if window is None or frame.delta == 0:
            return  # a stream already gone (updates race with FIN and RST), or no change
        if window + frame.delta > MAX_WINDOW_BYTES:
            self._abort(sid, RstStatus.FLOW_CONTROL_ERROR, events)
            return
        self._send_windows[sid] = window + frame.delta
        events.append(WindowUpdated(sid, frame.delta))

    def _abort(self, stream_id: int, status: RstStatus, events: list[Event]) -> None:
        """Reset a live stream for the peer's stream-level fault and tell the driver."""
        self._send(stream_id, StreamInput.SEND_RST)
        self._outbox.append(encode_rst_stream(stream_id, status))
        events.append(StreamAborted(stream_id, status))

    def _syn_stream(self, frame: SynStreamFrame, events: list[Event]) -> None:
        headers = self._decompressor.decompress(
            frame.header_block, forbidden=SYN_STREAM_FORBIDDEN_HEADERS
        )
        if self._goaway_sent:
            return  # spdystream silently drops new streams once it has gone away
        sid = frame.stream_id
        # Ids must strictly increase; spdystream does not check parity, but an id of our own
        # parity could collide with a stream we opened, so it is refused the same way.
        if sid % 2 == self._our_parity or sid < self._next_peer_stream_id:
            self._outbox.append(encode_rst_stream(sid, RstStatus.PROTOCOL_ERROR))
            return
        self._next_peer_stream_id = sid + 2
        self._last_peer_stream_id = sid
        if self._peer_streams_alive >= self._max_concurrent_streams:
            self._outbox.append(encode_rst_stream(sid, RstStatus.REFUSED_STREAM))
            return
        unidirectional = bool(frame.flags & FLAG_UNIDIRECTIONAL)
        fin = bool(frame.flags & FLAG_FIN)
        kind = (
            StreamInput.RECV_SYN_STREAM_UNIDIRECTIONAL
            if unidirectional
            else StreamInput.RECV_SYN_STREAM
        )
        # Looked up from IDLE: the id counter above already moved past this stream.
        self._set_state(sid, TRANSITIONS[StreamState.IDLE, kind][0])
        if fin:
            self._receive(sid, StreamInput.RECV_FIN)
        events.append(StreamOpened(sid, headers, fin, unidirectional))

    def _receive(self, stream_id: int, kind: StreamInput) -> Reaction:
        """Apply a remote input; queue RST_STREAM if the table says so."""
        old = self.stream_state(stream_id)
        new, reaction = TRANSITIONS[old, kind]
        self._set_state(stream_id, new)
        if reaction is Reaction.RESET:
            self._outbox.append(encode_rst_stream(stream_id, RstStatus.STREAM_ALREADY_CLOSED))
        return reaction

    # --- sending -------------------------------------------------------------------------

    def open_stream(self, headers: Mapping[str, str], *, fin: bool = False) -> int:
        """Send SYN_STREAM with the next id of our parity (clients: 1, 3, 5...)."""
        self._check_usable()
        if self._goaway_sent or self._goaway_received:
            raise LocalProtocolError("cannot open a stream after GOAWAY")
        sid = self._next_stream_id
        if sid > MAX_STREAM_ID:
            raise LocalProtocolError("stream ids exhausted")
        state = self._plan(sid, StreamInput.SEND_SYN_STREAM)
        if fin:
            self._plan_from(sid, state, StreamInput.SEND_FIN)
        block = self._compressor.compress(headers, forbidden=SYN_STREAM_FORBIDDEN_HEADERS)
        self._next_stream_id += 2
        self._set_state(sid, state)
        if fin:
            self._send(sid, StreamInput.SEND_FIN)
        self._outbox.append(encode_syn_stream(sid, block, flags=FLAG_FIN if fin else 0))
        return sid

    def reply(
        self, stream_id: int, headers: Mapping[str, str] | None = None, *, fin: bool = False
    ) -> None:
        """Send SYN_REPLY (an empty header block by default, as Kubernetes servers do)."""
        self._check_usable()
        state = self._plan(stream_id, StreamInput.SEND_SYN_REPLY)
        if fin:
            self._plan_from(stream_id, state, StreamInput.SEND_FIN)
        # Compress only once the call is known to be valid: zlib state cannot be rolled back.
        block = self._compressor.compress(headers or {}, forbidden=SYN_REPLY_FORBIDDEN_HEADERS)
        self._set_state(stream_id, state)
        if fin:
            self._send(stream_id, StreamInput.SEND_FIN)
        self._outbox.append(encode_syn_reply(stream_id, block, flags=FLAG_FIN if fin else 0))

    def send_data(self, stream_id: int, data: BytesLike, *, fin: bool = False) -> None:
        """Queue `data` as DATA frames of at most `max_data_frame` bytes, FIN on the last one.

        With flow control on, `data` must fit in `send_window(stream_id)`: a bigger call is
        refused whole (LocalProtocolError, nothing queued) rather than cut short, so the caller
        always knows what was sent.

        Headers and payload slices are queued as separate buffers; payload is not copied unless
        it lives in a mutable buffer (which the caller might reuse before it is written).
        """
        self._check_usable()
        view = memoryview(data).cast("B")
        if not view.readonly:
            view = memoryview(bytes(view))
        size = len(view)
        state = self.stream_state(stream_id)
        if size or not fin:
            self._plan_from(stream_id, state, StreamInput.SEND_DATA)
        if fin:
            self._plan_from(stream_id, state, StreamInput.SEND_FIN)
        if self._window is not None and size:
            window = self._send_windows[stream_id]
            if size > window:
                raise LocalProtocolError(
                    f"{size} bytes exceed the send window of stream {stream_id} ({window})"
                )
            self._send_windows[stream_id] = window - size
        if size == 0:
            if fin:
                self._outbox.append(encode_data_header(stream_id, 0, flags=FLAG_FIN))
                self._send(stream_id, StreamInput.SEND_FIN)
            return
        step = self._max_data_frame
        for start in range(0, size, step):
            chunk = view[start : start + step]
            last = start + step >= size
            flags = FLAG_FIN if fin and last else 0
            self._outbox.append(encode_data_header(stream_id, len(chunk), flags=flags))
            self._outbox.append(chunk)
        if fin:
            self._send(stream_id, StreamInput.SEND_FIN)

    def end_stream(self, stream_id: int) -> None:
        """Half-close our side with an empty DATA+FIN, the way Kubernetes does."""
        self.send_data(stream_id, b"", fin=True)

    def window_update(self, stream_id: int, delta: int) -> None:
        """Hand `delta` bytes of receive window back to the peer (queue WINDOW_UPDATE), once
        the application has consumed that much of the stream's data. Flow control only.

        A no-op once the peer can send no more on the stream (its FIN, either RST, or never
        opened by it yet), so a driver may call it whenever data is consumed."""
        self._check_usable()
        if self._window is None:
            raise LocalProtocolError("flow control is off on this connection")
        if not 1 <= delta <= MAX_WINDOW_BYTES:
            raise LocalProtocolError(f"window delta {delta} outside 1..{MAX_WINDOW_BYTES}")
        window = self._receive_windows.get(stream_id)
        if window is None or self._streams[stream_id] not in _PEER_SENDING:
            return
        if window + delta > MAX_WINDOW_BYTES:
            raise LocalProtocolError(
                f"window of stream {stream_id} would exceed {MAX_WINDOW_BYTES} bytes"
            )
        self._receive_windows[stream_id] = window + delta
        self._outbox.append(encode_window_update(stream_id, delta))

    def reset_stream(self, stream_id: int, status: int = RstStatus.CANCEL) -> None:
        """Queue RST_STREAM and forget the stream. A no-op for a stream that is already closed
        or was never opened, and after a connection error (cleanup paths call this freely)."""
        try:
            RstStatus(status)
        except ValueError:
            raise LocalProtocolError(f"unknown RST_STREAM status {status}") from None
        if self._error is not None:
            return
        if self.stream_state(stream_id) in (StreamState.IDLE, StreamState.CLOSED):
            return
        self._send(stream_id, StreamInput.SEND_RST)
        self._outbox.append(encode_rst_stream(stream_id, status))

    def ping(self) -> int:
        """Queue a PING; the id is returned so the driver can time the echo."""
        self._check_usable()
        ping_id = self._next_ping_id
        if ping_id > _PING_ID_WRAP:
            self._next_ping_id = ping_id - _PING_ID_WRAP
        else:
            self._next_ping_id = ping_id + 2
        self._outbox.append(encode_ping(ping_id))
        return ping_id

    def goaway(self, status: int = GoAwayStatus.OK) -> None:
        """Queue GOAWAY naming the last peer stream we accepted. Only the first call sends."""
        try:
            GoAwayStatus(status)
        except ValueError:
            raise LocalProtocolError(f"unknown GOAWAY status {status}") from None
        if self._goaway_sent or self._error is not None:
            return
        self._goaway_sent = True
        self._outbox.append(encode_goaway(self._last_peer_stream_id, status))

    # --- state bookkeeping ---------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._error is not None:
            raise LocalProtocolError("the connection failed; nothing more can be sent")

    def _plan(self, stream_id: int, kind: StreamInput) -> StreamState:
        return self._plan_from(stream_id, self.stream_state(stream_id), kind)

    def _plan_from(self, stream_id: int, state: StreamState, kind: StreamInput) -> StreamState:
        """The state a local input leads to, or the error for a pair not in the table."""
        found = TRANSITIONS.get((state, kind))
        if found is not None:
            return found[0]
        message = f"{kind.name} not allowed on stream {stream_id} in state {state.name}"
        if state is StreamState.CLOSED:
            raise StreamClosedError(message, stream_id)
        raise LocalProtocolError(message)

    def _send(self, stream_id: int, kind: StreamInput) -> None:
        self._set_state(stream_id, self._plan(stream_id, kind))

    def _set_state(self, stream_id: int, new: StreamState) -> None:
        tracked = stream_id in self._streams
        peer_opened = stream_id % 2 != self._our_parity
        if new in (StreamState.IDLE, StreamState.CLOSED):
            if tracked:
                del self._streams[stream_id]
                if peer_opened:
                    self._peer_streams_alive -= 1
                if self._window is not None:
                    del self._send_windows[stream_id]
                    del self._receive_windows[stream_id]
            return
        if not tracked:
            if peer_opened:
                self._peer_streams_alive += 1
            if self._window is not None:
                self._send_windows[stream_id] = self._window
                self._receive_windows[stream_id] = self._window
        self._streams[stream_id] = new
