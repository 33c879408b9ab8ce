"""Helpers for the agent tests: short socket directories, echo servers, checked transfers,
ports that refuse, and ttrpc calls to the agent."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from podgate.agent.agent import SERVICE
from podgate.agent.agent_pb2 import HealthResponse, PortForwardRequest
from podgate.aio.errors import StreamError
from podgate.aio.streams import ByteStream
from podgate.aio.ttrpc import TtrpcClient

T = TypeVar("T")

MiB = 1024 * 1024
CHUNK = 256 * 1024


@contextlib.contextmanager
def short_dir(prefix: str = "pga") -> Iterator[str]:
    """A fresh directory with a short path: unix socket paths are limited to 107 bytes."""
    path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def on_fresh_thread(fn: Callable[[], T]) -> T:
    """Run `fn` on a new thread (namespace changes never touch a pooled or the test's thread)."""
    result: dict[str, Any] = {}

    def work() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]  # type: ignore[no-any-return]


def listening_socket(family: int, host: str, port: int = 0) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    sock.bind((host, port))
    sock.listen(64)
    sock.setblocking(False)
    return sock


@dataclass
class EchoServer:
    """Echoes every connection until EOF, then half-closes; counts connections and ends."""

    server: asyncio.Server
    port: int
    accepted: int = 0
    finished: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def until(self, condition: Callable[[], bool], timeout: float = 10) -> None:
        async with asyncio.timeout(timeout):
            while not condition():
                self.changed.clear()
                await self.changed.wait()

    async def close(self) -> None:
        self.server.close()
        await self.server.wait_closed()


async def start_echo(sock: socket.socket) -> EchoServer:
    """Serve an echo on an already listening socket (which may live in another netns)."""
    holder: list[EchoServer] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        echo = holder[0]
        echo.accepted += 1
        echo.changed.set()
        try:
            while data := await reader.read(CHUNK):
                writer.write(data)
                await writer.drain()
            writer.write_eof()
            await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            echo.finished += 1
            echo.changed.set()

    server = await asyncio.start_server(handle, sock=sock, limit=CHUNK)
    holder.append(EchoServer(server, sock.getsockname()[1]))
    return holder[0]


@contextlib.contextmanager
def refusing_port() -> Iterator[int]:
    """A port on 127.0.0.1 and ::1 that refuses connections: bound there, never listening."""
    for _ in range(20):
        v4 = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        v4.bind(("127.0.0.1", 0))
        port = v4.getsockname()[1]
        v6 = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        try:
            v6.bind(("::1", port))
        except OSError:
            v4.close()
            v6.close()
            continue
        try:
            yield port
        finally:
            v4.close()
            v6.close()
        return
    raise RuntimeError("no port free on both 127.0.0.1 and ::1")


def refused_message(port: int) -> str:
    """containerd's netns dial error (reference §1.2), said of the sandbox, with Go's
    net.OpError texts for the two refusals."""
    return (
        f"failed to connect to localhost:{port} inside the sandbox, "
        f"IPv4: dial tcp4 127.0.0.1:{port}: connect: connection refused "
        f"IPv6 dial tcp6 [::1]:{port}: connect: connection refused "
    )


@dataclass
class Transfer:
    sent: int
    received: int
    sent_sha256: str
    received_sha256: str


async def echo_transfer(stream: ByteStream, size: int, *, chunk: int = CHUNK) -> Transfer:
    """Send `size` random bytes and read the echo concurrently; then half-close."""
    payload = memoryview(os.urandom(size))
    sent_hash = hashlib.sha256()
    received_hash = hashlib.sha256()
    counts = [0, 0]

    async def writer() -> None:
        for offset in range(0, size, chunk):
            piece = payload[offset : offset + chunk]
            await stream.send(piece)
            sent_hash.update(piece)
            counts[0] += len(piece)
        await stream.send_eof()

    async def reader() -> None:
        while True:
            data = await stream.receive()
            if not data:
                return
            received_hash.update(data)
            counts[1] += len(data)

    await asyncio.gather(writer(), reader())
    return Transfer(counts[0], counts[1], sent_hash.hexdigest(), received_hash.hexdigest())


async def port_forward(
    client: TtrpcClient, port: int, vsock_port: int, container_id: str = "c1"
) -> bytes:
    request = PortForwardRequest(container_id=container_id, port=port, vsock_port=vsock_port)
    return await client.call(SERVICE, "PortForward", request.SerializeToString(), timeout=10)


async def health(client: TtrpcClient) -> str:
    reply = await client.call(SERVICE, "Health", b"", timeout=5)
    return HealthResponse.FromString(reply).status


class DialBacks:
    """Accepted dial-back connections, handed to the test one by one."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[ByteStream] = asyncio.Queue()
        self._hold = asyncio.Event()

    async def handler(self, stream: ByteStream) -> None:
        await self.queue.put(stream)
        # The listener closes the stream when this returns: hold it until the test is done.
        with contextlib.suppress(StreamError):
            await self._hold.wait()

    async def next(self, timeout: float = 10) -> ByteStream:
        async with asyncio.timeout(timeout):
            return await self.queue.get()

    async def none_within(self, seconds: float) -> bool:
        try:
            async with asyncio.timeout(seconds):
                await self.queue.get()
        except TimeoutError:
            return True
        return False

    def release(self) -> None:
        self._hold.set()
