"""End to end: the agent runs inside a network namespace of its own (the emulated guest), the
hybrid-vsock muxer on the host, and the test plays the runtime: it listens on `v.sock_5000`,
calls PortForward over hybrid vsock and moves bytes over the dial-back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import stat
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import pytest
from agent_support import (
    CHUNK,
    DialBacks,
    EchoServer,
    MiB,
    echo_transfer,
    health,
    listening_socket,
    on_fresh_thread,
    port_forward,
    refused_message,
    short_dir,
    start_echo,
)

from podgate.aio.errors import StreamError
from podgate.aio.streams import ByteStream
from podgate.aio.ttrpc import TtrpcClient
from podgate.linux import ns, vsock
from podgate.linux.proc import is_alive, read_json, signal_process, wait_gone
from podgate.linux.vmm import READY_LINE, start_vmm
from podgate.linux.vsock import HybridVsockError, Listener, parse_address
from podgate.proto.ttrpc import Code, TtrpcError

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates a network namespace"),
    pytest.mark.skipif(shutil.which("nsenter") is None, reason="needs nsenter (util-linux)"),
]

VSOCK_PORT = 5000
AGENT_PORT = 1024
START_TIMEOUT = 15.0


@pytest.fixture
def netns() -> Iterator[str]:
    """A fresh network namespace with only lo up, held by an fd (no process, no mount)."""

    def make() -> int:
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            ns.unshare(ns.CLONE_NEWNET)
            fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
            ns.set_link_up("lo")
            ns.setns(home, ns.CLONE_NEWNET)
            return fd
        finally:
            os.close(home)

    fd = on_fresh_thread(make)
    try:
        yield f"/proc/{os.getpid()}/fd/{fd}"
    finally:
        os.close(fd)


def _listen_in(path: str, family: int, host: str) -> socket.socket:
    def make() -> socket.socket:
        with ns.in_netns(path):
            return listening_socket(family, host)

    return on_fresh_thread(make)


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        async with asyncio.timeout(5):
            await proc.wait()
    except TimeoutError:
        proc.kill()
        await proc.wait()


@dataclass
class Sandbox:
    dir: str
    netns: str
    echo4: EchoServer
    echo6: EchoServer
    dial_backs: DialBacks
    vmm: asyncio.subprocess.Process
    agent: asyncio.subprocess.Process | None = None
    agents: list[asyncio.subprocess.Process] = field(default_factory=list)

    @property
    def uds(self) -> str:
        return f"{self.dir}/v.sock"

    @property
    def agent_log(self) -> str:
        return f"{self.dir}/agent.log"

    async def start_agent(self) -> asyncio.subprocess.Process:
        with open(self.agent_log, "ab") as log:
            self.agent = await asyncio.create_subprocess_exec(
                "nsenter",
                f"--net={self.netns}",
                sys.executable,
                "-m",
                "podgate",
                "agent",
                "serve",
                "--listen",
                f"unix://{self.dir}/guest.vsock_{AGENT_PORT}",
                "--host",
                f"hvsock://{self.uds}",
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=log,
            )
        self.agents.append(self.agent)
        async with asyncio.timeout(START_TIMEOUT):
            while True:
                try:
                    async with await self.client() as client:
                        assert await health(client) == "ok"
                        return self.agent
                except (HybridVsockError, TtrpcError):
                    assert self.agent.returncode is None, self.log_text()
                    await asyncio.sleep(0.05)

    async def client(self) -> TtrpcClient:
        stream = await vsock.connect(parse_address(f"hvsock://{self.uds}:{AGENT_PORT}"))
        return TtrpcClient(stream)

    def log_text(self) -> str:
        with open(self.agent_log, encoding="utf-8", errors="replace") as f:
            return f.read()

    async def log_line(self, needle: str) -> str:
        async with asyncio.timeout(10):
            while True:
                for line in self.log_text().splitlines():
                    if needle in line:
                        return line
                await asyncio.sleep(0.05)


@pytest.fixture
async def sandbox(netns: str) -> AsyncIterator[Sandbox]:
    with short_dir() as d:
        with open(f"{d}/vmm.log", "ab") as vmm_log:
            vmm = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "podgate.linux.vmm",
                "--uds",
                f"{d}/v.sock",
                "--guest-prefix",
                f"{d}/guest.vsock",
                stdout=asyncio.subprocess.PIPE,
                stderr=vmm_log,
            )
        echo4 = echo6 = None
        back: Listener | None = None
        box: Sandbox | None = None
        try:
            assert vmm.stdout is not None
            async with asyncio.timeout(START_TIMEOUT):
                assert (await vmm.stdout.readline()).decode().strip() == READY_LINE
            echo4 = await start_echo(_listen_in(netns, socket.AF_INET, "127.0.0.1"))
            echo6 = await start_echo(_listen_in(netns, socket.AF_INET6, "::1"))
            dial_backs = DialBacks()
            back = await vsock.listen(
                parse_address(f"hvsock://{d}/v.sock"), dial_backs.handler, VSOCK_PORT
            )
            box = Sandbox(d, netns, echo4, echo6, dial_backs, vmm)
            await box.start_agent()
            yield box
        finally:
            if box is not None:
                box.dial_backs.release()
                for agent in box.agents:
                    await _stop(agent)
            if back is not None:
                back.close()
            for echo in (echo4, echo6):
                if echo is not None:
                    await echo.close()
            await _stop(vmm)


async def test_device_socket_and_guest(sandbox: Sandbox) -> None:
    assert stat.S_IMODE(os.stat(sandbox.uds).st_mode) == 0o600
    # The agent really lives in the namespace (nsenter execs it: same pid).
    assert sandbox.agent is not None
    agent_ns = os.stat(f"/proc/{sandbox.agent.pid}/ns/net").st_ino
    assert agent_ns == os.stat(sandbox.netns).st_ino
    assert agent_ns != os.stat("/proc/self/ns/net").st_ino


async def test_health(sandbox: Sandbox) -> None:
    async with await sandbox.client() as client:
        assert await health(client) == "ok"


@pytest.mark.parametrize("family", ["ipv4", "ipv6"])
async def test_sixty_four_mib_both_ways(sandbox: Sandbox, family: str) -> None:
    # The IPv6 echo listens only on ::1 (127.0.0.1 refuses on its port in this netns).
    echo = sandbox.echo4 if family == "ipv4" else sandbox.echo6
    async with await sandbox.client() as client:
        assert await port_forward(client, echo.port, VSOCK_PORT) == b""
    stream = await sandbox.dial_backs.next()
    async with asyncio.timeout(120):
        result = await echo_transfer(stream, 64 * MiB)
    await stream.aclose()
    assert result.sent == result.received == 64 * MiB
    assert result.received_sha256 == result.sent_sha256
    line = await sandbox.log_line(f"port-forward end container=c1 port={echo.port} ")
    assert f"vsock_port={VSOCK_PORT} to_target={64 * MiB} to_host={64 * MiB} duration=" in line


async def test_refused_port_is_a_synchronous_error(sandbox: Sandbox) -> None:
    port = 9  # nothing listens in this namespace but the two echo servers
    assert port not in (sandbox.echo4.port, sandbox.echo6.port)
    async with await sandbox.client() as client:
        with pytest.raises(TtrpcError) as info:
            await port_forward(client, port, VSOCK_PORT)
        assert info.value.code == Code.UNAVAILABLE
        assert info.value.message == refused_message(port)
        assert await sandbox.dial_backs.none_within(0.5)
        assert await health(client) == "ok"  # the connection is still good


async def _stream_until_broken(stream: ByteStream, flowing: asyncio.Event) -> str:
    """Send an endless echo stream (`flowing` is set after 4 MiB came back); returns how it
    ended."""
    chunk = os.urandom(CHUNK)
    received = 0

    async def writer() -> None:
        while True:
            await stream.send(chunk)

    async def reader() -> None:
        nonlocal received
        while data := await stream.receive():
            received += len(data)
            if received >= 4 * MiB:
                flowing.set()

    task = asyncio.ensure_future(writer())
    try:
        await reader()
        return "eof"  # an orderly end in the middle of an endless stream
    except StreamError as exc:
        return f"error: {exc}"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, StreamError):
            await task


async def test_killed_agent_ends_its_forward_and_a_new_one_serves(sandbox: Sandbox) -> None:
    old_client = await sandbox.client()
    await port_forward(old_client, sandbox.echo4.port, VSOCK_PORT)
    stream = await sandbox.dial_backs.next()
    flowing = asyncio.Event()
    transfer = asyncio.ensure_future(_stream_until_broken(stream, flowing))
    async with asyncio.timeout(10):
        await flowing.wait()
    assert sandbox.agent is not None
    sandbox.agent.kill()
    async with asyncio.timeout(10):
        ended = await transfer
    # The host side learns at once, as an error: the dead agent's socket still held unread
    # bytes, so the kernel resets its peer.
    assert ended.startswith("error"), ended
    await stream.aclose()
    with pytest.raises(TtrpcError):  # the muxer connection to the dead agent is gone too
        await health(old_client)
    await old_client.aclose()

    await sandbox.start_agent()
    async with await sandbox.client() as client:
        await port_forward(client, sandbox.echo4.port, VSOCK_PORT)
    fresh = await sandbox.dial_backs.next()
    result = await echo_transfer(fresh, 1 * MiB)
    await fresh.aclose()
    assert result.received_sha256 == result.sent_sha256


async def test_garbage_closes_only_that_connection(sandbox: Sandbox) -> None:
    async with await sandbox.client() as client:
        await port_forward(client, sandbox.echo6.port, VSOCK_PORT)
        forwarded = await sandbox.dial_backs.next()
        raw = await vsock.connect(parse_address(f"hvsock://{sandbox.uds}:{AGENT_PORT}"))
        await raw.send(b"\xff" * 64)  # a ttrpc header with the reserved length byte set
        async with asyncio.timeout(5):
            assert await raw.receive() == b""
        await raw.aclose()
        assert await health(client) == "ok"
        result = await echo_transfer(forwarded, 4 * MiB)
        await forwarded.aclose()
        assert result.received_sha256 == result.sent_sha256


async def test_start_vmm_helper(sandbox: Sandbox) -> None:
    uds = f"{sandbox.dir}/v2.sock"
    log = f"{sandbox.dir}/vmm2.log"
    ref = await start_vmm(uds, f"{sandbox.dir}/guest.vsock", log)
    try:
        assert is_alive(ref)
        assert os.getppid() != ref.pid and ref.pid != os.getpid()
        assert read_json(f"{uds}.ready") == {"pid": ref.pid, "start_time": ref.start_time}
        assert stat.S_IMODE(os.stat(uds).st_mode) == 0o600
        stream = await vsock.connect(parse_address(f"hvsock://{uds}:{AGENT_PORT}"))
        async with TtrpcClient(stream) as client:
            assert await health(client) == "ok"
    finally:
        signal_process(ref, signal.SIGTERM)
        gone = await wait_gone(ref, 10)
        if not gone:
            signal_process(ref, signal.SIGKILL)
            await wait_gone(ref, 5)
    assert gone
    assert not os.path.exists(uds)


async def test_sigterm_lets_a_running_forward_finish(sandbox: Sandbox) -> None:
    async with await sandbox.client() as client:
        await port_forward(client, sandbox.echo4.port, VSOCK_PORT)
    stream = await sandbox.dial_backs.next()
    agent = sandbox.agent
    assert agent is not None
    agent.send_signal(signal.SIGTERM)
    await sandbox.log_line("agent stopping: 1 forwards in progress")
    # No new connections: the agent's listener is gone, so the muxer has nobody to connect to.
    with pytest.raises(HybridVsockError):
        await vsock.connect(parse_address(f"hvsock://{sandbox.uds}:{AGENT_PORT}"))
    result = await echo_transfer(stream, 4 * MiB)  # the forward in progress goes on
    await stream.aclose()
    assert result.received_sha256 == result.sent_sha256
    async with asyncio.timeout(10):
        assert await agent.wait() == 0
