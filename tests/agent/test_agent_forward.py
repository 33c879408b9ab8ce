"""`podgate agent forward PORT`: one connection between stdio and localhost:PORT, as the
exec-forwarder backend runs it."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from agent_support import (
    CHUNK,
    MiB,
    listening_socket,
    refused_message,
    refusing_port,
    start_echo,
)

from podgate.agent.forward import copy_fd

FORWARD = [sys.executable, "-m", "podgate", "agent", "forward"]


async def _run_through(port: int, payload: bytes) -> tuple[int, bytes, bytes]:
    proc = await asyncio.create_subprocess_exec(
        *FORWARD,
        str(port),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        # The echo server runs on this loop too: a forwarder that blocks our pipe I/O in the
        # kernel would hang here, not just run slowly.
        async with asyncio.timeout(30):
            stdout, stderr = await proc.communicate(payload)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, stdout, stderr


@pytest.mark.parametrize(
    ("family", "host"), [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")]
)
async def test_eight_mib_through_an_echo(family: int, host: str) -> None:
    sock = listening_socket(family, host)
    port = sock.getsockname()[1]
    blocker = None
    if family == socket.AF_INET6:
        # 127.0.0.1 refuses on that port, so the IPv6 fallback is what carries the bytes.
        blocker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        blocker.bind(("127.0.0.1", port))
    echo = await start_echo(sock)
    try:
        payload = os.urandom(8 * MiB)
        code, out, err = await _run_through(port, payload)
        assert code == 0, err
        assert len(out) == len(payload)
        assert hashlib.sha256(out).hexdigest() == hashlib.sha256(payload).hexdigest()
        assert echo.accepted == 1
    finally:
        await echo.close()
        if blocker is not None:
            blocker.close()


@pytest.fixture
async def digest_server() -> AsyncIterator[int]:
    """Reads until EOF, then answers with the sha256 of what it read: the reply only comes
    after our half-close."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        digest = hashlib.sha256()
        while data := await reader.read(CHUNK):
            digest.update(data)
        writer.write(digest.hexdigest().encode())
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    server = await asyncio.start_server(handle, sock=listening_socket(socket.AF_INET, "127.0.0.1"))
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


async def test_stdin_eof_half_closes(digest_server: int) -> None:
    payload = os.urandom(3 * MiB + 17)
    code, out, err = await _run_through(digest_server, payload)
    assert code == 0, err
    assert out == hashlib.sha256(payload).hexdigest().encode()


async def test_refused_port_exits_1_with_the_message() -> None:
    with refusing_port() as port:
        code, out, err = await _run_through(port, b"ignored")
    assert code == 1
    assert out == b""
    assert err.decode() == f"podgate agent forward: {refused_message(port)}\n"


@pytest.mark.parametrize("port", ["0", "65536", "http"])
async def test_bad_port_is_a_usage_error(port: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        *FORWARD, port, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate()
    assert proc.returncode == 2  # click's usage error
    assert b"PORT" in err


def test_copy_fd_moves_everything(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    data = os.urandom(CHUNK * 3 + 5)
    src.write_bytes(data)
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        assert copy_fd(fin.fileno(), fout.fileno()) == len(data)
    assert dst.read_bytes() == data
