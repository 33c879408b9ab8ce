"""A connection that goes away is an error on every stream it carried, never a clean end.

Streams the peer had finished still end with EOF; data received before the loss still
arrives first. (An upstream runtime that restarts must not look like a pod closing.)
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from podgate.aio.errors import BrokenStreamError
from podgate.aio.streams import SocketStream
from podgate.aio.wschannel import ChannelSession
from podgate.proto.wschannel import ChannelConnection, Role

PROMPT_SECONDS = 20.0
V5 = "v5.channel.k8s.io"


async def test_websocket_lost_without_close_frame_is_an_error_on_each_channel() -> None:
    a, b = socket.socketpair()
    client = ChannelSession(
        await SocketStream.from_socket(a), ChannelConnection(Role.CLIENT, V5), name="client"
    )
    server_wire = await SocketStream.from_socket(b)
    server = ChannelSession(server_wire, ChannelConnection(Role.SERVER, V5), name="server")
    stdout, stderr = client.stream(1), client.stream(2)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(client.run())
        tg.create_task(server.run())
        await server.stream(1).send(b"partial output")
        async with asyncio.timeout(PROMPT_SECONDS):
            assert await stdout.receive() == b"partial output"
        server_wire.abort()  # the server process died: no close frame
        async with asyncio.timeout(PROMPT_SECONDS):
            with pytest.raises(BrokenStreamError):
                await stdout.receive()
            with pytest.raises(BrokenStreamError):
                await stderr.receive()
        await client.aclose()
        await server.aclose()


async def test_websocket_closed_with_close_frame_is_a_clean_end() -> None:
    a, b = socket.socketpair()
    client = ChannelSession(
        await SocketStream.from_socket(a), ChannelConnection(Role.CLIENT, V5), name="client"
    )
    server = ChannelSession(
        await SocketStream.from_socket(b), ChannelConnection(Role.SERVER, V5), name="server"
    )
    stdout = client.stream(1)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(client.run())
        tg.create_task(server.run())
        await server.stream(1).send(b"all output")
        await server.aclose()
        async with asyncio.timeout(PROMPT_SECONDS):
            assert await stdout.receive() == b"all output"
            assert await stdout.receive() == b""
        await client.aclose()
