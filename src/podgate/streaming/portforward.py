"""Port-forward sessions, server side: SPDY stream pairs and WebSocket channel pairs.

Under podgate's UDP extension (negotiated; see podgate.proto.datagram) a SPDY pair may be a
UDP flow: the target's stream then carries framed datagrams, and the same splice, hooks and
error stream handle it. The extension also means both ends are podgate, so its SPDY sessions
use per-stream flow control (`flow_control_window`). WebSocket v4 channel pairs are TCP only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine, Sequence

from podgate.aio.errors import ForwardError, StalledStreamError, StreamError, StreamResetError
from podgate.aio.spdy import SpdySession, SpdyStream
from podgate.aio.spdysplice import splice_forward
from podgate.aio.splice import HALF_CLOSE_GRACE_SECONDS, SpliceResult, splice
from podgate.aio.streams import DEFAULT_RECEIVE_BYTES, Buffer, ByteStream
from podgate.aio.tasks import cancel_and_wait
from podgate.aio.wschannel import ChannelSession, ChannelStream
from podgate.proto import portforward as pf
from podgate.proto.spdy import STREAM_WINDOW_BYTES
from podgate.streaming.hooks import NO_HOOKS, ForwardRecord, SessionHooks
from podgate.streaming.target import PodRef, StreamTarget, TargetError

log = logging.getLogger(__name__)

# How often pending stream pairs are checked against the 30 s creation timeout.
PAIR_EXPIRY_CHECK_SECONDS = 1.0


def flow_control_window(protocol: str) -> int | None:
    """The per-stream SPDY window of a port-forward session that negotiated `protocol` (the
    inner one, for the tunnel), or None for no flow control.

    Only podgate offers or accepts its extension, so it means a podgate peer at the other end;
    any other protocol may be spdystream, which never returns window (k8s-streaming.md §1.8)."""
    return STREAM_WINDOW_BYTES if protocol == pf.UDP_PORTFORWARD_PROTOCOL else None


class SpdyPortForwardServer:
    """Pairs a session's error/data streams by requestid and forwards each pair."""

    def __init__(
        self,
        pod: PodRef,
        target: StreamTarget,
        *,
        label: str = "",
        hooks: SessionHooks = NO_HOOKS,
        udp: bool = False,
    ) -> None:
        self.pod = pod
        self.target = target
        self.hooks = hooks
        self.pairing = pf.PortForwardPairing(conn_label=label or hex(id(self)), udp=udp)
        self._streams: dict[int, SpdyStream] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def on_stream(self, stream: SpdyStream) -> None:
        result = self.pairing.add_stream(stream.stream_id, stream.headers, time.monotonic())
        if isinstance(result, pf.Rejected):
            log.info(
                "port-forward %s: rejected stream %d: %s", self.pod, stream.stream_id, result.reason
            )
            stream.reset()
            return
        stream.accept()
        self._streams[stream.stream_id] = stream
        if isinstance(result, pf.Duplicate):
            if result.error_stream_id is not None:
                self._spawn(self._report(result.error_stream_id, result.message), "pf duplicate")
            stream.reset()
            self._streams.pop(stream.stream_id, None)
        elif isinstance(result, pf.Pair):
            name = f"pf {result.port}/{result.protocol} req {result.request_id}"
            self._spawn(self._forward(result), name)
        elif isinstance(result, pf.UnsupportedProtocol):
            self._spawn(self._unsupported(result), f"pf {result.port} bad protocol")

    async def serve(self, session: SpdySession) -> None:
        """Run the session until it ends, expiring incomplete pairs, then stop all forwards."""
        reader = asyncio.create_task(session.run(), name="pf spdy read loop")
        try:
            while not reader.done():
                await asyncio.wait({reader}, timeout=PAIR_EXPIRY_CHECK_SECONDS)
                for expired in self.pairing.expire(time.monotonic()):
                    if expired.error_stream_id is not None:
                        self._spawn(
                            self._report(expired.error_stream_id, expired.message, reset=True),
                            "pf expired",
                        )
            # The connection is gone; let running forwards notice and finish.
            if self._tasks:
                await asyncio.wait(set(self._tasks), timeout=1.0)
        finally:
            await cancel_and_wait(*self._tasks)
            await session.aclose()
            await cancel_and_wait(reader)
            if session.spliced_bytes_received or session.spliced_bytes_sent:
                log.info(
                    "port-forward %s: %d payload bytes spliced from the client, %d to it",
                    self.pod,
                    session.spliced_bytes_received,
                    session.spliced_bytes_sent,
                )

    def _spawn(self, coro: Coroutine[object, object, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _report(self, error_stream_id: int, message: str, *, reset: bool = False) -> None:
        stream = self._streams.get(error_stream_id)
        if stream is None:
            return
        with contextlib.suppress(StreamError):
            await stream.send(message.encode())
        if reset:
            stream.reset()
            self._streams.pop(error_stream_id, None)

    async def _unsupported(self, refused: pf.UnsupportedProtocol) -> None:
        error = self._streams.pop(refused.error_stream_id)
        data = self._streams.pop(refused.data_stream_id)
        message = pf.forward_error_message(
            refused.port, self.pod.label, self.pod.uid, refused.message
        )
        log.info("port-forward %s: %s", self.pod, message)
        await self._fail(error, data, message)

    async def _forward(self, pair: pf.Pair) -> None:
        error = self._streams.pop(pair.error_stream_id)
        data = self._streams.pop(pair.data_stream_id)
        self.pairing.remove(pair.request_id)
        record = ForwardRecord(pair.port, pair.protocol.value)
        self.hooks.forward_started(record)
        try:
            await self._run_pair(pair, error, data, record)
        finally:
            self.hooks.forward_finished(record)

    async def _run_pair(
        self, pair: pf.Pair, error: SpdyStream, data: SpdyStream, record: ForwardRecord
    ) -> None:
        denied = self.hooks.check_port(pair.port, pair.protocol.value)
        if denied is not None:
            record.outcome, record.reason = "denied", denied
            await self._fail(error, data, denied)
            return
        try:
            upstream = await self.target.open_port(
                self.pod, pair.port, protocol=pair.protocol.value
            )
        except TargetError as exc:
            message = pf.forward_error_message(pair.port, self.pod.label, self.pod.uid, str(exc))
            record.outcome, record.reason = "error", message
            log.info("port-forward %s: %s", self.pod, message)
            await self._fail(error, data, message)
            return
        # In the kernel when both the session's socket and the pod's allow it; a hook that
        # wraps the pod's stream (a rate limit) keeps the bytes in Python, where it sees them.
        result = await splice_forward(
            _EndsWithErrorStream(data, error), data, self.hooks.wrap(upstream)
        )
        record.bytes_in, record.bytes_out = result.a_to_b, result.b_to_a
        if isinstance(result.error, ForwardError):
            # The runtime behind us explained the failure: pass its words on.
            record.outcome, record.reason = "error", str(result.error)
            await self._fail(error, data, str(result.error))
        elif isinstance(result.error, StalledStreamError):
            message = pf.forward_error_message(
                pair.port, self.pod.label, self.pod.uid, str(result.error)
            )
            record.outcome, record.reason = "error", message
            await self._fail(error, data, message)
        elif isinstance(result.error, StreamResetError) and data.fin_sent:
            # kubectl 1.32+ resets the data stream once it has read our FIN: a normal end.
            error.reset()
        elif result.error is not None:
            log.debug("port-forward %s:%d ended: %s", self.pod, pair.port, result.error)
            record.outcome, record.reason = "error", str(result.error)
            error.reset()
        else:
            with contextlib.suppress(StreamError):
                await error.send_eof()
            await error.aclose()

    @staticmethod
    async def _fail(error: SpdyStream, data: SpdyStream, message: str) -> None:
        """One message on the error stream, then RST data and error (as the kubelet does)."""
        with contextlib.suppress(StreamError):
            await error.send(message.encode())
        data.reset()
        error.reset()


class _EndsWithErrorStream(ByteStream):
    """The client's data stream, whose EOF (the pod closed the connection) also finishes the
    pair's error stream at once.

    client-go's port-forward, after the data stream's EOF, waits for the error stream to end
    before it closes the local connection (kubectl 1.27-1.33 over SPDY and the tunnel): a
    pair whose error stream stayed open until the client's own EOF would leave a client that
    waits for the pod's close (HTTP/1.0) hanging. The kubelet ends both when the runtime's
    copy ends."""

    def __init__(self, data: SpdyStream, error: SpdyStream) -> None:
        self._data = data
        self._error = error

    async def receive(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        return await self._data.receive(max_bytes)

    async def send(self, payload: Buffer) -> None:
        await self._data.send(payload)

    async def send_eof(self) -> None:
        await self._data.send_eof()
        with contextlib.suppress(StreamError):
            await self._error.send_eof()

    async def aclose(self) -> None:
        await self._data.aclose()


async def _splice_until_stalled(
    data_ch: ChannelStream, upstream: ByteStream, grace: float
) -> SpliceResult:
    """The splice, ended as soon as the channel is reset for a stalled reader: the copy into
    the pod may be the one waiting, and would never read the channel to learn of it."""
    splicing = asyncio.ensure_future(splice(data_ch, upstream, grace=grace))
    stalled = asyncio.ensure_future(data_ch.stalled.wait())
    try:
        await asyncio.wait({splicing, stalled}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait(stalled)
    if not splicing.done():
        await cancel_and_wait(splicing)  # closes both streams
        return SpliceResult(error=data_ch.stall_error or StalledStreamError("port reset"))
    return splicing.result()


async def serve_websocket_portforward(
    channels: ChannelSession,
    ports: Sequence[int],
    pod: PodRef,
    target: StreamTarget,
    hooks: SessionHooks = NO_HOOKS,
) -> None:
    """v4 channel port-forward: one connection per port for the life of the WebSocket."""

    async def one(index: int, port: int) -> None:
        data_ch = channels.stream(2 * index)
        error_ch = channels.stream(2 * index + 1)
        record = ForwardRecord(port)
        hooks.forward_started(record)
        try:
            denied = hooks.check_port(port, "tcp")
            if denied is not None:
                record.outcome, record.reason = "denied", denied
                with contextlib.suppress(StreamError):
                    await error_ch.send(denied.encode())
                return
            try:
                upstream = await target.open_port(pod, port, protocol="tcp")
            except TargetError as exc:
                message = pf.forward_error_message(port, pod.label, pod.uid, str(exc))
                record.outcome, record.reason = "error", message
                with contextlib.suppress(StreamError):
                    await error_ch.send(message.encode())
                return
            # Without channel close (v4) the client cannot be told of the pod's EOF but by
            # the end of the connection: the pod's EOF ends the port at once (no grace), and
            # the WebSocket closes once every port has ended, as the kubelet does.
            grace = HALF_CLOSE_GRACE_SECONDS if channels.can_close_channels else 0.0
            result = await _splice_until_stalled(data_ch, hooks.wrap(upstream), grace)
            record.bytes_in, record.bytes_out = result.a_to_b, result.b_to_a
            if isinstance(result.error, StalledStreamError | ForwardError):
                # The pod stopped reading this port, or the runtime explained a failure: say
                # so on the port's error channel, as the SPDY path does on its error stream.
                message = str(result.error)
                if isinstance(result.error, StalledStreamError):
                    message = pf.forward_error_message(port, pod.label, pod.uid, message)
                record.outcome, record.reason = "error", message
                with contextlib.suppress(StreamError):
                    await error_ch.send(message.encode())
            elif result.error is not None:
                record.outcome, record.reason = "error", str(result.error)
        finally:
            hooks.forward_finished(record)

    async with asyncio.TaskGroup() as group:
        for i, port in enumerate(ports):
            group.create_task(one(i, port), name=f"ws pf {port}")
