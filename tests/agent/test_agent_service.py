"""The agent's ttrpc service in-process over unix sockets and loopback TCP: the dial order,
synchronous failures, the dial-back, and isolation of a bad connection."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from agent_support import (
    DialBacks,
    EchoServer,
    MiB,
    echo_transfer,
    health,
    listening_socket,
    port_forward,
    refused_message,
    refusing_port,
    short_dir,
    start_echo,
)
from click.testing import CliRunner

from podgate.agent.agent import SERVICE, Agent
from podgate.agent.agent_pb2 import PortForwardRequest
from podgate.aio.streams import SocketStream
from podgate.aio.ttrpc import TtrpcClient, TtrpcServer
from podgate.cli.main import main
from podgate.linux import vsock
from podgate.linux.vsock import AddressError, Listener, parse_address
from podgate.proto.ttrpc import Code, TtrpcError

VSOCK_PORT = 5000


@dataclass
class Rig:
    dir: str
    agent: Agent
    agent_path: str
    dial_backs: DialBacks
    echo: EchoServer

    async def client(self) -> TtrpcClient:
        return TtrpcClient(await vsock.connect(parse_address(f"unix://{self.agent_path}")))


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    with short_dir() as d:
        agent = Agent(parse_address(f"hvsock://{d}/v.sock"))
        server = TtrpcServer(name="agent")
        agent.register(server)
        listener = await vsock.listen(parse_address(f"unix://{d}/agent.sock"), server.serve)
        dial_backs = DialBacks()
        back: Listener = await vsock.listen(
            parse_address(f"hvsock://{d}/v.sock"), dial_backs.handler, VSOCK_PORT
        )
        echo = await start_echo(listening_socket(socket.AF_INET, "127.0.0.1"))
        try:
            yield Rig(d, agent, f"{d}/agent.sock", dial_backs, echo)
        finally:
            dial_backs.release()
            back.close()
            listener.close()
            await server.aclose()
            await agent.aclose()
            await echo.close()


async def test_health(rig: Rig) -> None:
    async with await rig.client() as client:
        assert await health(client) == "ok"


async def test_forward_round_trip(rig: Rig) -> None:
    async with await rig.client() as client:
        assert await port_forward(client, rig.echo.port, VSOCK_PORT) == b""
    # The forward outlives the ttrpc connection that asked for it.
    stream = await rig.dial_backs.next()
    assert rig.agent.active_forwards == 1
    result = await echo_transfer(stream, 4 * MiB)
    assert result.received == result.sent == 4 * MiB
    assert result.received_sha256 == result.sent_sha256
    await stream.aclose()
    await rig.echo.until(lambda: rig.echo.finished == 1)
    async with asyncio.timeout(5):
        await rig.agent.idle()


async def test_the_nonce_comes_first_on_the_dial_back(rig: Rig) -> None:
    nonce = os.urandom(16)
    request = PortForwardRequest(
        container_id="c1", port=rig.echo.port, vsock_port=VSOCK_PORT, nonce=nonce
    )
    async with await rig.client() as client:
        assert await client.call(SERVICE, "PortForward", request.SerializeToString()) == b""
    stream = await rig.dial_backs.next()
    got = b""
    async with asyncio.timeout(10):
        while len(got) < len(nonce):
            chunk = await stream.receive(len(nonce) - len(got))
            assert chunk
            got += chunk
    assert got == nonce
    # After it, the connection is the forward: bytes echo unchanged.
    result = await echo_transfer(stream, 1 * MiB)
    assert result.received_sha256 == result.sent_sha256
    await stream.aclose()


async def test_ipv6_only_target(rig: Rig) -> None:
    # ::1 listens, 127.0.0.1 on the same port is bound but refuses: the v4 dial fails first.
    v6 = listening_socket(socket.AF_INET6, "::1")
    port = v6.getsockname()[1]
    v4 = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    v4.bind(("127.0.0.1", port))
    echo6 = await start_echo(v6)
    try:
        async with await rig.client() as client:
            await port_forward(client, port, VSOCK_PORT)
        stream = await rig.dial_backs.next()
        result = await echo_transfer(stream, 1 * MiB)
        assert result.received_sha256 == result.sent_sha256
        await stream.aclose()
        assert echo6.accepted == 1
    finally:
        v4.close()
        await echo6.close()


async def test_refused_port_fails_synchronously_without_dial_back(rig: Rig) -> None:
    with refusing_port() as port:
        async with await rig.client() as client:
            with pytest.raises(TtrpcError) as info:
                await port_forward(client, port, VSOCK_PORT)
    assert info.value.code == Code.UNAVAILABLE
    assert info.value.message == refused_message(port)
    assert await rig.dial_backs.none_within(0.3)
    assert rig.agent.active_forwards == 0


async def test_failed_dial_back_closes_the_target(rig: Rig) -> None:
    async with await rig.client() as client:
        with pytest.raises(TtrpcError) as info:
            await port_forward(client, rig.echo.port, VSOCK_PORT + 1)
    assert info.value.code == Code.UNAVAILABLE
    assert info.value.message == (
        f"failed to connect back to the host at hvsock://{rig.dir}/v.sock port "
        f"{VSOCK_PORT + 1}: dial unix {rig.dir}/v.sock_{VSOCK_PORT + 1}: connect: "
        "no such file or directory"
    )
    # The target was dialed first, then let go.
    await rig.echo.until(lambda: rig.echo.accepted == 1 and rig.echo.finished == 1)
    assert rig.agent.active_forwards == 0


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (PortForwardRequest(port=0, vsock_port=VSOCK_PORT).SerializeToString(), "invalid port 0"),
        (
            PortForwardRequest(port=65536, vsock_port=VSOCK_PORT).SerializeToString(),
            "invalid port 65536",
        ),
        (
            PortForwardRequest(port=80, vsock_port=2**32 - 1).SerializeToString(),
            "invalid vsock_port 4294967295",
        ),
        (b"\xff\xff", None),
    ],
    ids=["port-0", "port-65536", "vsock-any", "garbage"],
)
async def test_invalid_requests(rig: Rig, payload: bytes, message: str | None) -> None:
    async with await rig.client() as client:
        with pytest.raises(TtrpcError) as info:
            await client.call(SERVICE, "PortForward", payload, timeout=5)
    assert info.value.code == Code.INVALID_ARGUMENT
    if message is not None:
        assert info.value.message == message
    assert await rig.dial_backs.none_within(0.1)


async def test_garbage_closes_only_that_connection(rig: Rig) -> None:
    async with await rig.client() as client:
        await port_forward(client, rig.echo.port, VSOCK_PORT)
        forwarded = await rig.dial_backs.next()
        raw = await SocketStream.connect_unix(rig.agent_path)
        # A frame header whose high length byte is set can never be valid ttrpc.
        await raw.send(b"\xff" * 64)
        async with asyncio.timeout(5):
            assert await raw.receive() == b""
        await raw.aclose()
        # The other ttrpc connection and the forward it set up are untouched.
        assert await health(client) == "ok"
        result = await echo_transfer(forwarded, 1 * MiB)
        assert result.received_sha256 == result.sent_sha256
        await forwarded.aclose()


@pytest.mark.parametrize("host", ["unix:///x/agent.sock", "hvsock:///x/v.sock:5", "vsock://2:5000"])
def test_host_address_must_leave_the_port_open(host: str) -> None:
    with pytest.raises(AddressError):
        Agent(parse_address(host))


@pytest.mark.parametrize(
    "args",
    [
        ["--listen", "hvsock:///x/v.sock:1024"],  # the agent listens in the guest, not via a muxer
        ["--listen", "vsock://-1"],  # no port to listen on
        ["--host", "vsock://2:5000"],  # the port comes with each request
        ["--host", "unix:///x/host.sock"],
        ["--host", "tcp://127.0.0.1:1"],
    ],
)
def test_serve_rejects_bad_addresses(args: list[str]) -> None:
    result = CliRunner().invoke(main, ["agent", "serve", *args])
    assert result.exit_code == 2, result.output
    assert "Invalid value" in result.output
