"""Tenant isolation on the gateway's upstream side against containerd 1.6, whose SPDY has no
flow control: a user whose client stops reading must not slow another user's transfer to the
same pod (the runtime can only be slowed down a whole session at a time, so each tenant gets
its own pooled session).

Both rates are measured here, in the same run: the other user's 64 MiB echo alone, then with
the stalled reader holding its connection open; the second must keep at least half the rate
of the first.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import pytest
from containerd_support import Containerd, missing_tools, private_containerd
from e2e_support import free_port

from podgate.aio.spdy import MAX_QUEUED_BYTES_PER_STREAM
from podgate.node.cri_client import CriClient
from podgate.node.upstream import CriTarget, UpstreamStream
from podgate.streaming.target import PodRef

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="containerd and runc need root"),
]

POD, NAMESPACE = "ctrd-iso", "default"
LISTEN_SECONDS = 20.0
# One transfer's bound: far above the second or so 64 MiB take on loopback.
TRANSFER_SECONDS = 120.0
TRANSFER_BYTES = 64 * 1024 * 1024
CHUNK_BYTES = 256 * 1024
MIN_RATE_RATIO = 0.5


@dataclass(frozen=True, slots=True)
class Stack:
    containerd: Containerd
    pod: PodRef
    echo_port: int
    source_port: int


def wait_listening(port: int) -> None:
    deadline = time.monotonic() + LISTEN_SECONDS
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on {port}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    tools, why = missing_tools()
    if tools is None:
        pytest.skip(why)
    with private_containerd(tools) as ctrd:
        echo, source = free_port(), free_port()
        # An echo, and a source that writes for as long as anyone reads (busybox `yes`).
        script = f"nc -ll -p {source} -e yes & exec nc -ll -p {echo} -e cat"
        pod = ctrd.run_pod(POD, NAMESPACE, ["sh", "-c", script])
        ctrd.wait_running(pod.container_id)
        wait_listening(echo)
        wait_listening(source)
        yield Stack(ctrd, PodRef(NAMESPACE, POD, pod.uid, pod.sandbox_id), echo, source)


async def echo_transfer(target: CriTarget, pod: PodRef, port: int) -> float:
    """Connect, then TRANSFER_BYTES through the echo, checked by sha256; the seconds it took
    (the connection's opening included: a session stalled by someone else delays it too)."""
    data = os.urandom(CHUNK_BYTES) * (TRANSFER_BYTES // CHUNK_BYTES)
    started = time.monotonic()
    async with asyncio.timeout(TRANSFER_SECONDS):
        stream = await target.open_port(pod, port)

    async def send() -> None:
        await stream.send(data)
        await stream.send_eof()

    async def receive() -> bytes:
        digest, got = hashlib.sha256(), 0
        while got < len(data):
            chunk = await stream.receive()
            assert chunk, f"EOF after {got} bytes"
            digest.update(chunk)
            got += len(chunk)
        return digest.digest()

    try:
        async with asyncio.timeout(TRANSFER_SECONDS), asyncio.TaskGroup() as tg:
            tg.create_task(send())
            echoed = tg.create_task(receive())
    finally:
        await stream.aclose()
    assert echoed.result() == hashlib.sha256(data).digest()
    return time.monotonic() - started


async def test_a_stalled_reader_does_not_slow_another_tenant(stack: Stack) -> None:
    client = CriClient(str(stack.containerd.socket))
    target = CriTarget(client)
    alice = replace(stack.pod, tenant="alice")
    bob = replace(stack.pod, tenant="bob")
    try:
        solo_seconds = await echo_transfer(target, bob, stack.echo_port)

        stalled = await target.open_port(alice, stack.source_port)
        # Read a little, then stop reading: the runtime keeps sending.
        async with asyncio.timeout(TRANSFER_SECONDS):
            assert await stalled.receive()
        await asyncio.sleep(1.0)  # the source fills the stalled stream's queue meanwhile
        beside_seconds = await echo_transfer(target, bob, stack.echo_port)
        # The stalled stream really was stalled with its queue full.
        assert isinstance(stalled, UpstreamStream)
        queued = stalled._data._queued
        await stalled.aclose()
    finally:
        await target.aclose()
        await client.close()
    ratio = solo_seconds / beside_seconds
    print(
        f"64 MiB echo: {TRANSFER_BYTES / solo_seconds / 2**20:.0f} MiB/s alone, "
        f"{TRANSFER_BYTES / beside_seconds / 2**20:.0f} MiB/s beside a stalled reader "
        f"(ratio {ratio:.2f}); stalled stream held {queued} bytes"
    )
    assert queued >= MAX_QUEUED_BYTES_PER_STREAM
    assert ratio >= MIN_RATE_RATIO
