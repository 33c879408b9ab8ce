"""Helpers for the port-forward client tests (imported by module name; keep it unique).

An in-process demo API whose pods the test can delete and recreate, a TCP proxy in front of it
that can cut, pause or freeze every connection (a gateway restart, a network blip), UDP echo
servers, and a runner for `podgate port-forward --json` as a child process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from podgate.aio.errors import StreamError
from podgate.aio.streams import SocketStream, start_server
from podgate.demo.api import DemoApi, DemoPod
from podgate.forward.status import EventKind, ForwardEvent
from podgate.kubeconfig import ApiServer
from podgate.streaming.client import Endpoint

REPO = Path(__file__).resolve().parents[2]

# Bound on any wait for an event, a line or an exit in these tests.
WAIT_SECONDS = 20.0
# Poll period while waiting for an event recorded by another task.
POLL_SECONDS = 0.01
# After SIGINT, how long `podgate port-forward` may take to exit.
STOP_SECONDS = 10.0


@dataclass(slots=True)
class ReplaceablePod(DemoPod):
    """A demo pod whose uid changes with `generation` (a pod recreated under its name)."""

    generation: int = 0

    @property
    def uid(self) -> str:
        return f"demo-{self.namespace}-{self.name}-{self.generation}"


# --- a proxy that can fail on demand ------------------------------------------------------


class Proxy:
    """TCP proxy from a loopback port to `target_port`; cut(), pause() and freeze() simulate a
    gateway restart, a gateway that is down, and a connection that silently stops moving."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.accepted = 0
        self._server: asyncio.Server | None = None
        self._pairs: set[tuple[SocketStream, SocketStream]] = set()

    async def start(self) -> None:
        self._server = await start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _pump(self, src: SocketStream, dst: SocketStream) -> None:
        with contextlib.suppress(StreamError):
            while chunk := await src.receive():
                await self.flowing.wait()
                await dst.send(chunk)
            await dst.send_eof()

    async def _handle(self, client: SocketStream) -> None:
        self.accepted += 1
        try:
            upstream = await SocketStream.connect("127.0.0.1", self.target_port)
        except StreamError:
            return
        pair = (client, upstream)
        self._pairs.add(pair)
        try:
            await asyncio.gather(self._pump(client, upstream), self._pump(upstream, client))
        finally:
            self._pairs.discard(pair)
            await upstream.aclose()

    def cut(self) -> None:
        """Reset every proxied connection (the gateway went away)."""
        for client, upstream in list(self._pairs):
            client.abort()
            upstream.abort()

    async def pause(self) -> None:
        """Stop listening and cut everything: connection attempts are refused."""
        assert self._server is not None
        self._server.close()
        self.cut()
        await self._server.wait_closed()
        self._server = None

    async def resume(self) -> None:
        await self.start()

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        self.cut()


# --- the API ------------------------------------------------------------------------------


@dataclass
class DemoCluster:
    """A demo API in this event loop, behind a Proxy, with an echo server as port 7000."""

    api: DemoApi
    proxy: Proxy
    server: asyncio.Server
    echo_port: int
    pods: list[DemoPod] = field(default_factory=list)

    def api_server(self, namespace: str = "default") -> ApiServer:
        url = f"http://127.0.0.1:{self.proxy.port}"
        return ApiServer(Endpoint("127.0.0.1", self.proxy.port), "", namespace, "test", url)

    def delete(self, name: str) -> DemoPod:
        (pod,) = [p for p in self.api.source.pods if p.name == name]  # type: ignore[attr-defined]
        self.api.source.pods.remove(pod)  # type: ignore[attr-defined]
        return pod

    def add(self, pod: DemoPod) -> None:
        self.api.source.pods.append(pod)  # type: ignore[attr-defined]


async def echo_handler(stream: SocketStream) -> None:
    with contextlib.suppress(StreamError):
        while chunk := await stream.receive():
            await stream.send(chunk)
        await stream.send_eof()


