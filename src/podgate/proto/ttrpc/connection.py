"""A sans-IO ttrpc connection (containerd/ttrpc), for either end.

Bytes go in through `receive_data`, events come out; API calls queue frames that the driver
collects with `data_to_send`. Receiving may queue frames too: a server answers bad streams with
an error Response by itself.

Faults are sorted by blast radius, following the Go server:
- bytes that cannot be framed (a length with the reserved first byte set) are a connection
  error: `TtrpcConnectionError` is raised and the connection stays dead;
- everything else costs one stream. An oversized frame is skipped (even when it arrives in
  pieces) and answered RESOURCE_EXHAUSTED; an even or re-used stream id, Data on a finished
  stream and an envelope that does not parse are answered INVALID_ARGUMENT. A client turns an
  oversized or unparseable Response into that call's failure.
Frames of unknown type, and frames for streams we do not know, are ignored for forward
compatibility (Go does the same). Misuse of this API raises `LocalProtocolError`.

ttrpc has no handshake, ping, flow control or goodbye frame, so there is no connection state
beyond the stream table.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum, auto

from podgate.proto.errors import LocalProtocolError
from podgate.proto.ttrpc.errors import (
    Code,
    MalformedEnvelopeError,
    OversizedMessageError,
    StreamClosedError,
    TtrpcConnectionError,
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
    FRAMEABLE_LENGTH_LIMIT,
    HEADER_LENGTH,
    MAX_MESSAGE_LENGTH,
    MAX_STREAM_ID,
    BytesLike,
    FrameHeader,
    MessageType,
    decode_header,
    decode_request,
    decode_response,
    encode_frame,
    encode_request,
    encode_response,
)

__all__ = [
    "CLIENT_TRANSITIONS",
    "SERVER_TRANSITIONS",
    "Reaction",
    "Role",
    "StreamInput",
    "StreamState",
    "TtrpcConnection",
]

# The exact texts containerd/ttrpc's server answers with.
MSG_EVEN_STREAM_ID = "StreamID must be odd for client initiated streams"
MSG_STREAM_ID_REUSED = "StreamID cannot be re-used and must increment"
MSG_STREAM_INACTIVE = "StreamID is no longer active"
MSG_CLOSE_WITH_DATA = "data close message cannot include data"
MSG_DATA_AFTER_CLOSE = "data handling error: ttrpc: stream closed"


class Role(Enum):
    """CLIENT opens streams (odd ids from 1); SERVER answers them."""

    CLIENT = "client"
    SERVER = "server"


class StreamState(Enum):
    OPEN = auto()  # both sides may still send
    HALF_CLOSED_LOCAL = auto()  # client: everything sent, waiting for the server to finish
    HALF_CLOSED_REMOTE = auto()  # server: the client sends nothing more; we owe the end
    CLOSED = auto()  # finished; forgotten at once


class StreamInput(Enum):
    SEND_DATA = auto()  # a Data frame carrying a message
    SEND_CLOSE = auto()  # the remote-closed flag on a Data frame
    SEND_RESPONSE = auto()
    RECV_DATA = auto()
    RECV_CLOSE = auto()
    RECV_RESPONSE = auto()


class Reaction(Enum):
    ACCEPT = auto()  # act on it: emit the event, or send the frame
    IGNORE = auto()  # drop silently (a second close)
    ABORT = auto()  # server: answer INVALID_ARGUMENT and forget the stream


_S, _I, _R = StreamState, StreamInput, Reaction
_Table = dict[tuple[StreamState, StreamInput], tuple[StreamState, Reaction]]

# (state, input) -> (new state, reaction). A local input missing from a table is API misuse; a
# remote one the server does not list is answered with an error status on that stream.
CLIENT_TRANSITIONS: _Table = {
    (_S.OPEN, _I.SEND_DATA): (_S.OPEN, _R.ACCEPT),
    (_S.OPEN, _I.SEND_CLOSE): (_S.HALF_CLOSED_LOCAL, _R.ACCEPT),
    (_S.OPEN, _I.RECV_DATA): (_S.OPEN, _R.ACCEPT),
    # The server finishing ends the whole stream: ttrpc has no "server done, client still
    # sending" state (Go forgets the stream once the server closes).
    (_S.OPEN, _I.RECV_CLOSE): (_S.CLOSED, _R.ACCEPT),
    (_S.OPEN, _I.RECV_RESPONSE): (_S.CLOSED, _R.ACCEPT),
    (_S.HALF_CLOSED_LOCAL, _I.RECV_DATA): (_S.HALF_CLOSED_LOCAL, _R.ACCEPT),
    (_S.HALF_CLOSED_LOCAL, _I.RECV_CLOSE): (_S.CLOSED, _R.ACCEPT),
    (_S.HALF_CLOSED_LOCAL, _I.RECV_RESPONSE): (_S.CLOSED, _R.ACCEPT),
}
SERVER_TRANSITIONS: _Table = {
    (_S.OPEN, _I.RECV_DATA): (_S.OPEN, _R.ACCEPT),
    (_S.OPEN, _I.RECV_CLOSE): (_S.HALF_CLOSED_REMOTE, _R.ACCEPT),
    (_S.OPEN, _I.SEND_DATA): (_S.OPEN, _R.ACCEPT),
    (_S.OPEN, _I.SEND_CLOSE): (_S.CLOSED, _R.ACCEPT),
    (_S.OPEN, _I.SEND_RESPONSE): (_S.CLOSED, _R.ACCEPT),
    (_S.HALF_CLOSED_REMOTE, _I.RECV_DATA): (_S.CLOSED, _R.ABORT),
    (_S.HALF_CLOSED_REMOTE, _I.RECV_CLOSE): (_S.HALF_CLOSED_REMOTE, _R.IGNORE),
    (_S.HALF_CLOSED_REMOTE, _I.SEND_DATA): (_S.HALF_CLOSED_REMOTE, _R.ACCEPT),
    (_S.HALF_CLOSED_REMOTE, _I.SEND_CLOSE): (_S.CLOSED, _R.ACCEPT),
    (_S.HALF_CLOSED_REMOTE, _I.SEND_RESPONSE): (_S.CLOSED, _R.ACCEPT),
}


@dataclass(slots=True)
class _Discard:
    """An oversized frame being skipped: its header, and how many body bytes are still due."""

    header: FrameHeader
    remaining: int


class TtrpcConnection:
    """One ttrpc connection, as client or server."""

    def __init__(self, role: Role) -> None:
        self.role = role
        self._table = CLIENT_TRANSITIONS if role is Role.CLIENT else SERVER_TRANSITIONS
        self._streams: dict[int, StreamState] = {}
        self._next_stream_id = 1  # client: odd ids, increasing by 2
        self._last_stream_id = 0  # server: the highest Request id accepted so far
        self._buffer = bytearray()
        self._discard: _Discard | None = None
        self._outgoing: list[bytes] = []
        self._error: TtrpcConnectionError | None = None
        self._eof = False

    # -- receiving
    def receive_data(self, data: BytesLike) -> list[Event]:
        """Feed bytes from the peer; returns the events they complete."""
        if self._error is not None:
            raise self._error
        if self._eof:
            raise LocalProtocolError("receive_data after receive_eof")
        self._buffer += data
        events: list[Event] = []
        try:
            self._parse(events)
        except TtrpcConnectionError as exc:
            exc.events = events
            self._error = exc
            self._buffer.clear()
            raise
        return events

    def receive_eof(self) -> list[Event]:
        """The peer finished sending. Ending inside a frame is a connection error."""
        if self._error is not None:
            raise self._error
        if self._eof:
            return []
        self._eof = True
        if self._buffer or self._discard is not None:
            self._error = TtrpcConnectionError("connection closed in the middle of a frame")
            raise self._error
        return [ConnectionClosed()]

    def _parse(self, events: list[Event]) -> None:
        buf = self._buffer
        pos = 0
        try:
            while True:
                if self._discard is not None:
                    skip = min(len(buf) - pos, self._discard.remaining)
                    pos += skip
                    self._discard.remaining -= skip
                    if self._discard.remaining:
                        return
                    header = self._discard.header
                    self._discard = None
                    self._oversized(header, events)
                    continue
                if len(buf) - pos < HEADER_LENGTH:
                    return
                header = decode_header(buf, pos)
                if header.length >= FRAMEABLE_LENGTH_LIMIT:
                    raise TtrpcConnectionError(
                        f"frame length {header.length} has the reserved high byte set"
                    )
                if header.length > MAX_MESSAGE_LENGTH:
                    # As channel.go: read the body and throw it away, then fail only its stream.
                    pos += HEADER_LENGTH
                    self._discard = _Discard(header, header.length)
                    continue
                end = pos + HEADER_LENGTH + header.length
                if len(buf) < end:
                    return
                body = bytes(buf[pos + HEADER_LENGTH : end])
                pos = end
                if self.role is Role.SERVER:
                    self._server_frame(header, body, events)
                else:
                    self._client_frame(header, body, events)
        finally:
            del buf[:pos]

    def _oversized(self, header: FrameHeader, events: list[Event]) -> None:
        message = (
            f"message length {header.length} exceed maximum message size of {MAX_MESSAGE_LENGTH}"
        )
        if self.role is Role.SERVER:
            self._reject(header.stream_id, Code.RESOURCE_EXHAUSTED, message, events)
        elif self._streams.pop(header.stream_id, None) is not None:
            events.append(
                ResponseReceived(header.stream_id, int(Code.RESOURCE_EXHAUSTED), message, b"")
            )

    # -- server side of receiving
    def _server_frame(self, header: FrameHeader, body: bytes, events: list[Event]) -> None:
        stream_id = header.stream_id
        if stream_id % 2 == 0:
            self._reject(stream_id, Code.INVALID_ARGUMENT, MSG_EVEN_STREAM_ID, events)
        elif header.type == MessageType.REQUEST:
            self._server_request(header, body, events)
        elif header.type == MessageType.DATA:
            if stream_id not in self._streams:
                self._reject(stream_id, Code.INVALID_ARGUMENT, MSG_STREAM_INACTIVE, events)
            elif header.flags & FLAG_REMOTE_CLOSED and not header.flags & FLAG_NO_DATA and body:
                self._reject(stream_id, Code.INVALID_ARGUMENT, MSG_CLOSE_WITH_DATA, events)
            else:
                self._data_frame(header, body, events)
        # A Response or an unknown type from a client is ignored, as Go does.

    def _server_request(self, header: FrameHeader, body: bytes, events: list[Event]) -> None:
        stream_id = header.stream_id
        if stream_id <= self._last_stream_id:
            self._reject(stream_id, Code.INVALID_ARGUMENT, MSG_STREAM_ID_REUSED, events)
            return
        self._last_stream_id = stream_id
        try:
            request = decode_request(body)
        except MalformedEnvelopeError as exc:
            message = f"unmarshal request error: {exc.message}"
            self._reject(stream_id, Code.INVALID_ARGUMENT, message, events)
            return
        mode = RequestMode.from_flags(header.flags)
        self._streams[stream_id] = (
            StreamState.OPEN
            if mode is RequestMode.CLIENT_STREAMING
            else StreamState.HALF_CLOSED_REMOTE
        )
        events.append(
            RequestReceived(
                stream_id,
                request.service,
                request.method,
                request.payload,
                request.timeout_nano,
                tuple((kv.key, kv.value) for kv in request.metadata),
                mode,
            )
        )

    def _reject(self, stream_id: int, code: int, message: str, events: list[Event]) -> None:
        """Server: answer a stream with an error status; a live stream is aborted with it."""
        self._outgoing.append(
            encode_frame(
                stream_id, MessageType.RESPONSE, 0, encode_response(code=code, message=message)
            )
        )
        if self._streams.pop(stream_id, None) is not None:
            events.append(StreamAborted(stream_id, int(code), message))

    # -- client side of receiving
    def _client_frame(self, header: FrameHeader, body: bytes, events: list[Event]) -> None:
        stream_id = header.stream_id
        if stream_id not in self._streams:
            return  # a stream we abandoned or never opened (Go logs and drops it)
        if header.type == MessageType.RESPONSE:
            self._streams.pop(stream_id)
            try:
                response = decode_response(body)
            except MalformedEnvelopeError as exc:
                # gRPC's answer to a reply it cannot parse; the connection itself is fine.
                message = f"unmarshal response error: {exc.message}"
                events.append(ResponseReceived(stream_id, int(Code.INTERNAL), message, b""))
                return
            events.append(
                ResponseReceived(stream_id, response.code, response.message, response.payload)
            )
        elif header.type == MessageType.DATA:
            self._data_frame(header, body, events)
        # A Request or an unknown type from a server is ignored.

    # -- Data frames, both roles
    def _data_frame(self, header: FrameHeader, body: bytes, events: list[Event]) -> None:
        stream_id = header.stream_id
        has_message = not header.flags & FLAG_NO_DATA
        closing = bool(header.flags & FLAG_REMOTE_CLOSED)
        state = self._streams[stream_id]
        accepted = False
        for step, wanted in ((_I.RECV_DATA, has_message), (_I.RECV_CLOSE, closing)):
            if not wanted:
                continue
            state, reaction = self._table[(state, step)]
            if reaction is Reaction.ABORT:
                self._reject(stream_id, Code.INVALID_ARGUMENT, MSG_DATA_AFTER_CLOSE, events)
                return
            accepted = accepted or reaction is Reaction.ACCEPT
        self._set_state(stream_id, state)
        if accepted:
            events.append(DataReceived(stream_id, body if has_message else None, closing))

    # -- sending
    def send_request(
        self,
        service: str,
        method: str,
        payload: BytesLike = b"",
        *,
        timeout_nano: int = 0,
        metadata: Iterable[tuple[str, str]] = (),
        mode: RequestMode = RequestMode.UNARY,
    ) -> int:
        """Client: open a stream with a Request; returns its id. Metadata keys are lower-cased,
        as the Go client does."""
        self._require(Role.CLIENT, "send_request")
        stream_id = self._next_stream_id
        if stream_id > MAX_STREAM_ID:
            raise LocalProtocolError("stream ids exhausted: open a new connection")
        envelope = encode_request(
            service,
            method,
            payload,
            timeout_nano=timeout_nano,
            metadata=[(key.lower(), value) for key, value in metadata],
        )
        frame = encode_frame(stream_id, MessageType.REQUEST, mode.value, envelope)
        self._next_stream_id += 2
        self._streams[stream_id] = (
            StreamState.OPEN
            if mode is RequestMode.CLIENT_STREAMING
            else StreamState.HALF_CLOSED_LOCAL
        )
        self._outgoing.append(frame)
        return stream_id

    def send_response(
        self, stream_id: int, payload: BytesLike = b"", *, code: int = Code.OK, message: str = ""
    ) -> None:
        """Server: finish a stream with a Response. An oversized reply raises
        OversizedMessageError and leaves the stream open, so an error status can follow."""
        self._require(Role.SERVER, "send_response")
        new_state = self._transition(stream_id, _I.SEND_RESPONSE)
        frame = encode_frame(
            stream_id,
            MessageType.RESPONSE,
            0,
            encode_response(payload, code=code, message=message),
        )
        self._outgoing.append(frame)
        self._set_state(stream_id, new_state)

    def send_data(self, stream_id: int, payload: BytesLike | None, *, end: bool = False) -> None:
        """Send one streamed message (None: no message, only the flags) and maybe finish our side.

        A client sends a final message and its close as two frames, because the Go server
        rejects a close that carries data; a server may combine them, as Go's does.
        """
        state = self._streams.get(stream_id)
        if state is None:
            raise StreamClosedError(f"stream {stream_id} is not open", stream_id)
        if payload is None and not end:
            raise LocalProtocolError("a Data frame without a message must close the stream")
        if payload is not None and len(payload) > MAX_MESSAGE_LENGTH:
            raise OversizedMessageError(len(payload), MAX_MESSAGE_LENGTH)
        if payload is not None:
            state = self._step(stream_id, state, _I.SEND_DATA)
        if end:
            state = self._step(stream_id, state, _I.SEND_CLOSE)
        frames: list[tuple[int, BytesLike]]
        if payload is None:
            frames = [(FLAG_REMOTE_CLOSED | FLAG_NO_DATA, b"")]
        elif end and self.role is Role.CLIENT:
            frames = [(0, payload), (FLAG_REMOTE_CLOSED | FLAG_NO_DATA, b"")]
        else:
            frames = [(FLAG_REMOTE_CLOSED if end else 0, payload)]
        for flags, data in frames:
            self._outgoing.append(encode_frame(stream_id, MessageType.DATA, flags, data))
        self._set_state(stream_id, state)

    def abandon_stream(self, stream_id: int) -> None:
        """Forget a stream without telling the peer (ttrpc has no cancel frame): a client whose
        call timed out drops the late reply instead of keeping state for it."""
        self._streams.pop(stream_id, None)

    def data_to_send(self) -> bytes:
        """Everything queued for the peer since the last call."""
        data = b"".join(self._outgoing)
        self._outgoing.clear()
        return data

    # -- introspection
    @property
    def open_streams(self) -> frozenset[int]:
        return frozenset(self._streams)

    def stream_state(self, stream_id: int) -> StreamState:
        return self._streams.get(stream_id, StreamState.CLOSED)

    @property
    def next_stream_id(self) -> int:
        return self._next_stream_id

    @property
    def closed(self) -> bool:
        """EOF was received or the connection broke."""
        return self._eof or self._error is not None

    # -- helpers
    def _require(self, role: Role, what: str) -> None:
        if self.role is not role:
            raise LocalProtocolError(f"{what} is for the {role.value} side")

    def _transition(self, stream_id: int, step: StreamInput) -> StreamState:
        state = self._streams.get(stream_id)
        if state is None:
            raise StreamClosedError(f"stream {stream_id} is not open", stream_id)
        return self._step(stream_id, state, step)

    def _step(self, stream_id: int, state: StreamState, step: StreamInput) -> StreamState:
        try:
            new_state, _ = self._table[(state, step)]
        except KeyError:
            raise LocalProtocolError(
                f"{step.name} not allowed on {self.role.value} stream {stream_id} in {state.name}"
            ) from None
        return new_state

    def _set_state(self, stream_id: int, state: StreamState) -> None:
        if state is StreamState.CLOSED:
            self._streams.pop(stream_id, None)
        else:
            self._streams[stream_id] = state
