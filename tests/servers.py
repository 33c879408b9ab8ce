"""Real servers on loopback for protocol tests: the demo API with a LocalTarget, plus echo
and sink/source TCP servers as port-forward targets. They run on their own event loop in a
thread, so tests can drive real external clients (kubectl, the Python client) synchronously.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from podgate.aio.streams import SocketStream, start_server
from podgate.demo.api import DemoApi, DemoPod
from podgate.streaming.local import LocalTarget

# Remote ports the demo pod "exposes"; the LocalTarget maps them to the real loopback ports.
ECHO_PORT = 7000  # echoes everything, then EOF after the client's EOF
SINK_PORT = 7001  # reads to EOF, answers with the sha256 hex digest of what it read
REFUSED_PORT = 7002  # mapped to a port nobody listens on


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


@dataclass
class RunningServers:
    api_port: int
    echo_port: int
    sink_port: int
    loop: asyncio.AbstractEventLoop
    target: LocalTarget
    kubeconfig: str = ""
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def demo_servers(tmpdir: str | None = None) -> Iterator[RunningServers]:
    """Start the demo API (pod default/demo) and its target servers; stop them afterwards."""
    loop = asyncio.new_event_loop()
    ready: dict[str, object] = {}
    started = threading.Event()
    stop: asyncio.Event | None = None

    async def main() -> None:
        nonlocal stop
        stop = asyncio.Event()
        echo = await start_server(_echo, "127.0.0.1", 0)
        sink = await start_server(_sink, "127.0.0.1", 0)
        echo_port = echo.sockets[0].getsockname()[1]
        sink_port = sink.sockets[0].getsockname()[1]
        target = LocalTarget(
            port_map={ECHO_PORT: echo_port, SINK_PORT: sink_port, REFUSED_PORT: _free_port()}
        )
        api = DemoApi(
            target,
            [
                DemoPod("default", "demo", ports=(ECHO_PORT, SINK_PORT)),
                DemoPod("default", "pending", phase="Pending"),
            ],
        )
        server = await api.serve("127.0.0.1", 0)
        ready.update(
            api_port=server.sockets[0].getsockname()[1],
            echo_port=echo_port,
            sink_port=sink_port,
            target=target,
        )
        started.set()
        await stop.wait()
        for s in (server, echo, sink):
            s.close()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    if not started.wait(10):
        raise RuntimeError("demo servers did not start")
    servers = RunningServers(
        api_port=int(ready["api_port"]),  # type: ignore[call-overload]
        echo_port=int(ready["echo_port"]),  # type: ignore[call-overload]
        sink_port=int(ready["sink_port"]),  # type: ignore[call-overload]
        loop=loop,
        target=ready["target"],  # type: ignore[arg-type]
    )
    if tmpdir is not None:
        servers.kubeconfig = os.path.join(tmpdir, "kubeconfig")
        from podgate.cli.demo import write_kubeconfig

        write_kubeconfig(servers.kubeconfig, "127.0.0.1", servers.api_port)
    try:
        yield servers
    finally:
        assert stop is not None
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()
