"""UDP port-forward, podgate client <-> podgate server (the demo API over a LocalTarget) over
real sockets, with a UDP echo on loopback behind the pod port.

Negotiation: kubectl's offer gets plain port-forward and a `protocol: udp` header changes
nothing; podgate's offer gets the extension (SPDY and the WebSocket tunnel). Flows: 10,000
datagrams with unique sequence numbers through one stream and through the relay (two local
peers, each seeing only its own replies), idle expiry closing the pod's socket, failures
reported per flow, and ICMP port-unreachable dropping datagrams without ending the flow.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import pytest
from streaming_support import HANDLER_SETTLE_SECONDS

from podgate.aio.datagram import DatagramStream
from podgate.aio.errors import StreamError
from podgate.aio.streams import DEFAULT_RECEIVE_BYTES, Buffer, ByteStream, SocketStream
from podgate.aio.streams import start_server as start_tcp_server
from podgate.demo.api import DemoApi, DemoPod
from podgate.forward.udp import FlowEvent, FlowEventKind, UdpRelay
from podgate.proto import portforward as pf
from podgate.proto.datagram import DatagramDecoder, encode_datagram
from podgate.streaming.client import (
    Endpoint,
    ForwardedStream,
    PortForwardSession,
    UdpNotSupportedError,
    pod_path,
)
from podgate.streaming.local import LocalTarget
from podgate.streaming.target import ExecIO, PodRef, TargetError
from udp_support import DATAGRAMS, LocalPeer, UdpEcho, exchange_framed, wait_until

UDP_ECHO_PORT = 5353  # pod port -> the loopback UDP echo
UDP_SILENT_PORT = 5354  # pod port -> a UDP port nobody listens on (ICMP port unreachable)
UDP_BROKEN_PORT = 5355  # the target refuses to open it
TCP_ECHO_PORT = 7000
NAMESPACE, POD = "default", "udp"
UID = f"demo-{NAMESPACE}-{POD}"
STEP_SECONDS = 10.0
TRANSPORTS = [False, True]
TRANSPORT_IDS = ["spdy", "websocket-tunnel"]


class Tracked(ByteStream):
    """A target stream that reports when it is closed."""

    def __init__(self, inner: ByteStream, target: CountingTarget) -> None:
        self.inner = inner
        self.target = target
        self.closed = False

    async def receive(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        return await self.inner.receive(max_bytes)

    async def send(self, data: Buffer) -> None:
        await self.inner.send(data)

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self.target.udp_open -= 1
            self.target.changed.set()
        await self.inner.aclose()


@dataclass
class CountingTarget:
    """The LocalTarget, counting the UDP sockets it has open in the "pod"."""

    inner: LocalTarget
    udp_open: int = 0
    udp_opened: int = 0
    streams: list[DatagramStream] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def open_port(self, pod: PodRef, port: int, *, protocol: str = "tcp") -> ByteStream:
        if protocol == "udp" and port == UDP_BROKEN_PORT:
            raise TargetError("no udp here")
        stream = await self.inner.open_port(pod, port, protocol=protocol)
        if protocol != "udp":
            return stream
        assert isinstance(stream, DatagramStream)
        self.streams.append(stream)
        self.udp_open += 1
        self.udp_opened += 1
        return Tracked(stream, self)

    async def exec(
        self, pod: PodRef, container: str | None, command: Sequence[str], io: ExecIO
    ) -> int:
        raise TargetError("no exec here")

    async def attach(self, pod: PodRef, container: str | None, io: ExecIO) -> int:
        raise TargetError("no attach here")

    async def wait_udp_open(self, count: int, timeout: float = STEP_SECONDS) -> None:
        async with asyncio.timeout(timeout):
            while self.udp_open != count:
                self.changed.clear()
                await self.changed.wait()


@dataclass
class Server:
    endpoint: Endpoint
    target: CountingTarget
    echo: UdpEcho
    path: str = pod_path(NAMESPACE, POD, "portforward")

    async def connect(self, *, websocket: bool = False, udp: bool = True) -> PortForwardSession:
        return await asyncio.wait_for(
            PortForwardSession.connect(self.endpoint, self.path, websocket=websocket, udp=udp),
            STEP_SECONDS,
        )


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def tcp_echo(stream: SocketStream) -> None:
    while chunk := await stream.receive():
        await stream.send(chunk)
    await stream.send_eof()


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    echo = UdpEcho()
    tcp = await start_tcp_server(tcp_echo, "127.0.0.1", 0)
    target = CountingTarget(
        LocalTarget(
            port_map={TCP_ECHO_PORT: tcp.sockets[0].getsockname()[1]},
            udp_port_map={
                UDP_ECHO_PORT: echo.port,
                UDP_SILENT_PORT: free_udp_port(),
            },
        )
    )
    demo = DemoApi(target, [DemoPod(NAMESPACE, POD, ports=(UDP_ECHO_PORT,))])
    handlers: set[asyncio.Task[None]] = set()
    errors: list[BaseException] = []

    async def handle(conn: SocketStream) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            await demo.handle(conn)
        except Exception as exc:
            errors.append(exc)
            raise

    api = await start_tcp_server(handle, "127.0.0.1", 0)
    try:
        yield Server(Endpoint("127.0.0.1", api.sockets[0].getsockname()[1]), target, echo)
    finally:
        api.close()
        tcp.close()
        pending = {t for t in handlers if not t.done()}
        if pending:
            _, pending = await asyncio.wait(pending, timeout=HANDLER_SETTLE_SECONDS)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        echo.close()
        assert not errors, f"server handlers raised: {errors!r}"
        assert not pending, "server handlers still running after their clients left"
    # Every UDP socket opened in the "pod" was closed with its stream.
    assert target.udp_open == 0


@contextlib.asynccontextmanager
async def relay_on(
    session: PortForwardSession, port: int, *, idle_timeout: float = 60.0, max_peers: int = 1024
) -> AsyncIterator[tuple[UdpRelay, list[FlowEvent]]]:
    events: list[FlowEvent] = []

    async def open_stream() -> ForwardedStream:
        return await session.open(port, "udp")

    relay = UdpRelay(
        open_stream,
        ("127.0.0.1", 0),
        idle_timeout=idle_timeout,
        max_peers=max_peers,
        on_event=events.append,
    )
    async with relay:
        yield relay, events


def failures_reach(relay: UdpRelay, count: int) -> bool:
    return relay.stats.errors >= count


# --------------------------------------------------------------------------- negotiation


async def test_kubectl_offer_gets_plain_portforward_and_the_protocol_header_is_ignored(
    server: Server,
) -> None:
    session = await server.connect(udp=False)
    try:
        assert session.protocol == "portforward.k8s.io"
        assert not session.supports_udp
        # Headers as a client that sends `protocol: udp` anyway: the pair is TCP (upstream
        # servers ignore unknown headers, and so does podgate's without the extension).
        spdy = session.session
        error = await spdy.open_stream(pf.stream_headers("error", TCP_ECHO_PORT, "x", "udp"))
        await error.send_eof()
        data = await spdy.open_stream(pf.stream_headers("data", TCP_ECHO_PORT, "x", "udp"))
        async with asyncio.timeout(STEP_SECONDS):
            await data.send(b"plain tcp bytes, not a frame")
            await data.send_eof()
            echoed = b""
            while chunk := await data.receive():
                echoed += chunk
        assert echoed == b"plain tcp bytes, not a frame"
        assert server.target.udp_opened == 0
        with pytest.raises(UdpNotSupportedError) as info:
            await session.open(UDP_ECHO_PORT, "udp")
        assert str(info.value) == (
            "the server does not support UDP port-forward: it did not accept "
            "udp.portforward.podgate.io (negotiated portforward.k8s.io)"
        )
    finally:
        await session.aclose()


@pytest.mark.parametrize("websocket", TRANSPORTS, ids=TRANSPORT_IDS)
async def test_podgate_offer_gets_the_extension(server: Server, websocket: bool) -> None:
    session = await server.connect(websocket=websocket)
    try:
        assert session.protocol == "udp.portforward.podgate.io"
        assert session.supports_udp
        # TCP pairs work as before on the same session.
        forwarded = await session.open(TCP_ECHO_PORT)
        await forwarded.data.send(b"tcp still")
        await forwarded.data.send_eof()
        async with asyncio.timeout(STEP_SECONDS):
            assert await forwarded.data.receive() == b"tcp still"
            assert await forwarded.error() == ""
    finally:
        await session.aclose()


async def test_unknown_protocol_header_fails_that_pair_on_its_error_stream(
    server: Server,
) -> None:
    session = await server.connect()
    try:
        spdy = session.session
        headers = {"port": str(UDP_ECHO_PORT), "requestid": "q", "protocol": "sctp"}
        error = await spdy.open_stream({**headers, "streamtype": "error"})
        await error.send_eof()
        data = await spdy.open_stream({**headers, "streamtype": "data"})
        async with asyncio.timeout(STEP_SECONDS):
            text = b""
            with contextlib.suppress(StreamError):
                while chunk := await error.receive():
                    text += chunk
            with pytest.raises(StreamError):
                while await data.receive():
                    pass
        assert text.decode() == (
            f"error forwarding port {UDP_ECHO_PORT} to pod {POD}, uid {UID}: "
            'unsupported port-forward protocol "sctp": expected "tcp" or "udp"'
        )
        # The session goes on.
        forwarded = await session.open(UDP_ECHO_PORT, "udp")
        tally = await exchange_framed(forwarded.data, 10)
        assert tally.matched == 10
    finally:
        await session.aclose()


# --------------------------------------------------------------------------- one flow


@pytest.mark.parametrize("websocket", TRANSPORTS, ids=TRANSPORT_IDS)
async def test_10000_datagrams_through_one_flow_all_matched(
    server: Server, websocket: bool
) -> None:
    session = await server.connect(websocket=websocket)
    try:
        forwarded = await session.open(UDP_ECHO_PORT, "udp")
        assert forwarded.protocol == "udp"
        tally = await exchange_framed(forwarded.data, DATAGRAMS)
        assert (tally.sent, tally.matched, tally.unmatched) == (DATAGRAMS, DATAGRAMS, [])
        assert server.echo.received == DATAGRAMS
        # The client's FIN ends the flow: the pod's socket closes, the error stream is empty.
        await forwarded.data.send_eof()
        async with asyncio.timeout(STEP_SECONDS):
            assert await forwarded.data.receive() == b""
            assert await forwarded.error() == ""
        await server.target.wait_udp_open(0)
        (stream,) = server.target.streams
        assert (stream.datagrams_sent, stream.datagrams_received) == (DATAGRAMS, DATAGRAMS)
    finally:
        await session.aclose()


async def test_frames_split_anywhere_arrive_whole(server: Server) -> None:
    session = await server.connect()
    try:
        forwarded = await session.open(UDP_ECHO_PORT, "udp")
        items = [b"", b"a", b"bc" * 700, b"\x00\xff" * 30000]
        wire = b"".join(encode_datagram(i) for i in items)
        for start in range(0, len(wire), 7):  # 7-byte pieces: every frame is cut somewhere
            await forwarded.data.send(wire[start : start + 7])
        decoder = DatagramDecoder()
        replies: list[bytes] = []
        async with asyncio.timeout(STEP_SECONDS):
            while len(replies) < len(items):
                replies += decoder.feed(await forwarded.data.receive())
        assert sorted(replies) == sorted(items)
        await forwarded.data.send_eof()
        async with asyncio.timeout(STEP_SECONDS):
            assert await forwarded.data.receive() == b""
            assert await forwarded.error() == ""
    finally:
        await session.aclose()


async def test_port_unreachable_drops_datagrams_but_not_the_flow(server: Server) -> None:
    session = await server.connect()
    try:
        forwarded = await session.open(UDP_SILENT_PORT, "udp")
        async with asyncio.timeout(STEP_SECONDS):
            for i in range(3):
                await forwarded.data.send(encode_datagram(b"anyone? %d" % i))
                await asyncio.sleep(0.05)
            await wait_until(
                lambda: bool(server.target.streams) and server.target.streams[0].dropped > 0,
                "a datagram dropped for ICMP port unreachable",
            )
            # Still a flow: a clean end, no error text.
            await forwarded.data.send_eof()
            assert await forwarded.data.receive() == b""
            assert await forwarded.error() == ""
        (stream,) = server.target.streams
        assert stream.datagrams_sent + stream.dropped >= 3
        assert stream.datagrams_received == 0
    finally:
        await session.aclose()


# --------------------------------------------------------------------------- the relay


@pytest.mark.parametrize("websocket", TRANSPORTS, ids=TRANSPORT_IDS)
async def test_relay_two_peers_each_get_their_own_replies(server: Server, websocket: bool) -> None:
    session = await server.connect(websocket=websocket)
    try:
        async with relay_on(session, UDP_ECHO_PORT) as (relay, events):
            a = await LocalPeer.open(relay.address)
            b = await LocalPeer.open(relay.address)
            try:
                half = DATAGRAMS // 2
                tallies = await asyncio.gather(
                    a.exchange(half, window=32, tag=b"A", seed=1),
                    b.exchange(half, window=32, tag=b"B", seed=2),
                )
            finally:
                a.close()
                b.close()
            # A reply for the other peer would be unmatched (its tag differs).
            for tally in tallies:
                assert (tally.sent, tally.matched, tally.unmatched) == (half, half, [])
            assert sum(t.matched for t in tallies) == DATAGRAMS
            stats = relay.stats
            assert (stats.datagrams_to_pod, stats.datagrams_from_pod) == (DATAGRAMS, DATAGRAMS)
            assert stats.bytes_to_pod == stats.bytes_from_pod
            assert (stats.flows_opened, stats.peers, stats.errors, stats.dropped) == (2, 2, 0, 0)
            assert sorted(relay.peers) == sorted(f"127.0.0.1:{p.address[1]}" for p in (a, b))
            assert server.target.udp_opened == 2
            assert [e.kind for e in events] == [FlowEventKind.OPENED] * 2
        # Closing the relay closed both flows, and so both sockets in the pod.
        await server.target.wait_udp_open(0)
        assert sorted(e.kind for e in events[2:]) == [FlowEventKind.CLOSED] * 2
        assert sum(e.datagrams_from_pod for e in events[2:]) == DATAGRAMS
    finally:
        await session.aclose()


async def test_relay_idle_flow_is_closed_and_the_next_datagram_opens_a_new_one(
    server: Server,
) -> None:
    session = await server.connect()
    try:
        async with relay_on(session, UDP_ECHO_PORT, idle_timeout=0.3) as (relay, events):
            peer = await LocalPeer.open(relay.address)
            try:
                peer.send(b"first")
                assert await peer.reply() == b"first"
                assert server.target.udp_open == 1
                # Idle: the relay closes the stream, and the server the pod's socket.
                await server.target.wait_udp_open(0)
                await wait_until(
                    lambda: any(e.kind is FlowEventKind.CLOSED for e in events), "flow closed"
                )
                assert (relay.stats.flows_expired, relay.stats.peers) == (1, 0)
                closed = [e for e in events if e.kind is FlowEventKind.CLOSED]
                assert len(closed) == 1
                assert (closed[0].datagrams_to_pod, closed[0].datagrams_from_pod) == (1, 1)
                assert (closed[0].bytes_to_pod, closed[0].bytes_from_pod) == (5, 5)
                peer.send(b"second")
                assert await peer.reply() == b"second"
                assert (relay.stats.flows_opened, server.target.udp_opened) == (2, 2)
            finally:
                peer.close()
        assert relay.stats.errors == 0
    finally:
        await session.aclose()


async def test_relay_reports_a_failed_flow_and_tries_again(server: Server) -> None:
    session = await server.connect()
    try:
        async with relay_on(session, UDP_BROKEN_PORT) as (relay, events):
            peer = await LocalPeer.open(relay.address)
            try:
                for attempt in (1, 2):
                    peer.send(b"hello %d" % attempt)
                    await wait_until(
                        functools.partial(failures_reach, relay, attempt),
                        f"failure {attempt} reported",
                    )
            finally:
                peer.close()
            failed = [e for e in events if e.kind is FlowEventKind.FAILED]
            assert len(failed) == 2
            # The server's own words, from the pair's error stream.
            assert failed[0].message == (
                f"error forwarding port {UDP_BROKEN_PORT} to pod {POD}, uid {UID}: no udp here"
            )
            assert relay.stats.flows_opened == 2
            assert relay.stats.peers == 0
    finally:
        await session.aclose()


async def test_relay_over_a_session_without_udp_reports_why(server: Server) -> None:
    session = await server.connect(udp=False)
    try:
        async with relay_on(session, UDP_ECHO_PORT) as (relay, events):
            peer = await LocalPeer.open(relay.address)
            try:
                peer.send(b"x")
                await wait_until(lambda: bool(events), "the failure reported")
            finally:
                peer.close()
            (event,) = events
            assert event.kind is FlowEventKind.FAILED
            assert event.message.startswith(
                "cannot open a stream: the server does not support UDP port-forward"
            )
            assert (relay.stats.errors, relay.stats.flows_opened, relay.stats.dropped) == (1, 0, 1)
    finally:
        await session.aclose()


async def test_relay_peer_limit(server: Server) -> None:
    session = await server.connect()
    try:
        async with relay_on(session, UDP_ECHO_PORT, max_peers=1) as (relay, events):
            a = await LocalPeer.open(relay.address)
            b = await LocalPeer.open(relay.address)
            try:
                a.send(b"a")
                assert await a.reply() == b"a"
                b.send(b"b")
                b.send(b"b again")
                a.send(b"a again")
                assert await a.reply() == b"a again"
                with pytest.raises(TimeoutError):
                    await b.reply(timeout=0.3)
            finally:
                a.close()
                b.close()
            assert relay.stats.peers_refused == 2
            refused = [e for e in events if e.kind is FlowEventKind.REFUSED]
            assert len(refused) == 1  # said once, not per datagram
            assert refused[0].peer == f"127.0.0.1:{b.address[1]}"
    finally:
        await session.aclose()
