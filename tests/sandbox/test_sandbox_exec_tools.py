"""The exec backend's forwarders, each on its own, against a local echo server.

The "container" is this host: a fake runtime's exec runs the command with a PATH that holds only
the tool under test (and sh), so the probe has exactly one choice. Nothing here needs root.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import socket
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from podgate.aio.errors import ForwardError
from podgate.aio.streams import ByteStream
from podgate.backends.base import BackendUnavailableError
from podgate.backends.exec import ExecBackend
from podgate.forwarders import NO_TOOL
from podgate.model import (
    ContainerMetadata,
    ContainerRecord,
    ContainerSpec,
    ContainerState,
    PodMetadata,
    PodRecord,
    PodState,
    ProcessRef,
)

POD = PodRecord(
    id="p" * 64, metadata=PodMetadata("web", "default", "uid-1"), state=PodState.READY, created_at=0
)
MISSING_INTERPRETER = "/nonexistent/python"
# Each tool: the binaries its PATH holds (name -> where it really is) and the interpreter the
# backend tries first (the runtime's own, which has podgate).
TOOLS: dict[str, tuple[dict[str, str | None], str]] = {
    "podgate": ({}, sys.executable),
    "socat": ({"socat": shutil.which("socat")}, MISSING_INTERPRETER),
    "busybox": (
        {"busybox": shutil.which("busybox"), "grep": shutil.which("grep")},
        MISSING_INTERPRETER,
    ),
    "python3": ({"python3": "/usr/bin/python3"}, MISSING_INTERPRETER),
}
WAIT = 20.0


class HostRuntime:
    """Runs "container" commands on this host with a PATH of the test's choosing."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.commands: list[list[str]] = []

    def pod_containers(self, pod_id: str) -> list[ContainerRecord]:
        return [
            ContainerRecord(
                id="c" * 64,
                pod_id=pod_id,
                metadata=ContainerMetadata("main"),
                spec=ContainerSpec(),
                state=ContainerState.RUNNING,
                created_at=0,
                process=ProcessRef(os.getpid(), 0),
            )
        ]

    def exec_argv(self, container: ContainerRecord, command: Sequence[str]) -> list[str]:
        self.commands.append(list(command))
        return ["/usr/bin/env", "-i", f"PATH={self.path}", *command]


def tool_path(tmp_path: Path, binaries: dict[str, str | None]) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, target in {"sh": "/bin/sh", **binaries}.items():
        if target is None or not os.path.exists(target):
            pytest.skip(f"{name} is not installed")
        (bin_dir / name).symlink_to(target)
    return str(bin_dir)


@contextlib.asynccontextmanager
async def echo_server(host: str = "127.0.0.1") -> AsyncIterator[int]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 20):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, host, 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def echo_through(stream: ByteStream, total: int) -> tuple[str, str, int]:
    sent, received = hashlib.sha256(), hashlib.sha256()
    count = 0

    async def upload() -> None:
        for _ in range(total // 65536):
            chunk = os.urandom(65536)
            sent.update(chunk)
            await stream.send(chunk)
        await stream.send_eof()

    async def download() -> None:
        nonlocal count
        while chunk := await stream.receive():
            received.update(chunk)
            count += len(chunk)

    async with asyncio.timeout(WAIT), asyncio.TaskGroup() as group:
        group.create_task(upload())
        group.create_task(download())
    await stream.aclose()
    return sent.hexdigest(), received.hexdigest(), count


def backend_for(tmp_path: Path, tool: str) -> tuple[ExecBackend, HostRuntime]:
    binaries, interpreter = TOOLS[tool]
    runtime = HostRuntime(tool_path(tmp_path, binaries))
    return ExecBackend(runtime, interpreter=interpreter), runtime


@pytest.mark.parametrize("tool", list(TOOLS))
async def test_each_tool_echoes_8_mib_sha256_exact(tmp_path: Path, tool: str) -> None:
    backend, runtime = backend_for(tmp_path, tool)
    async with echo_server() as port:
        stream = await backend.open(POD, port)
        sent, received, count = await echo_through(stream, 8 * 1024 * 1024)
    assert count == 8 * 1024 * 1024
    assert received == sent
    # The probe ran first, then the tool it found.
    forwarder = runtime.commands[-1]
    expected_head = {
        "podgate": [sys.executable, "-m", "podgate", "agent", "forward"],
        "socat": ["socat"],
        "busybox": ["busybox", "nc"],
        "python3": ["python3", "-c"],
    }[tool]
    assert forwarder[: len(expected_head)] == expected_head
    assert runtime.commands[0][:2] == ["sh", "-c"]


@pytest.mark.parametrize("tool", ["podgate", "socat", "python3"])
async def test_refused_port_is_a_forward_error_with_the_tools_words(
    tmp_path: Path, tool: str
) -> None:
    backend, _ = backend_for(tmp_path, tool)
    port = closed_port()
    stream = await backend.open(POD, port)
    with pytest.raises(ForwardError) as failed:
        async with asyncio.timeout(WAIT):
            await stream.receive()
    await stream.aclose()
    message = str(failed.value)
    prefix = f"error forwarding port {port} to pod {POD.id}, uid uid-1: {tool} in container main: "
    assert message.startswith(prefix), message
    assert "refused" in message.lower(), message


async def test_python_forwarder_falls_back_to_ipv6(tmp_path: Path) -> None:
    backend, _ = backend_for(tmp_path, "python3")
    async with echo_server("::1") as port:
        stream = await backend.open(POD, port)
        sent, received, count = await echo_through(stream, 1024 * 1024)
    assert (count, received) == (1024 * 1024, sent)


async def test_half_close_keeps_the_answer_coming(tmp_path: Path) -> None:
    # The server answers only after our EOF: the forwarder must pass the EOF on and keep
    # reading (socat's 0.5 s default -t would cut a slow answer).
    async def late_reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = await reader.read()
        await asyncio.sleep(1.0)
        writer.write(b"got " + str(len(data)).encode())
        writer.close()

    backend, _ = backend_for(tmp_path, "socat")
    server = await asyncio.start_server(late_reply, "127.0.0.1", 0)
    try:
        stream = await backend.open(POD, server.sockets[0].getsockname()[1])
        await stream.send(b"x" * 1000)
        await stream.send_eof()
        async with asyncio.timeout(WAIT):
            reply = b""
            while chunk := await stream.receive():
                reply += chunk
        await stream.aclose()
    finally:
        server.close()
        await server.wait_closed()
    assert reply == b"got 1000"


async def test_no_tool_is_unavailable_with_the_install_hint(tmp_path: Path) -> None:
    runtime = HostRuntime(tool_path(tmp_path, {}))
    backend = ExecBackend(runtime, interpreter=MISSING_INTERPRETER)
    with pytest.raises(BackendUnavailableError) as failed:
        await backend.open(POD, 80)
    assert str(failed.value) == (
        "no port-forward tool in the container: install socat, busybox or python3"
    )
    assert str(failed.value) == NO_TOOL
    # The answer is remembered: no second probe.
    with pytest.raises(BackendUnavailableError):
        await backend.open(POD, 80)
    assert len(runtime.commands) == 1


async def test_no_running_container_is_unavailable() -> None:
    class Empty(HostRuntime):
        def pod_containers(self, pod_id: str) -> list[ContainerRecord]:
            return []

    with pytest.raises(BackendUnavailableError) as failed:
        await ExecBackend(Empty("/nonexistent")).open(POD, 80)
    assert "no running container" in str(failed.value)
