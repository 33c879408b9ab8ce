"""CRI attach: the client's stdio bridged to a running container through its shim's attach
socket."""

from __future__ import annotations

import asyncio
import contextlib

from podgate.aio.errors import StreamError
from podgate.linux.shim import AttachConnection, attach
from podgate.proto.attach import Stdout
from podgate.streaming.target import ExecIO


async def _pump_stdin(conn: AttachConnection, io: ExecIO) -> None:
    assert io.stdin is not None
    try:
        try:
            while chunk := await io.stdin.receive():
                await conn.send(chunk)
        except StreamError:
            pass  # the client's input broke: handled as its end, as containerd does
        await conn.close_stdin()
    except OSError:
        pass  # the shim went away; the output side sees it


async def _pump_resizes(conn: AttachConnection, io: ExecIO) -> None:
    assert io.resizes is not None
    with contextlib.suppress(OSError):
        async for size in io.resizes:
            await conn.resize(size.width, size.height)


async def run_attach(socket_path: str, io: ExecIO) -> int:
    """Bridge `io` to a running container (CRI attach).

    Returns the container's exit code once it exits, or 0 when the client detached: its
    stdin ended without stdinOnce (the shim ends that session), or its output side closed.
    """
    conn = await attach(socket_path)
    tasks: list[asyncio.Task[None]] = []
    try:
        if io.stdin is not None:
            tasks.append(asyncio.create_task(_pump_stdin(conn, io), name="attach stdin"))
        if io.resizes is not None:
            tasks.append(asyncio.create_task(_pump_resizes(conn, io), name="attach resize"))
        while (event := await conn.receive()) is not None:
            target = io.stdout if isinstance(event, Stdout) or io.tty else io.stderr
            if target is None:
                continue
            try:
                await target.send(event.data)
            except StreamError:
                return 0  # the client went away: detach
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await conn.aclose()
    return conn.exit_code if conn.exit_code is not None else 0
