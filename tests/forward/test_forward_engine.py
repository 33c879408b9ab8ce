"""The port-forward engine in process, against the demo API behind a proxy that fails on
demand: per-connection errors, lost sessions, replaced and deleted pods, denial, UDP."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import socket
from collections.abc import AsyncIterator

import pytest
from forward_support import (
    DemoCluster,
    EventLog,
    ReplaceablePod,
    UdpEcho,
    demo_cluster,
    echo_once,
)

from podgate.aio.streams import SocketStream
from podgate.demo.api import DemoPod, DemoSource
from podgate.forward.engine import (
    EngineOptions,
    ExitCode,
    ListenError,
    TargetForward,
    Transport,
    backoff_delays,
    worst,
)
from podgate.forward.specs import PortSpec, Protocol, TargetSpec
from podgate.forward.status import EventKind, ForwardStatus, TargetState
from podgate.kubeconfig import ApiServer
from podgate.node.kubeapi import KubeApi
from podgate.streaming.client import Endpoint
from podgate.streaming.local import LocalTarget

ECHO = 7000
REFUSED = 7002
UDP_REMOTE = 53
# Quick health checks so a lost session shows within a second.
FAST = EngineOptions(
    gone_timeout=30.0,
    connect_wait=10.0,
    ping_interval=0.2,
    ping_timeout=0.2,
    pod_check_interval=0.1,
)
PAYLOAD = os.urandom(256 * 1024)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def running(
    cluster: DemoCluster,
    ports: tuple[PortSpec, ...],
    options: EngineOptions = FAST,
    pod: str = "demo",
) -> AsyncIterator[tuple[TargetForward, EventLog, asyncio.Task[ExitCode]]]:
    status = ForwardStatus()
    log = EventLog()
    status.subscribe(log)
    forward = TargetForward(
        cluster.api_server(), TargetSpec(pod, ports), ("127.0.0.1",), status, options
    )
    await forward.listen()
    task = asyncio.create_task(forward.run())
    try:
        yield forward, log, task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def local_port(forward: TargetForward, remote: int) -> int:
    (port,) = [p for spec, _, p in forward.bound if spec.remote == remote]
    return port


@pytest.fixture
async def cluster() -> AsyncIterator[DemoCluster]:
    pod = ReplaceablePod("default", "demo", ports=(ECHO,))
    async with demo_cluster([pod], {REFUSED: closed_port()}) as c:
        yield c


def test_backoff_doubles_to_the_cap_with_bounded_jitter() -> None:
    exact = backoff_delays(0.2, 5.0, 0.2, lambda: 0.5)
    assert [round(exact(n), 6) for n in range(7)] == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    low, high = (
        backoff_delays(0.2, 5.0, 0.2, lambda: 0.0),
        backoff_delays(0.2, 5.0, 0.2, lambda: 1.0),
    )
    assert round(low(0), 6) == 0.16 and round(high(0), 6) == 0.24
    assert round(high(40), 6) == 6.0


def test_worst_exit_code() -> None:
    assert worst([]) is ExitCode.INTERRUPTED
    assert worst([ExitCode.GONE, ExitCode.DENIED]) is ExitCode.DENIED
    assert worst([ExitCode.LISTEN_FAILED, ExitCode.DENIED, ExitCode.GONE]) is ExitCode.LISTEN_FAILED
    assert worst([ExitCode.GONE, ExitCode.FATAL]) is ExitCode.FATAL


async def test_refused_connection_is_reported_and_the_forward_goes_on(cluster: DemoCluster) -> None:
    ports = (PortSpec(0, ECHO), PortSpec(0, REFUSED))
    async with running(cluster, ports) as (forward, log, _):
        await log.wait_for(EventKind.CONNECTED)
        stream = await SocketStream.connect("127.0.0.1", local_port(forward, REFUSED))
        with pytest.raises(Exception, match="reset"):
            async with asyncio.timeout(10):
                await stream.send(b"x")
                while await stream.receive():
                    pass
                raise AssertionError("a refused remote port must reset the local connection")
        await stream.aclose()
        (error,) = await log.wait_for(EventKind.CONNECTION_ERROR)
        assert error.remote == REFUSED and "7002" in error.error, error
        assert await echo_once(local_port(forward, ECHO), PAYLOAD) == PAYLOAD
        (closed,) = await log.wait_for(EventKind.CONNECTION_CLOSED)
        assert (closed.remote, closed.bytes_in, closed.bytes_out) == (
            ECHO,
            len(PAYLOAD),
            len(PAYLOAD),
        )
        stats = forward.stats
        assert stats.state is TargetState.CONNECTED
        echo, refused = stats.ports
        assert (echo.total, echo.errors, echo.active, echo.bytes_in) == (1, 0, 0, len(PAYLOAD))
        assert (refused.total, refused.errors, refused.active) == (1, 1, 0)
        assert stats.reconnects == 0


async def test_lost_session_reconnects_and_in_flight_connections_fail(cluster: DemoCluster) -> None:
    async with running(cluster, (PortSpec(0, ECHO),)) as (forward, log, _):
        await log.wait_for(EventKind.CONNECTED)
        port = local_port(forward, ECHO)
        # One connection in flight when the gateway goes away.
        inflight = await SocketStream.connect("127.0.0.1", port)
        await inflight.send(b"ping")
        assert await inflight.receive() == b"ping"
        cluster.proxy.cut()
        (lost,) = await log.wait_for(EventKind.SESSION_LOST)
        assert lost.error
        (failed,) = await log.wait_for(EventKind.CONNECTION_ERROR)
        assert "session lost" in failed.error
        with pytest.raises(Exception):  # noqa: B017 - reset or EOF-then-error, both mean "cut"
            async with asyncio.timeout(10):
                while await inflight.receive():
                    pass
                await inflight.send(b"more")
                raise AssertionError("the local connection of a lost session must be reset")
        await inflight.aclose()
        await log.wait_for(EventKind.RECONNECTED)
        assert await echo_once(port, PAYLOAD) == PAYLOAD
        assert forward.stats.reconnects == 1 and forward.stats.sessions_lost == 1


async def test_connection_during_an_outage_waits_for_the_session(cluster: DemoCluster) -> None:
    async with running(cluster, (PortSpec(0, ECHO),)) as (forward, log, _):
        await log.wait_for(EventKind.CONNECTED)
        await cluster.proxy.pause()
        await log.wait_for(EventKind.SESSION_LOST)
        await log.wait_for(EventKind.RECONNECTING)  # refused while the gateway is down
        waiting = asyncio.create_task(echo_once(local_port(forward, ECHO), PAYLOAD))
        await asyncio.sleep(0.5)
        assert not waiting.done()
        await cluster.proxy.resume()
        assert await waiting == PAYLOAD
        assert log.of(EventKind.RECONNECTED)
        assert not log.of(EventKind.CONNECTION_ERROR)


async def test_silent_connection_is_found_dead_by_pings(cluster: DemoCluster) -> None:
    async with running(cluster, (PortSpec(0, ECHO),)) as (forward, log, _):
        await log.wait_for(EventKind.CONNECTED)
        accepted = cluster.proxy.accepted
        cluster.proxy.flowing.clear()  # bytes stop moving; TCP stays up
        (lost,) = await log.wait_for(EventKind.SESSION_LOST)
        assert "ping" in lost.error
        cluster.proxy.flowing.set()
        await log.wait_for(EventKind.RECONNECTED)
        assert cluster.proxy.accepted > accepted
        assert await echo_once(local_port(forward, ECHO), PAYLOAD) == PAYLOAD


async def test_recreated_pod_is_followed(cluster: DemoCluster) -> None:
    async with running(cluster, (PortSpec(0, ECHO),)) as (forward, log, _):
        await log.wait_for(EventKind.CONNECTED)
        old = cluster.delete("demo")
        assert isinstance(old, ReplaceablePod)
        cluster.add(ReplaceablePod("default", "demo", ports=(ECHO,), generation=1))
        (replaced,) = await log.wait_for(EventKind.POD_REPLACED)
        assert "demo-default-demo-1" in replaced.error
        await log.wait_for(EventKind.RECONNECTED)
        assert await echo_once(local_port(forward, ECHO), PAYLOAD) == PAYLOAD


async def test_recreated_pod_with_the_same_uid_is_followed(cluster: DemoCluster) -> None:
    # Runtimes may take the uid from the pod's spec: a new incarnation then differs only in
    # its creation time (and IP).
    async with running(cluster, (PortSpec(0, ECHO),)) as (forward, log, _):
        await log.wait_for(EventKind.CONNECTED)
        old = cluster.delete("demo")
        later = old.created + datetime.timedelta(seconds=5)
        cluster.add(ReplaceablePod("default", "demo", ports=(ECHO,), created=later))
        await log.wait_for(EventKind.POD_REPLACED)
        await log.wait_for(EventKind.RECONNECTED)
        assert await echo_once(local_port(forward, ECHO), PAYLOAD) == PAYLOAD


async def test_deleted_pod_comes_back_within_the_gone_timeout(cluster: DemoCluster) -> None:
    async with running(cluster, (PortSpec(0, ECHO),)) as (forward, log, task):
        await log.wait_for(EventKind.CONNECTED)
        pod = cluster.delete("demo")
        (lost,) = await log.wait_for(EventKind.SESSION_LOST)
        assert "deleted" in lost.error
        await log.wait_for(EventKind.RECONNECTING)
        cluster.add(pod)
        await log.wait_for(EventKind.RECONNECTED)
        assert not task.done()
        assert await echo_once(local_port(forward, ECHO), PAYLOAD) == PAYLOAD


async def test_pod_missing_longer_than_the_gone_timeout_ends_the_target(
    cluster: DemoCluster,
) -> None:
    options = EngineOptions(gone_timeout=0.5, ping_interval=0.2, ping_timeout=0.2)
    async with running(cluster, (PortSpec(0, ECHO),), options) as (forward, log, task):
        await log.wait_for(EventKind.CONNECTED)
        port = local_port(forward, ECHO)
        cluster.delete("demo")
        async with asyncio.timeout(10):
            assert await task is ExitCode.GONE
        (gone,) = log.of(EventKind.TARGET_GONE)
        assert "not found" in gone.error
        assert forward.stats.state is TargetState.GONE
        with pytest.raises(OSError):  # the listener is closed with the target
            socket.create_connection(("127.0.0.1", port), timeout=2).close()


async def test_missing_pod_from_the_start_is_gone_after_the_timeout(cluster: DemoCluster) -> None:
    options = EngineOptions(gone_timeout=0.3)
    async with running(cluster, (PortSpec(0, ECHO),), options, pod="nope") as (_, log, task):
        async with asyncio.timeout(10):
            assert await task is ExitCode.GONE
        assert log.kinds()[0] is EventKind.LISTENING
        assert EventKind.CONNECTED not in log.kinds()
        assert log.of(EventKind.RECONNECTING)


class _DenyPortForward:
    """A gateway guard that lets anyone read pods but forbids port-forward."""

    def identify(self, conn: object, request: object) -> object:
        return "someone"

    def check(
        self, who: object, verb: str, namespace: str, pod: str, request: object
    ) -> str | None:
        return "forbidden: port-forward is not allowed" if verb == "portforward" else None

    def admit(self, *args: object) -> str:
        raise AssertionError("a denied request is never admitted")


async def test_denied_upgrade_ends_the_target_with_code_4() -> None:
    source = DemoSource(LocalTarget(), [DemoPod("default", "demo", ports=(ECHO,))])
    api = KubeApi(source, guard=_DenyPortForward())  # type: ignore[arg-type]
    server = await api.serve("127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        api_server = ApiServer(Endpoint("127.0.0.1", port), "", "default", "t", "")
        status = ForwardStatus()
        log = EventLog()
        status.subscribe(log)
        forward = TargetForward(
            api_server, TargetSpec("demo", (PortSpec(0, ECHO),)), ("127.0.0.1",), status
        )
        await forward.listen()
        async with asyncio.timeout(10):
            assert await forward.run() is ExitCode.DENIED
        (denied,) = log.of(EventKind.TARGET_DENIED)
        assert "Forbidden" in denied.error and "not allowed" in denied.error
    finally:
        server.close()


def LocalTargetStub() -> object:
    from podgate.streaming.local import LocalTarget

    return LocalTarget()


@pytest.mark.parametrize("transport", [Transport.WEBSOCKET, Transport.SPDY])
async def test_each_transport_forwards(cluster: DemoCluster, transport: Transport) -> None:
    options = EngineOptions(transport=transport)
    async with running(cluster, (PortSpec(0, ECHO),), options) as (forward, log, _):
        (connected,) = await log.wait_for(EventKind.CONNECTED)
        assert connected.protocol == transport.value
        assert await echo_once(local_port(forward, ECHO), PAYLOAD) == PAYLOAD


async def test_listen_failure_is_reported(cluster: DemoCluster) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        status = ForwardStatus()
        log = EventLog()
        status.subscribe(log)
        forward = TargetForward(
            cluster.api_server(),
            TargetSpec("demo", (PortSpec(0, ECHO), PortSpec(busy, ECHO))),
            ("127.0.0.1",),
            status,
        )
        with pytest.raises(ListenError, match=f"127.0.0.1:{busy}"):
            await forward.listen()
    (failed,) = log.of(EventKind.LISTEN_FAILED)
    assert str(busy) in failed.error
    assert forward.stats.state is TargetState.FAILED
    # The pair that did bind was closed again: all or nothing.
    first = log.of(EventKind.LISTENING)[0]
    port = int(first.local.rsplit(":", 1)[1])
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


async def test_udp_datagrams_round_trip() -> None:
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(UdpEcho, local_addr=("127.0.0.1", 0))
    udp_port = transport.get_extra_info("sockname")[1]
    pod = DemoPod("default", "demo", ports=(ECHO,))
    try:
        async with demo_cluster([pod], {}, {UDP_REMOTE: udp_port}) as cluster:
            spec = PortSpec(0, UDP_REMOTE, Protocol.UDP)
            async with running(cluster, (spec,)) as (forward, log, _):
                await log.wait_for(EventKind.CONNECTED)
                local = local_port(forward, UDP_REMOTE)
                client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                client.setblocking(False)
                client.connect(("127.0.0.1", local))
                try:
                    sent = [os.urandom(n) for n in (1, 100, 1400, 8000)]
                    got = []
                    for datagram in sent:
                        await loop.sock_sendall(client, datagram)
                        async with asyncio.timeout(10):
                            got.append(await loop.sock_recv(client, 65536))
                    assert got == sent
                finally:
                    client.close()
                (opened,) = await log.wait_for(EventKind.CONNECTION_OPENED)
                assert opened.protocol == "udp" and opened.remote == UDP_REMOTE
    finally:
        transport.close()
