"""Faults in the sandbox path: the agent or the whole shim killed mid-transfer. Only the
connections through what died fail, they fail visibly, and the next connection works."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal

import pytest
from runtime_e2e_support import WAIT_SECONDS, Pod, Pods, RuntimeDaemon, read_all
from sandbox_support import (
    MIB,
    Transfer,
    echo_transfer,
    pod_info,
    port_forward,
    run_pod,
    shim_stats,
)

from podgate.aio.errors import StreamError
from podgate.cri import api_pb2 as pb
from podgate.cri import api_pb2_grpc as pb_grpc
from podgate.linux.proc import is_alive, is_exiting, process_ref, signal_process
from podgate.model import ProcessRef
from podgate.streaming.client import ForwardedStream, PortForwardSession

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: sandboxes are made of namespaces"),
]

ECHO_PORT = 7301
# Enough that the transfer is still running when the fault is injected.
ENDLESS = 64 * 1024 * MIB
# Bytes echoed back before the fault is injected: the path is certainly carrying data.
BEFORE_FAULT = 8 * MIB
SURVIVOR_TRANSFER = 64 * MIB


async def endless_echo(forwarded: ForwardedStream, progress: asyncio.Event) -> str:
    """Echo random data until the connection fails; set `progress` after BEFORE_FAULT bytes
    came back. Returns what the error stream said."""
    received = 0

    async def upload() -> None:
        with contextlib.suppress(StreamError):
            for _ in range(ENDLESS // MIB):
                await forwarded.data.send(os.urandom(MIB))
                # A send into a stream the server has given up on may not block: let the
                # other transfers of this test run.
                await asyncio.sleep(0)

    async def download() -> None:
        nonlocal received
        with contextlib.suppress(StreamError):
            while chunk := await forwarded.data.receive():
                received += len(chunk)
                if received >= BEFORE_FAULT:
                    progress.set()

    uploader = asyncio.create_task(upload())
    try:
        async with asyncio.timeout(60):
            await download()
    finally:
        uploader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await uploader
    async with asyncio.timeout(60):
        return await forwarded.error()


async def echo_once(session: PortForwardSession, port: int, payload: bytes) -> tuple[bytes, str]:
    forwarded = await session.open(port)
    await forwarded.data.send(payload)
    await forwarded.data.send_eof()
    return await read_all(forwarded.data), await forwarded.error()


async def echo_pod(pods: Pods, name: str, handler: str = "sandboxed") -> Pod:
    pod = await run_pod(pods, name, handler)
    await pods.server(pod, "echo", "echo", "127.0.0.1", ECHO_PORT)
    return pod


def ref(info: dict[str, object], key: str) -> ProcessRef:
    extra = info["extra"]
    assert isinstance(extra, dict)
    return ProcessRef(**extra[key])


async def test_agent_killed_mid_transfer_fails_that_connection_then_it_is_restarted(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, sandbox_runtime: RuntimeDaemon
) -> None:
    pod = await echo_pod(pods, "sb-agentkill")
    session = await port_forward(cri, pod, [ECHO_PORT])
    try:
        before = await shim_stats(sandbox_runtime, pod)
        assert before.agent_pid and before.agent_starts == 1
        progress = asyncio.Event()
        transfer = asyncio.create_task(endless_echo(await session.open(ECHO_PORT), progress))
        await asyncio.wait_for(progress.wait(), WAIT_SECONDS)
        os.kill(before.agent_pid, signal.SIGKILL)
        error = await transfer
        prefix = f"error forwarding port {ECHO_PORT} to pod {pod.id}, uid {pod.uid}: "
        assert error.startswith(prefix + "the connection through the sandbox agent broke: "), error

        # The shim starts a new agent; the same session then forwards again.
        async with asyncio.timeout(WAIT_SECONDS):
            while True:
                after = await shim_stats(sandbox_runtime, pod)
                if after.agent_starts == 2 and after.agent_pid:
                    break
                await asyncio.sleep(0.05)
            assert after.agent_pid != before.agent_pid
            assert await echo_once(session, ECHO_PORT, b"new agent") == (b"new agent", "")
    finally:
        await session.aclose()


@pytest.mark.parametrize("victim", ["agent", "shim"])
async def test_a_kill_while_the_connection_is_idle_reads_as_an_error(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, sandbox_runtime: RuntimeDaemon, victim: str
) -> None:
    # Nothing unread in the dying process's unix sockets: the kernel ends them with EOF, not a
    # reset, so only asking the shim tells this end from the pod closing the connection.
    pod = await echo_pod(pods, f"sb-idle-{victim}")
    session = await port_forward(cri, pod, [ECHO_PORT])
    try:
        forwarded = await session.open(ECHO_PORT)
        await forwarded.data.send(b"ping")
        assert await forwarded.data.receive() == b"ping"
        agent = process_ref((await shim_stats(sandbox_runtime, pod)).agent_pid)
        if victim == "agent":
            assert signal_process(agent, signal.SIGKILL)
        else:
            # The shim handed the connection to the runtime and holds none of it: the shim's
            # death reaches the connection because its agent dies with it (PDEATHSIG).
            assert signal_process(ref(await pod_info(cri, pod), "sandbox_shim"), signal.SIGKILL)
        async with asyncio.timeout(WAIT_SECONDS):
            with contextlib.suppress(StreamError):
                assert await forwarded.data.receive() == b""
            error = await forwarded.error()
        prefix = f"error forwarding port {ECHO_PORT} to pod {pod.id}, uid {pod.uid}: "
        assert error.startswith(prefix + "the connection through the sandbox agent broke: "), error
        assert is_exiting(agent)
    finally:
        await session.aclose()


async def test_shim_killed_mid_transfer_fails_only_its_streams(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, sandbox_runtime: RuntimeDaemon
) -> None:
    victim = await echo_pod(pods, "sb-shimkill")
    other = await echo_pod(pods, "sb-other")
    plain = await echo_pod(pods, "plain-other", "")
    victim_info = await pod_info(cri, victim)
    shim = ref(victim_info, "sandbox_shim")
    sessions = [await port_forward(cri, pod, [ECHO_PORT]) for pod in (victim, other, plain)]
    try:
        progress = asyncio.Event()
        doomed = asyncio.create_task(endless_echo(await sessions[0].open(ECHO_PORT), progress))
        survivors: list[asyncio.Task[Transfer]] = [
            asyncio.create_task(echo_transfer(await s.open(ECHO_PORT), SURVIVOR_TRANSFER))
            for s in sessions[1:]
        ]
        await asyncio.wait_for(progress.wait(), WAIT_SECONDS)
        assert signal_process(shim, signal.SIGKILL)
        error = await doomed
        prefix = f"error forwarding port {ECHO_PORT} to pod {victim.id}, uid {victim.uid}: "
        assert error.startswith(prefix + "the connection through the sandbox agent broke: "), error
        for result in await asyncio.gather(*survivors):
            assert result.received == SURVIVOR_TRANSFER
            assert result.received_sha256 == result.sent_sha256
            assert result.error == ""

        # The next connection to the victim gets a new shim, which adopts the same guest:
        # its containers never stopped.
        payload = hashlib.sha256(b"again").hexdigest().encode()
        async with asyncio.timeout(WAIT_SECONDS * 4):
            assert await echo_once(sessions[0], ECHO_PORT, payload) == (payload, "")
        info = await pod_info(cri, victim)
        assert ref(info, "sandbox_shim") != shim
        assert is_alive(ref(info, "sandbox_shim"))
        assert not is_alive(shim)
        assert ref(info, "guest_ns_process") == ref(victim_info, "guest_ns_process")
        containers = await cri.ListContainers(
            pb.ListContainersRequest(filter=pb.ContainerFilter(pod_sandbox_id=victim.id))
        )
        assert [c.state for c in containers.containers] == [pb.CONTAINER_RUNNING]
    finally:
        for session in sessions:
            await session.aclose()
