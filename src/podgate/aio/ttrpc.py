"""asyncio driver for the ttrpc core: a server that runs each request as its own task, and a
client that multiplexes concurrent calls over one connection.

Both sit on a `Wire` (a `SocketStream`, for instance): frames are written synchronously in the
order the core produced them, so concurrent calls never interleave bytes, and `drain()` gives
backpressure. The server reads on while handlers run, up to `MAX_CONCURRENT_REQUESTS` per
connection; past that it stops reading, so a flood costs the peer TCP backpressure instead of
costing us tasks and memory. A connection that sends garbage is closed; nothing it does reaches
another connection.

Semantics follow containerd/ttrpc: a request's `timeout_nano` bounds its handler
(DEADLINE_EXCEEDED "context deadline exceeded"), handler errors become statuses once, here, and
a connection that ends cancels the handlers still running on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

from podgate.aio.errors import StreamError
from podgate.aio.streams import SocketStream, Wire, start_unix_server
from podgate.proto.errors import LocalProtocolError
from podgate.proto.ttrpc import (
    Code,
    OversizedMessageError,
    RequestReceived,
    ResponseReceived,
    Role,
    StreamAborted,
    StreamClosedError,
    TtrpcConnection,
    TtrpcConnectionError,
    TtrpcError,
    code_name,
)
from podgate.proto.ttrpc.events import Event
from podgate.proto.ttrpc.frames import MAX_TIMEOUT_NANO

__all__ = [
    "CLOSED_MESSAGE",
    "DEADLINE_MESSAGE",
    "MAX_CONCURRENT_REQUESTS",
    "Handler",
    "RequestContext",
    "TtrpcClient",
    "TtrpcClosedError",
    "TtrpcServer",
    "status_for_exception",
]

log = logging.getLogger(__name__)

# Requests one connection may have running at once; at the limit the server stops reading that
# connection. Each may hold a 4 MiB payload, so this also bounds memory per peer.
MAX_CONCURRENT_REQUESTS = 128
DEADLINE_MESSAGE = "context deadline exceeded"  # Go's context.DeadlineExceeded text
CLOSED_MESSAGE = "ttrpc: closed"  # Go's ttrpc.ErrClosed text
_NANOS_PER_SECOND = 1_000_000_000


@dataclass(frozen=True, slots=True)
class RequestContext:
    """What a handler knows about its call besides the payload."""

    service: str
    method: str
    stream_id: int
    metadata: tuple[tuple[str, str], ...]
    timeout: float | None  # seconds the client allowed (timeout_nano); None: no deadline


Handler = Callable[[bytes, RequestContext], Awaitable[bytes]]


class TtrpcClosedError(TtrpcError):
    """The connection is gone (or was never usable): the call's outcome is unknown."""

    def __init__(self, message: str = CLOSED_MESSAGE) -> None:
        super().__init__(Code.UNAVAILABLE, message)


def status_for_exception(exc: BaseException) -> tuple[int, str]:
    """A handler's exception as a status, mapped the way Go's ttrpc convertCode maps errors."""
    if isinstance(exc, TtrpcError):
        return exc.code, exc.message
    message = str(exc) or type(exc).__name__
    if isinstance(exc, TimeoutError):
        return Code.DEADLINE_EXCEEDED, DEADLINE_MESSAGE
    if isinstance(exc, EOFError):
        return Code.OUT_OF_RANGE, message
    if isinstance(exc, FileExistsError):
        return Code.ALREADY_EXISTS, message
    if isinstance(exc, FileNotFoundError):
        return Code.NOT_FOUND, message
    if isinstance(exc, PermissionError):
        return Code.PERMISSION_DENIED, message
    return Code.UNKNOWN, message


# ----------------------------------------------------------------------------- server


class TtrpcServer:
    """Services by name; `serve(wire)` runs one connection until it ends."""

    def __init__(
        self, *, max_concurrent_requests: int = MAX_CONCURRENT_REQUESTS, name: str = "ttrpc"
    ) -> None:
        if max_concurrent_requests < 1:
            raise ValueError("max_concurrent_requests must be at least 1")
        self.name = name
        self.max_concurrent_requests = max_concurrent_requests
        self._services: dict[str, dict[str, Handler]] = {}
        self._serving: set[asyncio.Task[object]] = set()
        self._closed = False

    def register(self, service: str, methods: Mapping[str, Handler]) -> None:
        """Serve `service` (fully qualified, e.g. "nri.pkg.api.v1alpha1.Runtime")."""
        if service in self._services:
            raise ValueError(f"duplicate service {service} registered")
        self._services[service] = dict(methods)

    async def serve(self, wire: Wire) -> None:
        """Answer requests on one connection until EOF, garbage, or `aclose()`; then close it.

        Never raises for anything the peer does.
        """
        task = asyncio.current_task()
        if task is not None:
            self._serving.add(task)
        try:
            if self._closed:
                await wire.aclose()
                return
            await _ServerConnection(self, wire).run()
        finally:
            if task is not None:
                self._serving.discard(task)

    async def listen_unix(self, path: str, *, mode: int = 0o600) -> asyncio.Server:
        """Listen on a unix socket, serving each connection in its own task."""
        return await start_unix_server(self.serve, path, mode=mode)

    async def aclose(self) -> None:
        """Stop serving: every connection is closed and its running handlers cancelled (the
        `serve()` calls end by cancellation). Close the listener first."""
        self._closed = True
        current = asyncio.current_task()
        tasks = [task for task in self._serving if task is not current]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def _lookup(self, event: RequestReceived) -> Handler | tuple[int, str]:
        methods = self._services.get(event.service)
        if methods is None:
            return Code.UNIMPLEMENTED, f"service {event.service}"
        handler = methods.get(event.method)
        if handler is None:
            return Code.UNIMPLEMENTED, f"method {event.method}"
        return handler


