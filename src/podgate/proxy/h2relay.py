"""The proxy's fast data plane: each kubelet connection is relayed frame by frame to a
connection of its own to the runtime, unchanged, so a call costs the relay one read and one
write each way instead of a gRPC server and a gRPC client in Python.

Both HTTP/2 connections are one conversation: settings, flow control, HPACK state, pings and
GOAWAY are the two ends' own, and every byte passes through as it came, except the one gRPC
message of an intercepted call's response. To know which calls those are, request header
blocks are decoded (a copy, so the relay's HPACK table follows the client's); an intercepted
call's request message is read, and its response message is held, rewritten (a URL swapped)
and sent as DATA frames that count the same flow-controlled bytes as the runtime's (padding
makes up the difference), so both ends' windows stay in step. Responses are never invented
here: the runtime answers every call, the relay only changes a URL in its answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

import hpack

from podgate.aio.errors import StreamError
from podgate.aio.streams import SocketStream
from podgate.proto import h2frames as h2
from podgate.proto.errors import ProtocolError

log = logging.getLogger(__name__)

# One read from either side.
RECEIVE_BYTES: Final = 256 * 1024
# Header list size the relay decodes at most (the kubelet's CRI calls carry a few hundred).
MAX_HEADER_LIST_BYTES: Final = 1024 * 1024
# A request message read for an interception at most; a bigger one passes untouched.
MAX_INSPECTED_MESSAGE_BYTES: Final = 1024 * 1024
# Header blocks remembered with the :path they carry (see Relay._headers), at most.
KNOWN_BLOCKS: Final = 256
# The frames each direction looks into while nothing is owed and no answer is held: a
# request's header blocks (its :path) and, for a call being watched, its DATA and RST_STREAM;
# the runtime's SETTINGS (its header table size). Every other frame (pings, window updates,
# the answers' headers and data) passes with a look at its 9-byte header alone.
_REQUEST_KINDS: Final = h2.kinds(h2.HEADERS, h2.CONTINUATION, h2.DATA, h2.RST_STREAM)
_ANSWER_KINDS: Final = h2.kinds(h2.SETTINGS)

# Given the runtime's response message, the message to answer with (None: unchanged).
Rewrite = Callable[[bytes], bytes | None]
# Called with an intercepted method's request message: what to do with its response.
Intercept = Callable[[str, bytes], Awaitable[Rewrite | None] | None]


@dataclass(slots=True)
class _Call:
    method: str
    request: bytearray = field(default_factory=bytearray)
    decision: asyncio.Future[Rewrite | None] | None = None
    inspected: bool = False  # the request message was read (or given up on)
    response: bytearray = field(default_factory=bytearray)
    flow: int = 0  # flow-controlled bytes of the held response frames
    end_stream: bool = False
    done: bool = False  # the response message went out; the rest passes through


class Relay:
    """One kubelet connection and its runtime connection."""

    def __init__(
        self,
        client: SocketStream,
        upstream: SocketStream,
        watched: frozenset[str],
        intercept: Intercept,
        first: bytes = b"",
    ) -> None:
        self.client = client
        self.first = first  # what the client sent before the runtime's connection was made
        self.upstream = upstream
        self.watched = watched
        self.intercept = intercept
        self.calls: dict[int, _Call] = {}
        self.decoder = hpack.Decoder(max_header_list_size=MAX_HEADER_LIST_BYTES)
        self._block = bytearray()
        self._block_stream = 0
        # Header blocks of indexed fields alone → their :path, valid while the dynamic table
        # stays as it is: a client repeating a call sends the same few bytes each time.
        self._known: dict[bytes, str | None] = {}
        # Bytes the client was sent beyond what the runtime's flow control counted (a grown
        # response without room to pad): taken off the client's connection window updates.
        self._owed = 0
        self._pending: set[asyncio.Future[Rewrite | None]] = set()
        self._from_client_frames = h2.FrameSplitter(preface=True)
        self._from_upstream_frames = h2.FrameSplitter()
        # Bytes passed on of the frame each side's splitter holds, still arriving: the usual
        # step writes a read as it came and splits it afterwards, off the call's path.
        self._client_ahead = 0
        self._upstream_ahead = 0
        # A direction's task is between receiving bytes and being ready for more: bytes that
        # arrive meanwhile wait for it, so that nothing overtakes what it is passing on.
        self._client_busy = True  # until `first` went on
        self._upstream_busy = False
        self._ended = asyncio.Event()  # a step run from a stream's callback ended the relay

    async def run(self) -> None:
        # The usual step of either direction runs from the stream's callback as bytes arrive
        # (no task wake-up on the call's path); the tasks take over whenever one has to wait.
        self.client.set_consumer(self._client_arrived)
        self.upstream.set_consumer(self._upstream_arrived)
        try:
            async with asyncio.TaskGroup() as tasks:
                up = tasks.create_task(self._client_to_upstream(), name="relay client→runtime")
                down = tasks.create_task(self._upstream_to_client(), name="relay runtime→client")
                ended = tasks.create_task(self._ended.wait(), name="relay ended")
                await asyncio.wait({up, down, ended}, return_when=asyncio.FIRST_COMPLETED)
                # One side ended (or broke): the connection is over for both.
                for task in (up, down, ended):
                    task.cancel()
        finally:
            self.client.set_consumer(None)
            self.upstream.set_consumer(None)
        for future in self._pending:
            future.cancel()

    def _end(self, side: str, exc: Exception) -> None:
        log.debug("relay: %s side ended: %s", side, exc)
        self.client.set_consumer(None)
        self.upstream.set_consumer(None)
        self._ended.set()

    # -- client → runtime

    def _client_arrived(self, data: bytes) -> bool:
        if self._client_busy or self._owed or self.upstream.writing_paused:
            return False  # to the task, which waits for the runtime's side to drain
        try:
            self._client_bytes(data)
        except (StreamError, ProtocolError, hpack.HPACKError) as exc:
            self._end("client", exc)
        return True

    async def _client_to_upstream(self) -> None:
        data = self.first
        try:
            while data:
                self._client_bytes(data)
                await self.upstream.drain()
                self._client_busy = False
                data = await self.client.receive(RECEIVE_BYTES)
                self._client_busy = True
        except (StreamError, ProtocolError, hpack.HPACKError) as exc:
            log.debug("relay: client side ended: %s", exc)

    def _client_bytes(self, data: bytes) -> None:
        splitter = self._from_client_frames
        if not self._owed:
            # Nothing to change: the bytes go on as they came, whole frames or not, and are
            # read afterwards, off the call's path. Nothing else runs before this returns,
            # so the runtime's answer cannot overtake what the request tells the relay.
            self.upstream.write(data)
            frames = splitter.split(data, _REQUEST_KINDS)[1]
            self._client_ahead = splitter.pending
            for frame in frames:
                self._from_client(frame)
            return
        whole, frames = splitter.split(data)
        if not whole:
            return  # a frame still arriving
        # The first frame's start may have gone on as it came (before bytes were owed).
        ahead, self._client_ahead = self._client_ahead, 0
        out = bytearray(whole[: len(whole) - sum(len(f.raw) for f in frames)])  # preface
        for frame in frames:
            self._from_client(frame)
            if (
                frame.type == h2.WINDOW_UPDATE
                and frame.stream_id == 0
                and self._owed
                and not (ahead and not out)  # not one that went on in part as it came
            ):
                out += self._repaid(frame)
            else:
                out += frame.raw
        self.upstream.write(memoryview(out)[ahead:])

    def _repaid(self, frame: h2.Frame) -> bytes:
        """A connection WINDOW_UPDATE less what the client was sent beyond the runtime's
        flow control (an increment stays positive)."""
        increment = h2.window_increment(frame)
        taken = min(self._owed, increment - 1)
        self._owed -= taken
        return h2.encode_window_update(0, increment - taken)

    def _from_client(self, frame: h2.Frame) -> None:
        kind = frame.type
        if kind == h2.HEADERS and frame.flags & h2.END_HEADERS:  # a whole block: the usual
            self._headers(frame.stream_id, bytes(h2.header_fragment(frame)))
        elif kind in (h2.HEADERS, h2.CONTINUATION):
            if kind == h2.HEADERS:
                self._block = bytearray()
                self._block_stream = frame.stream_id
            self._block += h2.header_fragment(frame)
            if frame.flags & h2.END_HEADERS:
                self._headers(self._block_stream, bytes(self._block))
        elif kind == h2.DATA:
            call = self.calls.get(frame.stream_id)
            if call is not None and not call.inspected:
                self._request_data(frame.stream_id, call, frame)
        elif kind == h2.RST_STREAM:
            self.calls.pop(frame.stream_id, None)

    def _headers(self, stream_id: int, block: bytes) -> None:
        if block in self._known:
            path = self._known[block]
        else:
            path = _path(self.decoder.decode(block, raw=True))
            if not h2.only_indexed(block):
                self._known.clear()  # the dynamic table may have changed
            elif len(self._known) < KNOWN_BLOCKS:
                self._known[block] = path
        if stream_id in self.calls:
            return  # the client's trailers, if any
        if path is not None and path in self.watched:
            self.calls[stream_id] = _Call(path)

    def _request_data(self, stream_id: int, call: _Call, frame: h2.Frame) -> None:
        call.request += h2.data_of(frame)
        message = h2.grpc_message(call.request)
        if message is None:
            if frame.end_stream or len(call.request) > MAX_INSPECTED_MESSAGE_BYTES:
                self.calls.pop(stream_id, None)  # not one whole message: left alone
            return
        call.inspected = True
        compressed, body = message
        decision = None if compressed else self.intercept(call.method, body)
        if decision is None:
            self.calls.pop(stream_id, None)
            return
        future = asyncio.ensure_future(decision)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        call.decision = future
        call.request = bytearray()

    # -- runtime → client

    def _upstream_arrived(self, data: bytes) -> bool:
        if self._upstream_busy or self.calls or self.client.writing_paused:
            return False  # to the task: an answer may be held, or the client is slow
        try:
            self._pass_on(data)
        except (StreamError, ProtocolError) as exc:
            self._end("runtime", exc)
        return True

    def _pass_on(self, data: bytes) -> None:
        """No answer is looked into: the bytes go on as they came, whole frames or not, and
        are split afterwards (for the runtime's settings)."""
        self.client.write(data)
        splitter = self._from_upstream_frames
        frames = splitter.split(data, _ANSWER_KINDS)[1]
        self._upstream_ahead = splitter.pending
        for frame in frames:
            self._settings(frame)

    async def _upstream_to_client(self) -> None:
        try:
            while data := await self.upstream.receive(RECEIVE_BYTES):
                self._upstream_busy = True
                if not self.calls:
                    self._pass_on(data)
                    await self.client.drain()
                else:
                    await self._look_into(self._from_upstream_frames.split(data)[1])
                self._upstream_busy = False
        except (StreamError, ProtocolError) as exc:
            log.debug("relay: runtime side ended: %s", exc)

    async def _look_into(self, frames: list[h2.Frame]) -> None:
        """Pass the frames on, holding the answers of intercepted calls."""
        out = bytearray()
        for frame in frames:
            if self._upstream_ahead:
                # Its start went on as it came, while no call was watched: the rest follows
                # it (it answers no call watched now, which the runtime had not seen then).
                out += frame.raw[self._upstream_ahead :]
                self._upstream_ahead = 0
                self._settings(frame)
                continue
            call = self.calls.get(frame.stream_id)
            held = call is not None and call.decision is not None and not call.done
            if held and frame.type == h2.DATA:
                assert call is not None
                if await self._response_data(frame, call, out):
                    out = bytearray()
                continue
            if frame.type == h2.SETTINGS:
                self._settings(frame)
            elif (frame.type == h2.HEADERS and frame.end_stream) or frame.type == h2.RST_STREAM:
                self.calls.pop(frame.stream_id, None)
            out += frame.raw
        if out:
            await self.client.send(out)

    def _settings(self, frame: h2.Frame) -> None:
        size = h2.header_table_size(frame)
        if size is not None:
            self.decoder.max_allowed_table_size = size
            self._known.clear()  # the next block is decoded, so a table too big is refused

    async def _response_data(self, frame: h2.Frame, call: _Call, out: bytearray) -> bool:
        """Hold the frame's data; once the message is whole, send what precedes it in `out`
        and then the (rewritten) message. True when `out` was sent."""
        call.response += h2.data_of(frame)
        call.flow += len(frame.payload)
        call.end_stream = frame.end_stream
        message = h2.grpc_message(call.response)
        if message is None and not frame.end_stream:
            return False
        if out:
            await self.client.send(out)
        assert call.decision is not None
        replacement = None
        try:
            rewrite = await call.decision
            if message is not None and not message[0] and rewrite is not None:
                replacement = rewrite(message[1])
        except Exception:
            log.exception(
                "relay: interception of %s failed; the runtime's answer goes on", call.method
            )
        body = bytes(call.response)
        if replacement is not None and message is not None:
            rest = body[h2.GRPC_PREFIX_BYTES + len(message[1]) :]
            body = h2.encode_grpc_message(replacement) + rest
        try:
            frames = h2.data_frames_like(frame.stream_id, body, call.flow, call.end_stream)
        except ValueError:
            # Longer than the runtime's frames: sent as is, the difference owed.
            frames = h2.encode_frame(
                h2.DATA, h2.END_STREAM if call.end_stream else 0, frame.stream_id, body
            )
            self._owed += max(len(body) - call.flow, 0)
        call.done = True
        call.response = bytearray()
        await self.client.send(frames)
        return True


def _path(headers: Iterable[tuple[bytes | str, bytes | str]]) -> str | None:
    for name, value in headers:
        if name == b":path":
            return value if isinstance(value, str) else bytes(value).decode("ascii", "replace")
    return None


async def serve_relay(
    client: SocketStream, upstream_path: str, watched: frozenset[str], intercept: Intercept
) -> None:
    """Relay one kubelet connection to a new connection to the runtime's socket, once the
    client has shown it speaks HTTP/2 (its connection preface)."""
    first = bytearray()
    try:
        while len(first) < len(h2.PREFACE):
            chunk = await client.receive(RECEIVE_BYTES)
            first += chunk
            if not chunk or not h2.PREFACE.startswith(bytes(first[: len(h2.PREFACE)])):
                log.info("relay: a client without the HTTP/2 preface was dropped")
                await client.aclose()
                return
    except StreamError:
        await client.aclose()
        return
    try:
        upstream = await SocketStream.connect_unix(upstream_path)
    except (OSError, StreamError) as exc:
        # The client sees its connection closed, as it would with the runtime down.
        log.info("runtime unreachable upstream=%s error=%s", upstream_path, exc)
        await client.aclose()
        return
    try:
        await Relay(client, upstream, watched, intercept, bytes(first)).run()
    finally:
        with contextlib.suppress(StreamError, OSError):
            await upstream.aclose()
        with contextlib.suppress(StreamError, OSError):
            await client.aclose()
