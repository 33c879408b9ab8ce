"""Per-pod pools of sockets made ahead of time in a real network namespace: connections come
from batches (far fewer worker calls than connections), every byte is echoed back, and the pool
closes itself when the pod's process exits."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from podgate.linux import ns
from podgate.linux.netns_pool import POOL_SOCKETS, NetnsPools, PodSockets

T = TypeVar("T")

ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates network namespaces")
# Connections per test: several pool refills' worth.
CONNECTIONS = 3 * POOL_SOCKETS + 5
# Generous bounds for a loaded machine: a failure must fail, not hang.
READY_SECONDS = 30.0
POLL_SECONDS = 0.02
# A process alone in a new netns with lo up, printing "ready" (the pod's ns process).
_POD = (
    "from podgate.linux import ns; ns.unshare(ns.CLONE_NEWNET); ns.set_link_up('lo'); "
    "print('ready', flush=True); import time; time.sleep(300)"
)


class CountingWorker(ns.NetnsWorker):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        self.calls += 1
        return await super().call(fn, *args)


@pytest.fixture
def pod() -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, "-c", _POD], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        yield proc
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def _start_time(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[19])


async def _echo(listener: socket.socket, count: int) -> None:
    loop = asyncio.get_running_loop()
    for _ in range(count):
        conn, _ = await loop.sock_accept(listener)
        with conn:
            while data := await loop.sock_recv(conn, 100):
                await loop.sock_sendall(conn, data)


@pytest.mark.privileged
@ROOT
async def test_connections_come_from_batches_made_in_the_pods_netns(
    pod: subprocess.Popen[str],
) -> None:
    loop = asyncio.get_running_loop()
    worker = CountingWorker()
    pools = NetnsPools(worker)
    path = f"/proc/{pod.pid}/ns/net"
    try:
        with await worker.socket(path, socket.AF_INET) as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(CONNECTIONS)
            listener.setblocking(False)
            port = listener.getsockname()[1]
            worker.calls = 0
            async with asyncio.TaskGroup() as tg:
                tg.create_task(_echo(listener, CONNECTIONS))
                for i in range(CONNECTIONS):
                    maker = pools.for_process(pod.pid, _start_time(pod.pid))
                    assert isinstance(maker, PodSockets)
                    with await ns.connect_in_netns(maker, path, port) as sock:
                        message = f"conn {i}".encode()
                        await loop.sock_sendall(sock, message)
                        assert await loop.sock_recv(sock, 100) == message
                        sock.shutdown(socket.SHUT_WR)
        assert len(pools) == 1
        # One worker call per batch, not per connection (a refill may still be under way).
        assert worker.calls <= CONNECTIONS // POOL_SOCKETS + 2
    finally:
        pools.close()
        worker.close()


@pytest.mark.privileged
@ROOT
async def test_the_pool_goes_when_the_pods_process_exits(pod: subprocess.Popen[str]) -> None:
    worker = ns.NetnsWorker()
    pools = NetnsPools(worker)
    try:
        pool = pools.for_process(pod.pid, _start_time(pod.pid))
        assert isinstance(pool, PodSockets)
        with await pool.socket(f"/proc/{pod.pid}/ns/net", socket.AF_INET):
            pass
        assert pool.ready > 0
        pod.kill()
        pod.wait()  # the fixture's own kill then finds it gone
        for _ in range(int(READY_SECONDS / POLL_SECONDS)):
            if not len(pools):
                break
            await asyncio.sleep(POLL_SECONDS)
        assert len(pools) == 0
        assert pool.ready == 0  # its sockets are closed: nothing pins the namespace
    finally:
        pools.close()
        worker.close()


@pytest.mark.privileged
@ROOT
async def test_a_process_that_is_not_the_pods_gets_no_pool(pod: subprocess.Popen[str]) -> None:
    worker = ns.NetnsWorker()
    pools = NetnsPools(worker)
    try:
        # The pid with another start time: a reused pid, not the pod's process.
        assert pools.for_process(pod.pid, _start_time(pod.pid) + 1) is worker
        assert len(pools) == 0
    finally:
        pools.close()
        worker.close()
