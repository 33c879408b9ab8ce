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
    try:
        async with asyncio.TaskGroup() as helpers:
            pumps = []
            if io.stdin is not None:
                pumps.append(helpers.create_task(_pump_stdin(conn, io), name="attach stdin"))
            if io.resizes is not None:
                pumps.append(helpers.create_task(_pump_resizes(conn, io), name="attach resize"))
            try:
                await _pump_output(conn, io)
            finally:
                for pump in pumps:  # the output side decides when the session ends
                    pump.cancel()
    finally:
        await conn.aclose()
    return conn.exit_code if conn.exit_code is not None else 0


async def _pump_output(conn: AttachConnection, io: ExecIO) -> None:
    """Until the container exits or the client goes away (a detach)."""
    while (event := await conn.receive()) is not None:
        target = io.stdout if isinstance(event, Stdout) or io.tty else io.stderr
        if target is None:
            continue
        try:
            await target.send(event.data)
        except StreamError:
            return
