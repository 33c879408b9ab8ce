"""AF_VSOCK transport: listening, loopback connections where the kernel has them, and handing
non-INET/UNIX sockets to uvloop.

Nothing here connects to CID 2: from inside a VM that would reach the real host.
"""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
import uvloop

from podgate.aio.streams import SocketStream
from podgate.linux import vsock
from podgate.linux.vsock import (
    VMADDR_CID_ANY,
    VMADDR_PORT_ANY,
    Scheme,
    listen,
    parse_address,
    vsock_available,
)

_WHY_NOT = vsock_available()
needs_vsock = pytest.mark.skipif(_WHY_NOT is not None, reason=f"no AF_VSOCK: {_WHY_NOT}")
# Without a local transport a CID 1 connect would leave the guest through virtio.
needs_loopback = pytest.mark.skipif(
    _WHY_NOT is not None or not os.path.exists("/sys/module/vsock_loopback"),
    reason="the kernel has no vsock loopback transport (CONFIG_VSOCKETS_LOOPBACK)",
)
VMADDR_CID_LOCAL = 1


def test_availability_matches_the_kernel() -> None:
    family = getattr(socket, "AF_VSOCK", None)
    if family is None:
        assert _WHY_NOT is not None
        return
    try:
        socket.socket(family, socket.SOCK_STREAM).close()
    except OSError:
        assert _WHY_NOT is not None
    else:
        assert _WHY_NOT is None


async def _idle(stream: SocketStream) -> None:
    await stream.receive()


async def _listen_on_a_kernel_chosen_port() -> None:
    listener = await listen(parse_address("vsock://-1:-1"), _idle)
    async with listener:
        bound = listener.address
        assert bound.scheme is Scheme.VSOCK
        assert bound.cid == VMADDR_CID_ANY
        assert bound.port is not None and bound.port != VMADDR_PORT_ANY
        # The port is really taken: binding it again fails.
        probe = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
        with probe, pytest.raises(OSError):
            probe.bind((VMADDR_CID_ANY, bound.port))


@needs_vsock
def test_listen_on_a_kernel_chosen_port_asyncio() -> None:
    asyncio.run(_listen_on_a_kernel_chosen_port())


@needs_vsock
def test_listen_on_a_kernel_chosen_port_uvloop() -> None:
    uvloop.run(_listen_on_a_kernel_chosen_port())


@needs_vsock
async def test_listen_with_the_port_given_separately() -> None:
    listener = await listen(parse_address("vsock://-1"), _idle, VMADDR_PORT_ANY)
    async with listener:
        assert listener.address.port not in (None, VMADDR_PORT_ANY)


async def _echo(stream: SocketStream) -> None:
    while data := await stream.receive():
        await stream.send(data)
    await stream.send_eof()


async def _loopback_round_trip() -> None:
    listener = await listen(parse_address("vsock://-1:-1"), _echo)
    async with listener:
        port = listener.address.port
        stream = await vsock.connect(parse_address(f"vsock://{VMADDR_CID_LOCAL}:{port}"))
        payload = os.urandom(1 << 20)
        await stream.send(payload)
        await stream.send_eof()
        got = bytearray()
        while data := await stream.receive():
            got += data
        await stream.aclose()
        assert bytes(got) == payload


@needs_loopback
async def test_loopback_round_trip_asyncio() -> None:
    await _loopback_round_trip()


@needs_loopback
def test_loopback_round_trip_uvloop() -> None:
    uvloop.run(_loopback_round_trip())


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
    return client, peer


async def _stand_in_works() -> None:
    client, peer = _tcp_pair()
    with peer:
        stand_in = vsock._stand_in(client)
        assert stand_in.family == socket.AF_UNIX
        stream = await SocketStream.from_socket(stand_in)
        await stream.send(b"ping")
        assert await asyncio.to_thread(peer.recv, 16) == b"ping"
        await asyncio.to_thread(peer.sendall, b"pong")
        assert await stream.receive() == b"pong"
        await stream.send_eof()  # shutdown(SHUT_WR) on the real socket
        assert await asyncio.to_thread(peer.recv, 16) == b""
        peer.close()
        assert await stream.receive() == b""
        await stream.aclose()


def test_uvloop_drives_a_socket_labelled_unix() -> None:
    # uvloop refuses AF_VSOCK sockets by family; the same fd labelled AF_UNIX is a plain
    # stream fd to libuv. Shown with a TCP fd, since vsock loopback may be missing.
    uvloop.run(_stand_in_works())


def test_adopt_leaves_known_families_alone() -> None:
    async def check() -> None:
        client, peer = _tcp_pair()
        with peer:
            stream = await vsock.adopt_socket(client)
            assert stream.transport.get_extra_info("socket").family == socket.AF_INET
            await stream.aclose()

    asyncio.run(check())
    uvloop.run(check())
