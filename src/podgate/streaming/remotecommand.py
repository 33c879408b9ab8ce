"""exec and attach sessions, server side, over SPDY streams or WebSocket channels."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import TypeVar

from podgate.aio.errors import StreamError
from podgate.aio.spdy import SpdySession, SpdyStream
from podgate.aio.streams import ByteStream
from podgate.aio.tasks import cancel_and_wait
from podgate.aio.wschannel import ChannelSession
from podgate.proto import k8s
from podgate.proto import remotecommand as rc
from podgate.proto.errors import ProtocolError
from podgate.streaming.target import ExecIO, TargetError

log = logging.getLogger(__name__)

Runner = Callable[[ExecIO], Awaitable[int]]
T = TypeVar("T")

# WebSocket channel numbers of the exec/attach protocols.
STDIN, STDOUT, STDERR, ERROR, RESIZE = 0, 1, 2, 3, 4


async def resize_events(stream: ByteStream) -> AsyncIterator[rc.TerminalSize]:
    """Terminal sizes from a resize stream or channel; ends with it or on bad input."""
    decoder = rc.ResizeDecoder()
    try:
        while chunk := await stream.receive():
            for size in decoder.feed(chunk):
                yield size
    except (StreamError, ProtocolError) as exc:
        log.info("resize stream ended: %s", exc)


async def run_and_report(run: Runner, io: ExecIO, protocol: str) -> tuple[bytes | None, int | None]:
    """Run the command; return the error-stream payload for `protocol` and the exit code."""
    try:
        code = await run(io)
    except TargetError as exc:
        return rc.error_stream_payload(protocol, None, str(exc)), None
    except Exception as exc:
        # Never let a failure read as success: an empty error stream means exit code 0.
        log.exception("exec failed")
        return rc.error_stream_payload(protocol, None, f"{type(exc).__name__}: {exc}"), None
    return rc.error_stream_payload(protocol, code, None), code


async def run_while_connected(
    work: Coroutine[object, object, T], reader: asyncio.Task[None]
) -> T | None:
    """Run `work` until it finishes or the client's connection ends (the read loop `reader`
    returns); in the second case cancel it, which stops the command. None then."""
    task = asyncio.create_task(work, name="exec run")
    try:
        await asyncio.wait({task, reader}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():  # the client left, or this call was cancelled: stop the command
            await cancel_and_wait(task)
    if task.cancelled():
        return None
    return task.result()


async def serve_spdy_exec(
    session: SpdySession, protocol: str, options: rc.ExecOptions, run: Runner
) -> int | None:
    """Collect the client's streams (30 s at most), run, report the status, close."""
    expected = rc.expected_streams(options, protocol)
    collector = rc.SpdyStreamSet(expected)
    streams: dict[rc.StreamType, SpdyStream] = {}
    ready = asyncio.Event()

    def on_stream(stream: SpdyStream) -> None:
        verdict = collector.add(stream.stream_id, stream.headers)
        if isinstance(verdict, rc.Reject):
            stream.reset()
            return
        stream.accept()
        if isinstance(verdict, rc.Accept):
            streams[verdict.stream_type] = stream
        if collector.complete:
            ready.set()

    session.on_stream = on_stream
    reader = asyncio.create_task(session.run(), name="exec spdy read loop")
    code: int | None = None
    try:
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait(
            {waiter, reader}, timeout=rc.STREAM_CREATION_TIMEOUT, return_when="FIRST_COMPLETED"
        )
        waiter.cancel()
        if not ready.is_set():
            log.info("exec: timed out waiting for client to create streams")
            return None
        resize = streams.get(rc.StreamType.RESIZE)
        io = ExecIO(
            stdin=streams.get(rc.StreamType.STDIN),
            stdout=streams.get(rc.StreamType.STDOUT),
            stderr=streams.get(rc.StreamType.STDERR),
            tty=options.tty,
            resizes=resize_events(resize) if resize is not None else None,
        )
        outcome = await run_while_connected(run_and_report(run, io, protocol), reader)
        if outcome is None:
            log.info("exec: the client went away; the command was stopped")
            return None
        payload, code = outcome
        with contextlib.suppress(StreamError):
            for kind in (rc.StreamType.STDOUT, rc.StreamType.STDERR):
                if kind in streams:
                    await streams[kind].send_eof()
            error = streams[rc.StreamType.ERROR]
            if payload:
                await error.send(payload)
            await error.send_eof()
    except asyncio.CancelledError:
        # Cut (the server is stopping): the client must read an error, not a clean end.
        if rc.StreamType.ERROR in streams:
            await _send_cut(streams[rc.StreamType.ERROR], protocol)
        raise
    finally:
        await session.aclose()
        await cancel_and_wait(reader)
    return code


async def serve_ws_exec(
    session: ChannelSession, options: rc.ExecOptions, run: Runner
) -> int | None:
    """Channels 0–4 as the upstream server sets them up; status on 3, then close 1000."""
    protocol = session.protocol
    reader = asyncio.create_task(session.run(), name="exec ws read loop")
    code: int | None = None
    try:
        first = STDOUT if options.stdout else STDERR if options.stderr else ERROR
        session.send_ready(first)
        io = ExecIO(
            stdin=session.stream(STDIN) if options.stdin else None,
            stdout=session.stream(STDOUT) if options.stdout else None,
            stderr=session.stream(STDERR) if options.stderr and not options.tty else None,
            tty=options.tty,
            resizes=resize_events(session.stream(RESIZE)) if options.tty else None,
        )
        outcome = await run_while_connected(run_and_report(run, io, protocol), reader)
        if outcome is None:
            log.info("exec: the client went away; the command was stopped")
            return None
        payload, code = outcome
        if payload:
            with contextlib.suppress(StreamError):
                await session.stream(ERROR).send(payload)
    except asyncio.CancelledError:
        await _send_cut(session.stream(ERROR), protocol)  # an error, not a clean end
        raise
    finally:
        await session.aclose(1000)
        await cancel_and_wait(reader)
    return code


# How long a cut stream's error report may take to go out while the server stops, seconds.
CUT_REPORT_SECONDS = 1.0
CUT_MESSAGE = "the stream was cut: the server is shutting down"


async def _send_cut(error: ByteStream, protocol: str) -> None:
    """Tell the client on its error stream that its command was cut (best effort, bounded)."""
    if rc.status_is_json(protocol):
        payload = k8s.encode_status(k8s.status_internal_error(CUT_MESSAGE))
    else:
        payload = CUT_MESSAGE.encode()
    with contextlib.suppress(StreamError, TimeoutError):
        async with asyncio.timeout(CUT_REPORT_SECONDS):
            await asyncio.shield(error.send(payload))


def exit_status_bytes(code: int | None, message: str | None = None) -> bytes:
    """The v4 Status for an exit code (kept for clients and tests)."""
    if code is None:
        return k8s.encode_status(k8s.status_internal_error(message or "unknown error"))
    if code == 0:
        return k8s.encode_status(k8s.status_success())
    return k8s.encode_status(
        k8s.status_exit_code(code, f"command terminated with exit code {code}")
    )
