"""What a stream's end leaves behind is freed by reference counting, not left to the cycle
collector (which an idle daemon may not run for hours after a burst of sessions).

Each test runs with the collector disabled and watches, through a weak reference, an object
that only the frames of an ended reader, pump or task hold: it must be gone as soon as the
code under test is done with it. A stored error raised as itself, or a cancelled task's
CancelledError kept with its traceback, would keep those frames (and every chunk they held)
alive. The daemon measure is tests/gateway/test_gateway_streams.py's never-reading pod.
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest
from test_spdy_driver import start_pair, stop_pair

from podgate.aio import heap
from podgate.aio.errors import BrokenStreamError, StreamResetError
from podgate.aio.memory import memory_stream_pair
from podgate.aio.splice import splice
from podgate.aio.streams import DEFAULT_RECEIVE_BYTES, Buffer, ByteStream
from podgate.aio.tasks import cancel_and_wait


class Marker:
    """An object a frame holds, standing in for the chunk a real reader held."""


class Watched(ByteStream):
    """A ByteStream passed through: its frames (and the pump's) reference it."""

    def __init__(self, inner: ByteStream) -> None:
        self.inner = inner

    async def receive(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        return await self.inner.receive(max_bytes)

    async def send(self, data: Buffer) -> None:
        await self.inner.send(data)

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.fixture(autouse=True)
def _no_cycle_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def test_a_reset_stream_does_not_keep_its_readers_frames() -> None:
    pair = await start_pair()
    try:
        client_end, server_end = await pair.open_accepted()

        async def reader(held: Marker) -> None:
            while True:
                await server_end.receive()

        marker = Marker()
        watched = weakref.ref(marker)
        task = asyncio.create_task(reader(marker))
        del marker
        await asyncio.sleep(0)
        client_end.reset()
        await asyncio.wait_for(asyncio.wait([task]), 5.0)
        assert isinstance(task.exception(), StreamResetError)
        del task
        # The server end still stores its reset; the reader's frames went with the task.
        assert watched() is None
        # Raised again for every later call, as before.
        for _ in range(2):
            with pytest.raises(StreamResetError):
                await server_end.receive()
    finally:
        await stop_pair(pair)


async def test_a_broken_session_does_not_keep_the_frames_it_failed() -> None:
    pair = await start_pair()
    try:
        _, server_end = await pair.open_accepted()

        async def reader(held: Marker) -> None:
            while True:
                await server_end.receive()

        marker = Marker()
        watched = weakref.ref(marker)
        task = asyncio.create_task(reader(marker))
        del marker
        await asyncio.sleep(0)
        await pair.client._wire.aclose()  # the connection is lost under the stream
        await asyncio.wait_for(asyncio.wait([task]), 5.0)
        assert isinstance(task.exception(), BrokenStreamError)
        del task
        assert pair.server.broken is not None
        assert watched() is None
    finally:
        await stop_pair(pair)


async def test_a_splice_ended_by_an_error_does_not_keep_its_pumps() -> None:
    a_near, a_far = memory_stream_pair()
    b_near, b_far = memory_stream_pair()
    near = Watched(a_near)
    watched = weakref.ref(near)
    splicing = asyncio.create_task(splice(near, b_near))
    del near
    await a_far.send(b"x" * 1000)
    assert await b_far.receive() == b"x" * 1000
    await a_far.aclose()  # the a side breaks: the splice ends with its error
    result = await asyncio.wait_for(splicing, 5.0)
    assert isinstance(result.error, BrokenStreamError)
    del splicing
    # The error is kept; the pump frames that met it are not.
    assert watched() is None
    await b_far.aclose()


async def test_a_cancelled_helper_task_does_not_keep_its_owner() -> None:
    class Owner:
        def __init__(self) -> None:
            self.helper = asyncio.create_task(self.run())

        async def run(self) -> None:
            await asyncio.Event().wait()

    owner = Owner()
    watched = weakref.ref(owner)
    await asyncio.sleep(0)
    await cancel_and_wait(owner.helper)
    assert owner.helper.cancelled()
    del owner
    assert watched() is None


async def test_the_trim_series_collects_cyclic_garbage(monkeypatch: pytest.MonkeyPatch) -> None:
    """What is left in cycles whatever the code does (a transport and its protocol) is
    collected by the series a session's end starts."""
    monkeypatch.setattr(heap, "TRIM_DELAYS_SECONDS", (0.05,))

    class Node:
        other: Node

    first, second = Node(), Node()
    first.other, second.other = second, first
    watched = weakref.ref(first)
    del first, second
    assert watched() is not None  # a cycle: reference counting alone never frees it
    heap.release_soon()
    await asyncio.sleep(0.3)
    assert watched() is None
