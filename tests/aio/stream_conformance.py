"""The ByteStream contract as executable checks (after trio's testing/_check_streams.py).

Every check takes `(a, b)`: `a` is the stream under test, `b` a connected peer (of any kind).
The contract, as podgate's layers rely on it:

- receive() returns b"" once the peer finished sending, and again on every later call;
  receive(max_bytes) never returns more than max_bytes.
- send() after our send_eof() or aclose() raises ClosedStreamError; receive() after aclose()
  raises ClosedStreamError. send_eof() and aclose() are idempotent.
- aclose() wakes a task blocked in receive() (ClosedStreamError) or send() (a StreamError).
- send() waits while the peer does not read (backpressure, never unbounded buffering).
- bytes, bytearray and memoryview are all accepted; 16 MiB arrive intact.
- A cancelled receive() loses nothing: the stream stays usable. A cancelled send() leaves the
  stream cleanly breakable: aclose() still completes promptly.
- Two tasks receiving (or sending) at once: the second gets BusyStreamError at once.
- Either direction can be finished first while the other keeps flowing.
- A peer that goes away ends our receive() with b"" or BrokenStreamError, never a hang.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import random
from collections.abc import Awaitable, Callable

import pytest

from podgate.aio.errors import BusyStreamError, ClosedStreamError, StreamError
from podgate.aio.streams import ByteStream

Check = Callable[[ByteStream, ByteStream], Awaitable[None]]

# Generous bound for what happens "at once" on loopback, on a loaded 2-core machine.
PROMPT_SECONDS = 10.0
# How long a task is given to block before we treat it as blocked (it must not finish).
SETTLE_SECONDS = 0.3
# A send larger than every buffer between the two ends (socket buffers, stream queues,
# session windows), so a peer that does not read makes it wait.
BLOCKING_SEND_BYTES = 32 * 1024 * 1024
LARGE_SEND_BYTES = 16 * 1024 * 1024
HALF_CLOSE_BYTES = 1024 * 1024


@functools.cache
def payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


async def receive_all(stream: ByteStream) -> bytes:
    parts = []
    async with asyncio.timeout(PROMPT_SECONDS):
        while chunk := await stream.receive():
            parts.append(chunk)
    return b"".join(parts)


async def receive_exactly(stream: ByteStream, size: int) -> bytes:
    parts = []
    got = 0
    async with asyncio.timeout(PROMPT_SECONDS):
        while got < size:
            chunk = await stream.receive()
            assert chunk, f"EOF after {got} of {size} bytes"
            parts.append(chunk)
            got += len(chunk)
    return b"".join(parts)


async def blocked(coro: Awaitable[None]) -> asyncio.Task[None]:
    """Start `coro` and return its task once it is waiting (it must not have finished)."""

    async def run() -> None:
        await coro

    task = asyncio.create_task(run())
    await asyncio.sleep(SETTLE_SECONDS)
    assert not task.done(), f"expected to block, but it ended: {task}"
    return task


async def finished(task: asyncio.Task[None]) -> BaseException | None:
    async with asyncio.timeout(PROMPT_SECONDS):
        await asyncio.wait({task})
    return task.exception()


# -- the checks


async def check_eof_received(a: ByteStream, b: ByteStream) -> None:
    await b.send(b"hello")
    await b.send_eof()
    assert await receive_all(a) == b"hello"
    assert await a.receive() == b""  # and again: EOF is sticky


async def check_eof_sent(a: ByteStream, b: ByteStream) -> None:
    await a.send(b"hello")
    await a.send_eof()
    assert await receive_all(b) == b"hello"


async def check_max_bytes(a: ByteStream, b: ByteStream) -> None:
    await b.send(b"0123456789")
    got = b""
    async with asyncio.timeout(PROMPT_SECONDS):
        while len(got) < 10:
            chunk = await a.receive(3)
            assert 0 < len(chunk) <= 3
            got += chunk
    assert got == b"0123456789"


async def check_empty_send(a: ByteStream, b: ByteStream) -> None:
    await a.send(b"")  # sends nothing, and is no EOF
    await a.send(b"x")
    assert await receive_exactly(b, 1) == b"x"


async def check_send_after_send_eof(a: ByteStream, b: ByteStream) -> None:
    await a.send_eof()
    await a.send_eof()  # idempotent
    with pytest.raises(ClosedStreamError):
        await a.send(b"late")


async def check_use_after_close(a: ByteStream, b: ByteStream) -> None:
    await a.aclose()
    await a.aclose()  # idempotent
    with pytest.raises(ClosedStreamError):
        await a.send(b"late")
    with pytest.raises(ClosedStreamError):
        await a.receive()


async def check_aclose_wakes_receiver(a: ByteStream, b: ByteStream) -> None:
    task = await blocked(a.receive())  # type: ignore[arg-type]
    await a.aclose()
    assert isinstance(await finished(task), ClosedStreamError)


async def check_backpressure_and_aclose_wakes_sender(a: ByteStream, b: ByteStream) -> None:
    task = await blocked(a.send(payload(BLOCKING_SEND_BYTES, 1)))
    await a.aclose()
    assert isinstance(await finished(task), StreamError)


async def check_large_send(a: ByteStream, b: ByteStream) -> None:
    data = payload(LARGE_SEND_BYTES, 2)
    reader = asyncio.create_task(receive_exactly(b, len(data)))
    await a.send(data)
    assert hashlib.sha256(await reader).digest() == hashlib.sha256(data).digest()
    back = payload(LARGE_SEND_BYTES, 3)
    reader = asyncio.create_task(receive_exactly(a, len(back)))
    await b.send(back)
    assert hashlib.sha256(await reader).digest() == hashlib.sha256(back).digest()


async def check_buffer_types(a: ByteStream, b: ByteStream) -> None:
    raw = bytearray(payload(300_000, 4))
    await a.send(bytearray(b"ba:"))
    await a.send(memoryview(raw)[1000:200_000])  # a slice: offset and length both matter
    await a.send(memoryview(b"-mv"))
    want = b"ba:" + bytes(raw[1000:200_000]) + b"-mv"
    assert await receive_exactly(b, len(want)) == want


async def check_cancel_receive(a: ByteStream, b: ByteStream) -> None:
    task = await blocked(a.receive())  # type: ignore[arg-type]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await b.send(b"after")
    assert await receive_exactly(a, 5) == b"after"


async def check_cancel_send(a: ByteStream, b: ByteStream) -> None:
    task = await blocked(a.send(payload(BLOCKING_SEND_BYTES, 5)))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    async with asyncio.timeout(PROMPT_SECONDS):
        await a.aclose()


async def check_concurrent_receive(a: ByteStream, b: ByteStream) -> None:
    first = asyncio.create_task(a.receive())
    await asyncio.sleep(SETTLE_SECONDS)
    with pytest.raises(BusyStreamError):
        await a.receive()
    await b.send(b"x")
    async with asyncio.timeout(PROMPT_SECONDS):
        assert await first == b"x"


async def check_concurrent_send(a: ByteStream, b: ByteStream) -> None:
    task = await blocked(a.send(payload(BLOCKING_SEND_BYTES, 6)))
    with pytest.raises(BusyStreamError):
        await a.send(b"interleaved")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _answer(sender: ByteStream, receiver: ByteStream, data: bytes) -> bytes:
    """`data` then EOF from sender, read concurrently (it may exceed every buffer)."""

    async def send() -> None:
        await sender.send(data)
        await sender.send_eof()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(send())
        got = tg.create_task(receive_all(receiver))
    return got.result()


async def check_half_close_ours_first(a: ByteStream, b: ByteStream) -> None:
    await a.send(b"req")
    await a.send_eof()
    assert await receive_all(b) == b"req"
    answer = payload(HALF_CLOSE_BYTES, 7)
    assert await _answer(b, a, answer) == answer


async def check_half_close_theirs_first(a: ByteStream, b: ByteStream) -> None:
    await b.send(b"req")
    await b.send_eof()
    assert await receive_all(a) == b"req"
    answer = payload(HALF_CLOSE_BYTES, 8)
    assert await _answer(a, b, answer) == answer


async def check_peer_gone(a: ByteStream, b: ByteStream) -> None:
    await b.aclose()
    try:
        async with asyncio.timeout(PROMPT_SECONDS):
            while await a.receive():
                pass
    except StreamError as exc:
        assert not isinstance(exc, ClosedStreamError), "peer gone is not *our* close"


CHECKS: dict[str, Check] = {
    name.removeprefix("check_"): fn
    for name, fn in dict(globals()).items()
    if name.startswith("check_") and callable(fn)
}
