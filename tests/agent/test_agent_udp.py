"""The agent's UDP port-forward in-process: the request's protocol field, the reply that
confirms it, framed datagrams on the dial-back connection, and the host's EOF closing the
flow."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from agent_support import DialBacks, short_dir

from podgate.agent.agent import SERVICE, Agent
from podgate.agent.agent_pb2 import PortForwardRequest, PortForwardResponse
from podgate.aio.ttrpc import TtrpcClient, TtrpcServer
from podgate.linux import vsock
from podgate.linux.vsock import Listener, parse_address
from podgate.proto.datagram import DatagramDecoder, encode_datagram
from podgate.proto.ttrpc import Code, TtrpcError
from udp_support import UdpEcho, exchange_framed

VSOCK_PORT = 5001


@dataclass
class Rig:
    agent: Agent
    agent_path: str
    dial_backs: DialBacks
    echo: UdpEcho

    async def forward(self, port: int, protocol: str) -> bytes:
        stream = await vsock.connect(parse_address(f"unix://{self.agent_path}"))
        async with TtrpcClient(stream) as client:
            request = PortForwardRequest(
                container_id="c1", port=port, vsock_port=VSOCK_PORT, protocol=protocol
            )
            return await client.call(
                SERVICE, "PortForward", request.SerializeToString(), timeout=10
            )


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
        echo = UdpEcho()
        try:
            yield Rig(agent, f"{d}/agent.sock", dial_backs, echo)
        finally:
            dial_backs.release()
            back.close()
            listener.close()
            await server.aclose()
            await agent.aclose()
            echo.close()


async def test_udp_forward_relays_framed_datagrams_and_says_udp(rig: Rig) -> None:
    reply = await rig.forward(rig.echo.port, "udp")
    # PortForwardResponse{protocol: "udp"}: field 1, LEN 3, "udp".
    assert reply == bytes.fromhex("0a 03 75 64 70")
    assert PortForwardResponse.FromString(reply).protocol == "udp"
    stream = await rig.dial_backs.next()
    tally = await exchange_framed(stream, 2000)
    assert (tally.matched, tally.unmatched) == (2000, [])
    # The empty datagram is a datagram too.
    await stream.send(encode_datagram(b""))
    assert DatagramDecoder().feed(await stream.receive()) == [b""]
    assert rig.echo.received == 2001
    # The host's EOF ends the flow: the agent closes the UDP socket and answers with EOF.
    await stream.send_eof()
    async with asyncio.timeout(5):
        assert await stream.receive() == b""
        await rig.agent.idle()
    await stream.aclose()


async def test_udp_to_a_port_nobody_serves_still_dials_back(rig: Rig) -> None:
    # No handshake to refuse: the flow opens, and datagrams into nothing are only lost.
    port = rig.echo.port
    rig.echo.close()
    await rig.forward(port, "udp")
    stream = await rig.dial_backs.next()
    await stream.send(encode_datagram(b"anyone?") + encode_datagram(b"hello?"))
    await stream.send_eof()
    async with asyncio.timeout(5):
        assert await stream.receive() == b""
        await rig.agent.idle()
    await stream.aclose()


@pytest.mark.parametrize("protocol", ["sctp", "UDP", "tcp6"])
async def test_unknown_protocol_is_invalid_argument(rig: Rig, protocol: str) -> None:
    with pytest.raises(TtrpcError) as info:
        await rig.forward(rig.echo.port, protocol)
    assert info.value.code == Code.INVALID_ARGUMENT
    assert info.value.message == f"invalid protocol {protocol!r}"
    assert await rig.dial_backs.none_within(0.2)