class _ServerConnection:
    def __init__(self, server: TtrpcServer, wire: Wire) -> None:
        self._server = server
        self._wire = wire
        self._core = TtrpcConnection(Role.SERVER)
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._slots = asyncio.Semaphore(server.max_concurrent_requests)
        self._loop = asyncio.get_running_loop()
        self._broken = False
        peer = getattr(wire, "peername", None)
        self.name = f"{server.name} {peer}" if peer else server.name

    async def run(self) -> None:
        try:
            while True:
                data = await self._wire.receive()
                try:
                    events = self._core.receive_data(data) if data else self._core.receive_eof()
                except TtrpcConnectionError as exc:
                    log.warning("%s: closing connection: %s", self.name, exc)
                    return
                for event in events:
                    await self._dispatch(event)
                self._flush()
                await self._wire.drain()
                if not data or self._broken:
                    return
        except StreamError as exc:
            log.debug("%s: connection lost: %s", self.name, exc)
        except Exception:
            log.exception("%s: connection failed", self.name)
        finally:
            # As the Go server: once the connection ends, the requests on it are abandoned.
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks)
            with contextlib.suppress(StreamError):
                await self._wire.aclose()

    async def _dispatch(self, event: Event) -> None:
        if isinstance(event, RequestReceived):
            found = self._server._lookup(event)
            if isinstance(found, tuple):
                code, message = found
                self._respond(event.stream_id, b"", code, message)
                return
            # Waiting here stops the read loop: the backpressure for a flood of requests.
            await self._slots.acquire()
            task = self._loop.create_task(
                self._call(event, found),
                name=f"{self.name} stream {event.stream_id} {event.service}/{event.method}",
            )
            self._tasks[event.stream_id] = task
            task.add_done_callback(functools.partial(self._finished, event.stream_id))
        elif isinstance(event, StreamAborted):
            running = self._tasks.get(event.stream_id)
            if running is not None:
                log.info("%s: stream %d aborted: %s", self.name, event.stream_id, event.message)
                running.cancel()
        # Data on a stream goes unused: handlers here are unary.

    def _finished(self, stream_id: int, _task: asyncio.Task[None]) -> None:
        self._tasks.pop(stream_id, None)
        self._slots.release()

    async def _call(self, event: RequestReceived, handler: Handler) -> None:
        started = self._loop.time()
        timeout = event.timeout_nano / _NANOS_PER_SECOND if event.timeout_nano else None
        context = RequestContext(
            event.service, event.method, event.stream_id, event.metadata, timeout
        )
        payload, code, message = b"", int(Code.OK), ""
        scope = asyncio.timeout_at(None if timeout is None else started + timeout)
        try:
            async with scope:
                payload = await handler(event.payload, context)
        except TimeoutError as exc:
            code, message = (
                (Code.DEADLINE_EXCEEDED, DEADLINE_MESSAGE)
                if scope.expired()
                else status_for_exception(exc)
            )
        except TtrpcError as exc:
            code, message = exc.code, exc.message
        except Exception as exc:
            log.exception(
                "%s: %s/%s (stream %d) failed",
                self.name,
                event.service,
                event.method,
                event.stream_id,
            )
            code, message = status_for_exception(exc)
        log.debug(
            "%s: %s/%s stream %d -> %s in %.3f s",
            self.name,
            event.service,
            event.method,
            event.stream_id,
            code_name(code),
            self._loop.time() - started,
        )
        self._respond(event.stream_id, payload, code, message)
        with contextlib.suppress(StreamError):
            await self._wire.drain()

    def _respond(self, stream_id: int, payload: bytes, code: int, message: str) -> None:
        try:
            try:
                self._core.send_response(stream_id, payload, code=code, message=message)
            except OversizedMessageError as exc:
                self._core.send_response(stream_id, code=exc.code, message=exc.message)
            except StreamClosedError:
                return  # the core already answered this stream with an error
            except LocalProtocolError as exc:  # e.g. a reply that is not bytes
                log.error("%s: cannot send the reply on stream %d: %s", self.name, stream_id, exc)
                self._core.send_response(stream_id, code=Code.INTERNAL, message=exc.message)
        finally:
            self._flush()

    def _flush(self) -> None:
        data = self._core.data_to_send()
        if data and not self._broken:
            try:
                self._wire.write(data)
            except StreamError as exc:
                log.debug("%s: write failed: %s", self.name, exc)
                self._broken = True


