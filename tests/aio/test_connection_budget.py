"""The bytes a process buffers for its connections: one budget, shared by the busy ones.

Real sockets (socket pairs) and the real SocketStream; what each connection holds unread is
read from its protocol. Senders push far more than any buffer holds, so every receiver that
does not read stops at its limit and the rest waits in the kernel (TCP backpressure).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
from collections.abc import AsyncIterator

import pytest

from podgate.aio import budget
from podgate.aio.budget import ConnectionBudget, connection_budget, set_connection_budget
from podgate.aio.errors import StreamError
from podgate.aio.streams import DEFAULT_RECEIVE_BYTES, SocketStream
from podgate.aio.tasks import cancel_and_wait

KIB = 1024
MIB = 1024 * KIB
# The test's budget: 16 busy receivers of 128 KiB each; one alone gets the ceiling (1 MiB).
TOTAL = 2 * MIB
CONNECTIONS = 16
PUSH = 4 * MIB  # what each sender tries to send: far more than any buffer
SETTLE_SECONDS = 1.0
HANG_GUARD_SECONDS = 60.0


@pytest.fixture
async def small_budget() -> AsyncIterator[ConnectionBudget]:
    loop = asyncio.get_running_loop()
    before = connection_budget(loop)
    small = ConnectionBudget(TOTAL, floor=64 * KIB, ceiling=1 * MIB)
    set_connection_budget(small, loop)
    try:
        yield small
    finally:
        set_connection_budget(before, loop)


async def stream_pair() -> tuple[SocketStream, SocketStream]:
    a, b = socket.socketpair()
    return await SocketStream.from_socket(a), await SocketStream.from_socket(b)


def held(stream: SocketStream) -> int:
    """Bytes received by `stream` and not read yet."""
    return stream._protocol._buffered


async def push(stream: SocketStream, size: int) -> None:
    with contextlib.suppress(StreamError):
        await stream.send(bytes(size))


async def test_busy_connections_together_stay_within_the_process_budget(
    small_budget: ConnectionBudget,
) -> None:
    """16 connections whose readers do not read hold about the budget together (each its
    share and at most one share-sized read more), not 16 fixed buffers of 1 MiB."""
    pairs = [await stream_pair() for _ in range(CONNECTIONS)]
    tasks: list[asyncio.Task[None]] = []
    try:
        # Every connection holds a byte first: all 16 count as busy before the flood.
        for sender, _ in pairs:
            await sender.send(b"x")
        async with asyncio.timeout(HANG_GUARD_SECONDS):
            while sum(held(r) for _, r in pairs) < CONNECTIONS:  # noqa: ASYNC110 - no event
                await asyncio.sleep(0.01)
        share = TOTAL // CONNECTIONS
        tasks = [asyncio.create_task(push(s, PUSH)) for s, _ in pairs]
        await asyncio.sleep(SETTLE_SECONDS)
        total = sum(held(r) for _, r in pairs)
        most = max(held(r) for _, r in pairs)
        print(f"{CONNECTIONS} connections hold {total / MIB:.2f} MiB, at most {most} bytes each")
        assert most <= 2 * share
        assert total <= 2 * TOTAL
        assert small_budget.busy == CONNECTIONS
        assert small_budget.share() == share
        # Backpressure, not loss: everything arrives once read.
        async with asyncio.timeout(HANG_GUARD_SECONDS):
            for _, receiver in pairs:
                got = 0
                while got < PUSH + 1:
                    chunk = await receiver.receive()
                    assert chunk
                    got += len(chunk)
                assert got == PUSH + 1
    finally:
        await cancel_and_wait(*tasks)
        for sender, receiver in pairs:
            await sender.aclose()
            await receiver.aclose()
    assert small_budget.busy == 0


async def test_a_lone_connection_keeps_its_full_buffers(small_budget: ConnectionBudget) -> None:
    """Alone it may hold the ceiling (1 MiB) and read DEFAULT_RECEIVE_BYTES at once: one
    transfer keeps the buffers the fixed marks gave it."""
    sender, receiver = await stream_pair()
    task = asyncio.create_task(push(sender, PUSH))
    try:
        await asyncio.sleep(SETTLE_SECONDS)
        assert small_budget.share() == small_budget.ceiling
        assert held(receiver) >= budget.MAX_SHARE_BYTES
        assert len(receiver._protocol.get_buffer(-1)) == DEFAULT_RECEIVE_BYTES  # a read's size
    finally:
        await cancel_and_wait(task)
        await sender.aclose()
        await receiver.aclose()


async def test_a_never_reading_peer_does_not_stall_another_connection(
    small_budget: ConnectionBudget,
) -> None:
    """Connections nobody reads hold their shares; another connection still moves its bytes
    (checked by sha256), within its own share."""
    stalled = [await stream_pair() for _ in range(CONNECTIONS)]
    sender, receiver = await stream_pair()
    tasks = [asyncio.create_task(push(s, PUSH)) for s, _ in stalled]
    try:
        await asyncio.sleep(SETTLE_SECONDS)
        assert sum(held(r) for _, r in stalled) > 0
        payload = hashlib.sha256(b"seed").digest() * (PUSH // 32)
        writer = asyncio.create_task(sender.send(payload))
        digest, got, most = hashlib.sha256(), 0, 0
        async with asyncio.timeout(HANG_GUARD_SECONDS):
            while got < len(payload):
                most = max(most, held(receiver))
                chunk = await receiver.receive()
                assert chunk
                digest.update(chunk)
                got += len(chunk)
            await writer
        assert digest.digest() == hashlib.sha256(payload).digest()
        assert most <= 2 * small_budget.share()
    finally:
        await cancel_and_wait(*tasks)
        for a, b in [*stalled, (sender, receiver)]:
            await a.aclose()
            await b.aclose()
