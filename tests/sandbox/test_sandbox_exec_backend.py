"""The exec backend through CRI: a forwarder run inside the pod's container carries the bytes,
for a plain pod and for a sandboxed one (where it runs in the guest)."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator, Iterator

import pytest
from runtime_e2e_support import WAIT_SECONDS, Pods, RuntimeDaemon, read_all
from sandbox_support import MIB, echo_transfer, port_forward, run_pod, sandbox_daemon, shim_stats

from podgate.aio.errors import StreamError

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: sandboxes are made of namespaces"),
]

TRANSFER = 1024 * MIB  # the same 1 GiB as the agent path
CLOSED_PORT = 7409


@pytest.fixture(scope="module")
def exec_daemon() -> Iterator[RuntimeDaemon]:
    with sandbox_daemon(["--backend", "=exec", "--backend", "sandboxed=exec"]) as daemon:
        yield daemon


@pytest.fixture
async def exec_pods(exec_daemon: RuntimeDaemon) -> AsyncIterator[Pods]:
    async with exec_daemon.connect() as rt:
        made = Pods(rt)
        try:
            yield made
        finally:
            await made.remove_all()


@pytest.mark.parametrize("handler", ["", "sandboxed"])
async def test_1_gib_through_a_forwarder_in_the_container(
    exec_daemon: RuntimeDaemon, exec_pods: Pods, handler: str
) -> None:
    # The host listens on the same port and never answers: the bytes must reach the pod.
    with socket.create_server(("127.0.0.1", 0)) as host_listener:
        port = host_listener.getsockname()[1]
        pod = await run_pod(exec_pods, f"exec-{handler or 'plain'}", handler)
        await exec_pods.server(pod, "echo", "echo", "127.0.0.1", port)
        session = await port_forward(exec_pods.rt, pod, [port])
        try:
            result = await echo_transfer(await session.open(port), TRANSFER)
        finally:
            await session.aclose()
    assert (result.sent, result.received) == (TRANSFER, TRANSFER)
    assert result.received_sha256 == result.sent_sha256
    assert result.error == ""
    if handler:
        # Not through the agent: the shim was never asked.
        assert (await shim_stats(exec_daemon, pod)).agent_port_forwards == 0


async def test_refused_port_reports_the_forwarders_words(exec_pods: Pods) -> None:
    pod = await run_pod(exec_pods, "exec-refused", "sandboxed")
    await exec_pods.create(pod, "sleep", ["sleep", "1000"])
    session = await port_forward(exec_pods.rt, pod, [])
    try:
        async with asyncio.timeout(WAIT_SECONDS):
            forwarded = await session.open(CLOSED_PORT)
            await forwarded.data.send(b"anyone?")
            error = await forwarded.error()
            try:
                await read_all(forwarded.data)
            except StreamError:
                pass  # reset, as upstream does
    finally:
        await session.aclose()
    prefix = f"error forwarding port {CLOSED_PORT} to pod {pod.id}, uid {pod.uid}: "
    assert error.startswith(prefix), error
    assert "in container sleep: " in error
    assert "refused" in error
