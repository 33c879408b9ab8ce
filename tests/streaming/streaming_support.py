"""Helpers for the client <-> server tests: the demo API in the test's own event loop, with
echo and sink port-forward targets, and byte streams that collect or feed a command's stdio.

(Imported by module name; keep the name unique across the test tree.)
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from podgate.aio.errors import ClosedStreamError
from podgate.aio.streams import (
    DEFAULT_RECEIVE_BYTES,
    Buffer,
    ByteStream,
    SocketStream,
    start_server,
)
from podgate.demo.api import DemoApi, DemoPod
from podgate.proto.remotecommand import TerminalSize
from podgate.streaming.client import Endpoint, pod_path
from podgate.streaming.local import LocalTarget

# Remote ports of the demo pod; the LocalTarget maps them to real loopback servers.
ECHO_PORT = 7000  # echoes everything, then EOF after the client's EOF
SINK_PORT = 7001  # reads to EOF, answers with the sha256 hex digest of what it read
REFUSED_PORT = 7002  # mapped to a port nobody listens on
NAMESPACE = "default"
POD = "demo"
# How long server connection handlers may take to finish once their clients are gone.
HANDLER_SETTLE_SECONDS = 3.0
MIB = 1024 * 1024

T = TypeVar("T")


async def _echo(stream: SocketStream) -> None:
    while chunk := await stream.receive():
        await stream.send(chunk)
    await stream.send_eof()


async def _sink(stream: SocketStream) -> None:
    digest = hashlib.sha256()
    while chunk := await stream.receive():
        digest.update(chunk)
    await stream.send(digest.hexdigest().encode())
    await stream.send_eof()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Api:
    """A running demo API. `errors` collects exceptions that escaped a connection handler."""

    endpoint: Endpoint
    pod: DemoPod
    errors: list[BaseException] = field(default_factory=list)
    handlers: set[asyncio.Task[None]] = field(default_factory=set)
    # Connections the pod's targets (echo, sink) have open right now.
    pod_connections: int = 0
    pod_connections_changed: asyncio.Event = field(default_factory=asyncio.Event)

    def path(self, subresource: str, query: str = "") -> str:
        path = pod_path(self.pod.namespace, self.pod.name, subresource)
        return f"{path}?{query}" if query else path

    async def pod_connections_closed(self, timeout: float = HANDLER_SETTLE_SECONDS) -> None:
        """Wait until no target connection is open; AssertionError after `timeout`."""
        try:
            async with asyncio.timeout(timeout):
                while self.pod_connections:
                    self.pod_connections_changed.clear()
                    await self.pod_connections_changed.wait()
        except TimeoutError:
            raise AssertionError(f"{self.pod_connections} pod connection(s) still open") from None

    def counted(
        self, handler: Callable[[SocketStream], Awaitable[None]]
    ) -> Callable[[SocketStream], Awaitable[None]]:
        async def run(stream: SocketStream) -> None:
            self.pod_connections += 1
            self.pod_connections_changed.set()
            try:
                await handler(stream)
            finally:
                self.pod_connections -= 1
                self.pod_connections_changed.set()

        return run

    async def settle(self) -> list[asyncio.Task[None]]:
        """Wait for connection handlers to finish; returns the ones still running."""
        pending = {t for t in self.handlers if not t.done()}
        if pending:
            _, pending = await asyncio.wait(pending, timeout=HANDLER_SETTLE_SECONDS)
        return list(pending)


@dataclass
class _Servers:
    api: Api
    servers: list[asyncio.Server]


async def start_api() -> _Servers:
    pod = DemoPod(NAMESPACE, POD, ports=(ECHO_PORT, SINK_PORT))
    api = Api(Endpoint("127.0.0.1", 0), pod)
    echo = await start_server(api.counted(_echo), "127.0.0.1", 0)
    sink = await start_server(api.counted(_sink), "127.0.0.1", 0)
    target = LocalTarget(
        port_map={
            ECHO_PORT: echo.sockets[0].getsockname()[1],
            SINK_PORT: sink.sockets[0].getsockname()[1],
            REFUSED_PORT: _free_port(),
        }
    )
    demo = DemoApi(target, [pod])

    async def handle(conn: SocketStream) -> None:
        task = asyncio.current_task()
        assert task is not None
        api.handlers.add(task)
        try:
            await demo.handle(conn)
        except Exception as exc:
            api.errors.append(exc)
            raise

    server = await start_server(handle, "127.0.0.1", 0)
    api.endpoint = Endpoint("127.0.0.1", server.sockets[0].getsockname()[1])
    return _Servers(api, [server, echo, sink])


async def stop_api(running: _Servers) -> list[asyncio.Task[None]]:
    """Stop listening; return handler tasks that did not finish (they are cancelled)."""
    for server in running.servers:
        server.close()
    stuck = await running.api.settle()
    for task in stuck:
        task.cancel()
    await asyncio.gather(*stuck, return_exceptions=True)
    return stuck


class Collector(ByteStream):
    """Where a command's output goes: keeps every byte, records EOF."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.eof = False

    @property
    def data(self) -> bytes:
        return b"".join(self.parts)

    async def receive(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        raise ClosedStreamError("a collector is write-only")

    async def send(self, data: Buffer) -> None:
        self.parts.append(bytes(data))

    async def send_eof(self) -> None:
        self.eof = True

    async def aclose(self) -> None:
        self.eof = True


class Source(ByteStream):
    """A command's stdin: fixed bytes in pieces, then EOF (optionally after a pause)."""

    def __init__(self, data: bytes, *, piece: int = 64 * 1024, eof_delay: float = 0.0) -> None:
        self._view = memoryview(data)
        self._piece = piece
        self._eof_delay = eof_delay

    async def receive(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        if not self._view:
            if self._eof_delay:
                await asyncio.sleep(self._eof_delay)
                self._eof_delay = 0.0
            return b""
        size = min(max_bytes, self._piece)
        chunk, self._view = bytes(self._view[:size]), self._view[size:]
        return chunk

    async def send(self, data: Buffer) -> None:
        raise ClosedStreamError("a source is read-only")

    async def send_eof(self) -> None:
        pass

    async def aclose(self) -> None:
        self._view = memoryview(b"")


class PatternWriter:
    """Sends `total` pseudo-random bytes from a seeded PRNG, hashing what it sent."""

    def __init__(self, seed: int, total: int, chunk: int = MIB) -> None:
        self._random = random.Random(seed)
        self.total = total
        self.chunk = chunk
        self.sent = 0
        self.digest = hashlib.sha256()

    async def write_to(self, stream: ByteStream, *, eof: bool = True) -> None:
        while self.sent < self.total:
            piece = self._random.randbytes(min(self.chunk, self.total - self.sent))
            self.digest.update(piece)
            await stream.send(piece)
            self.sent += len(piece)
        if eof:
            await stream.send_eof()


class Meter:
    """Bytes moved so far, summed over any number of transfers (for stall detection)."""

    def __init__(self) -> None:
        self.bytes = 0


async def read_digest(
    stream: ByteStream, limit: int | None = None, meter: Meter | None = None
) -> tuple[int, str]:
    """Read to EOF (or `limit` bytes); (byte count, sha256 hex)."""
    digest = hashlib.sha256()
    count = 0
    while limit is None or count < limit:
        chunk = await stream.receive()
        if not chunk:
            break
        digest.update(chunk)
        count += len(chunk)
        if meter is not None:
            meter.bytes += len(chunk)
    return count, digest.hexdigest()


async def without_stall(aw: Awaitable[T], meter: Meter, stall_seconds: float) -> T:
    """Await `aw`, failing as soon as `meter` stops moving for `stall_seconds` (a hang shows
    up in seconds, while a slow machine may take as long as it needs)."""
    task = asyncio.ensure_future(aw)
    last = -1
    while True:
        done, _ = await asyncio.wait({task}, timeout=stall_seconds)
        if done:
            return task.result()
        if meter.bytes == last:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise AssertionError(f"no progress for {stall_seconds} s after {meter.bytes} bytes")
        last = meter.bytes


async def terminal_sizes(*pairs: tuple[int, int]) -> AsyncIterator[TerminalSize]:
    """Terminal sizes (width, height) for `resizes=`, a little apart, then stay open."""
    for width, height in pairs:
        yield TerminalSize(width, height)
        await asyncio.sleep(0.05)
    await asyncio.Event().wait()  # like a terminal: no more changes, but still there