class UdpEcho(asyncio.DatagramProtocol):
    """Echoes each datagram back to its sender."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.transport.sendto(data, addr)


@contextlib.asynccontextmanager
async def demo_cluster(
    pods: Sequence[DemoPod], port_map: dict[int, int], udp_port_map: dict[int, int] | None = None
) -> AsyncIterator[DemoCluster]:
    from podgate.streaming.local import LocalTarget

    echo = await start_server(echo_handler, "127.0.0.1", 0)
    echo_port = echo.sockets[0].getsockname()[1]
    target = LocalTarget(
        port_map={**port_map, 7000: echo_port}, udp_port_map=dict(udp_port_map or {})
    )
    api = DemoApi(target, list(pods))
    server = await api.serve("127.0.0.1", 0)
    proxy = Proxy(server.sockets[0].getsockname()[1])
    await proxy.start()
    try:
        yield DemoCluster(api, proxy, server, echo_port, list(pods))
    finally:
        await proxy.aclose()
        for s in (server, echo):
            s.close()


class EventLog:
    """Every ForwardEvent, and waiting for one."""

    def __init__(self) -> None:
        self.events: list[ForwardEvent] = []

    def __call__(self, event: ForwardEvent) -> None:
        self.events.append(event)

    def kinds(self) -> list[EventKind]:
        return [e.kind for e in self.events]

    def of(self, kind: EventKind) -> list[ForwardEvent]:
        return [e for e in self.events if e.kind is kind]

    async def wait_for(
        self, kind: EventKind, count: int = 1, timeout: float = WAIT_SECONDS
    ) -> list[ForwardEvent]:
        deadline = time.monotonic() + timeout
        while len(found := self.of(kind)) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"{count} x {kind} not seen in {timeout} s: {self.kinds()}")
            await asyncio.sleep(POLL_SECONDS)
        return found


async def echo_once(port: int, data: bytes, timeout: float = WAIT_SECONDS) -> bytes:
    """Send `data`, half-close, read to EOF."""
    async with asyncio.timeout(timeout):
        stream = await SocketStream.connect("127.0.0.1", port)
        try:
            await stream.send(data)
            await stream.send_eof()
            out = bytearray()
            while chunk := await stream.receive():
                out += chunk
            return bytes(out)
        finally:
            await stream.aclose()


# --- `podgate port-forward --json` as a child process --------------------------------------


class JsonForward:
    """A running `podgate port-forward --json`: its events as they come, its exit code."""

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "podgate", "port-forward", "--json", *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=REPO,
            env=env,
        )
        self.events: list[dict[str, Any]] = []
        self._buffer = b""

    def _read(self, timeout: float) -> bool:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        readable, _, _ = select.select([fd], [], [], max(timeout, 0))
        if not readable:
            return True
        chunk = os.read(fd, 65536)
        if not chunk:
            return False
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        self.events += [json.loads(line) for line in lines if line.strip()]
        return True

    def wait_for(
        self, event: str, count: int = 1, timeout: float = WAIT_SECONDS, **fields: Any
    ) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout

        def found() -> list[dict[str, Any]]:
            return [
                e
                for e in self.events
                if e["event"] == event and all(e.get(k) == v for k, v in fields.items())
            ]

        while len(found()) < count:
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(min(left, 0.2)):
                raise AssertionError(
                    f"{count} x {event} {fields} not seen (rc={self.proc.poll()}): "
                    f"{self.events}\nstderr: {self.stderr_text()}"
                )
        return found()

    def ports(self, count: int) -> dict[tuple[int, str], int]:
        """Local ports by (remote, protocol) once `count` listeners are up."""
        listening = self.wait_for("listening", count)
        return {(e["remote"], e["protocol"]): int(e["local"].rsplit(":", 1)[1]) for e in listening}

    def stderr_text(self) -> str:
        if self.proc.poll() is None or self.proc.stderr is None:
            return "(running)"
        return self.proc.stderr.read().decode(errors="replace")

    def wait_exit(self, timeout: float = WAIT_SECONDS) -> int:
        rc = self.proc.wait(timeout)
        while self._read(0):
            pass
        return rc

    def interrupt(self, signum: int = signal.SIGINT) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signum)
        return self.wait_exit(STOP_SECONDS)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(STOP_SECONDS)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


@contextlib.contextmanager
def json_forward(argv: Sequence[str], env: dict[str, str] | None = None) -> Iterator[JsonForward]:
    forward = JsonForward(argv, env)
    try:
        yield forward
    finally:
        forward.close()
