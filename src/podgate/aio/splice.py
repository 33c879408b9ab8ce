"""One splice: copy both ways between two ByteStreams, forwarding EOF."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from podgate.aio.errors import StreamError
from podgate.aio.streams import DEFAULT_RECEIVE_BYTES, ByteStream

# After one direction ends, how long the other may go on. A half-closed peer may still be
# answering (request, FIN, response), but not forever; containerd allows 1 s, which cuts slow
# answers, so podgate is more patient.
HALF_CLOSE_GRACE_SECONDS = 60.0


@dataclass(slots=True)
class SpliceResult:
    """Bytes moved each way and the first error that ended the splice, if any."""

    a_to_b: int = 0
    b_to_a: int = 0
    error: BaseException | None = None


async def _pump(src: ByteStream, dst: ByteStream, result: SpliceResult, forward: bool) -> None:
    while True:
        chunk = await src.receive(DEFAULT_RECEIVE_BYTES)
        if not chunk:
            await dst.send_eof()
            return
        await dst.send(chunk)
        if forward:
            result.a_to_b += len(chunk)
        else:
            result.b_to_a += len(chunk)


async def splice(
    a: ByteStream, b: ByteStream, *, grace: float | None = HALF_CLOSE_GRACE_SECONDS
) -> SpliceResult:
    """Copy a→b and b→a until both directions end; close both streams.

    EOF on one side becomes send_eof() on the other. An error in either direction ends both at
    once. After one direction finished cleanly the other gets `grace` seconds (None: unbounded).
    """
    result = SpliceResult()
    pumps = {
        asyncio.create_task(_pump(a, b, result, True), name="splice a->b"),
        asyncio.create_task(_pump(b, a, result, False), name="splice b->a"),
    }
    try:
        await wait_pumps(pumps, result, grace)
    finally:
        # Only the unfinished: awaiting a failed one would raise its error again, giving it
        # a traceback through this frame (and `result`) once more.
        left = [task for task in pumps if not task.done()]
        for task in left:
            task.cancel()
        for task in left:
            with contextlib.suppress(asyncio.CancelledError, StreamError):
                await task
        await asyncio.gather(a.aclose(), b.aclose(), return_exceptions=True)
    return result


async def wait_pumps(
    pumps: set[asyncio.Task[None]],
    result: SpliceResult,
    grace: float | None,
    *,
    watch: asyncio.Task[None] | None = None,
) -> None:
    """Wait until both directions' tasks end, the one left outlives `grace` after the other
    ended cleanly, or one fails: its StreamError goes to `result.error`, anything else is
    raised. A `watch` task's failure ends the wait as a pump's does. The caller cancels what
    is left."""
    pending = set(pumps)
    while pending:
        timeout = grace if len(pending) == 1 else None
        waiting = pending | {watch} if watch is not None else pending
        done, pending = await asyncio.wait(
            waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if watch is not None:
            pending.discard(watch)
        if not done:
            return  # grace ran out
        for task in done:
            exc = task.exception()
            if exc is not None:
                if not isinstance(exc, StreamError):
                    raise exc
                # Kept without its traceback: that holds the pumps' frames, which hold
                # `result` (a cycle keeping their last chunk alive).
                result.error = result.error or exc.with_traceback(None)
        if result.error is not None:
            return