# ----------------------------------------------------------------------------- client


class TtrpcClient:
    """Calls over one connection; concurrent calls share it, each on its own stream."""

    def __init__(self, wire: Wire, *, name: str = "ttrpc client") -> None:
        self.name = name
        self._wire = wire
        self._core = TtrpcConnection(Role.CLIENT)
        self._pending: dict[int, asyncio.Future[bytes]] = {}
        self._closed: TtrpcClosedError | None = None
        self._loop = asyncio.get_running_loop()
        self._reader = self._loop.create_task(self._read_loop(), name=f"{name} reader")

    @classmethod
    async def connect_unix(
        cls, path: str | os.PathLike[str], *, name: str = "ttrpc client"
    ) -> TtrpcClient:
        return cls(await SocketStream.connect_unix(os.fspath(path)), name=name)

    async def call(
        self,
        service: str,
        method: str,
        payload: bytes = b"",
        *,
        timeout: float | None = None,
        metadata: Iterable[tuple[str, str]] = (),
    ) -> bytes:
        """One unary call; returns the reply payload or raises TtrpcError with its status.

        `timeout` (seconds) travels as timeout_nano for the server and bounds the wait here.
        """
        if self._closed is not None:
            raise self._closed
        timeout_nano = 0
        if timeout is not None:
            if timeout <= 0:
                raise TtrpcError(Code.DEADLINE_EXCEEDED, DEADLINE_MESSAGE)
            timeout_nano = max(1, min(int(timeout * _NANOS_PER_SECOND), MAX_TIMEOUT_NANO))
        try:
            stream_id = self._core.send_request(
                service, method, payload, timeout_nano=timeout_nano, metadata=metadata
            )
        except OversizedMessageError as exc:
            # What a Go peer would answer; NRI's Synchronize splits its request on this code.
            raise TtrpcError(exc.code, exc.message) from exc
        future: asyncio.Future[bytes] = self._loop.create_future()
        self._pending[stream_id] = future
        scope = asyncio.timeout(timeout)
        try:
            self._flush()
            async with scope:
                await self._drain()
                return await future
        except TimeoutError:
            if scope.expired():
                raise TtrpcError(Code.DEADLINE_EXCEEDED, DEADLINE_MESSAGE) from None
            raise
        finally:
            # A call that gave up leaves no state behind; its late reply is dropped.
            self._pending.pop(stream_id, None)
            self._core.abandon_stream(stream_id)

    async def aclose(self) -> None:
        """Close the connection; calls still waiting fail with TtrpcClosedError."""
        self._shutdown(TtrpcClosedError())
        self._reader.cancel()
        await asyncio.wait([self._reader])

    async def __aenter__(self) -> TtrpcClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        return self._closed is not None

    async def _read_loop(self) -> None:
        reason = "connection closed by peer"
        try:
            while True:
                data = await self._wire.receive()
                events = self._core.receive_data(data) if data else self._core.receive_eof()
                for event in events:
                    if isinstance(event, ResponseReceived):
                        self._resolve(event)
                if not data:
                    break
        except TtrpcConnectionError as exc:
            log.warning("%s: closing connection: %s", self.name, exc)
            reason = exc.message
        except StreamError as exc:
            reason = str(exc) or type(exc).__name__
        except Exception as exc:
            log.exception("%s: read loop failed", self.name)
            reason = repr(exc)
        finally:
            self._shutdown(TtrpcClosedError(f"{CLOSED_MESSAGE}: {reason}"))
            with contextlib.suppress(StreamError):
                await self._wire.aclose()

    def _resolve(self, event: ResponseReceived) -> None:
        future = self._pending.pop(event.stream_id, None)
        if future is None or future.done():
            return
        if event.code == Code.OK:
            future.set_result(event.payload)
        else:
            future.set_exception(TtrpcError(event.code, event.message))

    def _shutdown(self, error: TtrpcClosedError) -> None:
        if self._closed is None:
            self._closed = error
        for future in self._pending.values():
            if not future.done():
                future.set_exception(TtrpcClosedError(self._closed.message))
        self._pending.clear()

    def _flush(self) -> None:
        data = self._core.data_to_send()
        if not data:
            return
        try:
            self._wire.write(data)
        except StreamError as exc:
            self._shutdown(TtrpcClosedError(f"{CLOSED_MESSAGE}: {exc}"))
            raise self._closed or TtrpcClosedError() from exc

    async def _drain(self) -> None:
        try:
            await self._wire.drain()
        except StreamError as exc:
            self._shutdown(TtrpcClosedError(f"{CLOSED_MESSAGE}: {exc}"))
            raise self._closed or TtrpcClosedError() from exc
