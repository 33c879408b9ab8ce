"""The gateway in one process over real TLS: metrics, the idle timeout, the rate limit, and
plain HTTP's loopback-only rule. (kubectl against the gateway: tests/gateway.)"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import time
import urllib.request
from collections.abc import AsyncIterator

import pytest

from podgate.aio.errors import StreamError
from podgate.aio.memory import memory_stream_pair
from podgate.aio.streams import SocketStream, start_server
from podgate.demo.api import DemoPod, DemoSource
from podgate.node.gateway import GatewayConfig, Limits
from podgate.node.server import InsecureListenError, RunningGateway, running_gateway
from podgate.streaming.client import (
    Endpoint,
    PortForwardSession,
    UpgradeError,
    exec_query,
    exec_spdy,
    pod_path,
)
from podgate.streaming.local import LocalTarget

ECHO = 7000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def echo(stream: SocketStream) -> None:
    while chunk := await stream.receive():
        await stream.send(chunk)
    await stream.send_eof()


@pytest.fixture
async def echo_port() -> AsyncIterator[int]:
    server = await start_server(echo, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


def admin_endpoint(gateway: RunningGateway) -> Endpoint:
    assert gateway.credentials is not None
    pki = gateway.credentials.pki
    return Endpoint(
        "127.0.0.1",
        gateway.port,
        ssl_context=pki.client_ssl_context(pki.admin_cert, pki.admin_key),
        server_hostname="127.0.0.1",
    )


def config(tmp_path: object, **extra: object) -> GatewayConfig:
    return GatewayConfig(state_dir=str(tmp_path), cri_socket="", port=0, **extra)  # type: ignore[arg-type]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return str(reply.read().decode())


def sample(metrics: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in metrics.splitlines():
        if line.startswith(f"{name}{{") and line.split("}")[0].split("{")[1] == wanted:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_metrics_count_streams_bytes_and_denials(tmp_path: object, echo_port: int) -> None:
    metrics_port = free_port()
    source = DemoSource(LocalTarget(port_map={ECHO: echo_port}), [DemoPod("default", "demo")])
    async with running_gateway(config(tmp_path, metrics_port=metrics_port), source) as gateway:
        endpoint = admin_endpoint(gateway)
        result = await exec_spdy(
            endpoint, pod_path("default", "demo", "exec") + "?" + exec_query(["true"])
        )
        assert result.exit_code == 0
        session = await PortForwardSession.connect(
            endpoint, pod_path("default", "demo", "portforward")
        )
        forwarded = await session.open(ECHO)
        payload = os.urandom(1 << 20)
        await forwarded.data.send(payload)
        await forwarded.data.send_eof()
        got = b""
        while chunk := await forwarded.data.receive():
            got += chunk
        assert hashlib.sha256(got).digest() == hashlib.sha256(payload).digest()
        await session.aclose()
        anonymous = Endpoint(
            "127.0.0.1",
            gateway.port,
            ssl_context=gateway.credentials.pki.client_ssl_context(),
            server_hostname="127.0.0.1",
        )  # type: ignore[union-attr]
        with pytest.raises(UpgradeError) as refused:
            await exec_spdy(
                anonymous, pod_path("default", "demo", "exec") + "?" + exec_query(["true"])
            )
        assert refused.value.status == 401
        await asyncio.sleep(0.2)
        text = await asyncio.to_thread(scrape, metrics_port)
    assert sample(text, "podgate_streams_total", verb="exec") == 1.0
    assert sample(text, "podgate_streams_total", verb="portforward") == 1.0
    assert sample(text, "podgate_stream_bytes_total", verb="portforward", direction="in") == 1 << 20
    assert (
        sample(text, "podgate_stream_bytes_total", verb="portforward", direction="out") == 1 << 20
    )
    assert sample(text, "podgate_active_streams", verb="exec") == 0.0


async def test_idle_stream_is_closed(tmp_path: object, echo_port: int) -> None:
    source = DemoSource(LocalTarget(port_map={ECHO: echo_port}), [DemoPod("default", "demo")])
    async with running_gateway(config(tmp_path, idle_timeout=0.5), source) as gateway:
        session = await PortForwardSession.connect(
            admin_endpoint(gateway), pod_path("default", "demo", "portforward")
        )
        session.session._ping_interval = None  # a client that goes quiet
        forwarded = await session.open(ECHO)
        started = time.monotonic()
        with pytest.raises(StreamError):  # reset by the idle timeout, then the connection ends
            while await asyncio.wait_for(forwarded.data.receive(), 10):
                pass
            raise AssertionError("EOF without the idle reset")
        # Well before the 10 s receive timeout: the idle timeout did it.
        assert time.monotonic() - started < 9
        await session.aclose()


async def test_rate_limit_applies_to_exec_output(tmp_path: object) -> None:
    source = DemoSource(LocalTarget(), [DemoPod("default", "demo")])
    limits = Limits(max_bytes_per_sec=200_000)
    async with running_gateway(config(tmp_path, limits=limits), source) as gateway:
        out_reader, out_writer = memory_stream_pair(capacity=8 << 20)
        started = time.monotonic()
        result = await exec_spdy(
            admin_endpoint(gateway),
            pod_path("default", "demo", "exec")
            + "?"
            + exec_query(["head", "-c", "600000", "/dev/zero"]),
            stdout=out_writer,
        )
        elapsed = time.monotonic() - started
        await out_writer.send_eof()
        total = 0
        while chunk := await out_reader.receive():
            total += len(chunk)
    assert result.exit_code == 0 and total == 600_000
    # 600 kB at 200 kB/s with one second of burst cannot take less than two seconds.
    assert elapsed >= 1.9


async def test_plain_http_is_refused_off_loopback(tmp_path: object) -> None:
    source = DemoSource(LocalTarget(), [])
    with pytest.raises(InsecureListenError):
        async with running_gateway(config(tmp_path, plain_http=True, host="0.0.0.0"), source):
            pass
