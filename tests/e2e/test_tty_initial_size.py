"""The first terminal size must reach the pty before the command runs.

kubectl sends the local terminal's size as the first resize event of every `exec -t` and
`attach -t` (kubectl-api-surface.md §6.1: "The first message with -t is a resize on channel 4"),
but it travels separately from the upgrade: over WebSocket the server may start the command
before the message arrives, and how long that takes is the network's latency. A command that
reads its size at once (`stty size`, a full-screen program's first draw) must still see it.
Here the size arrives 50 ms after the session starts, as it would across a real network.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from podgate.aio.memory import memory_stream_pair
from podgate.proto.remotecommand import TerminalSize
from podgate.streaming.local import LocalTarget
from podgate.streaming.target import ExecIO, PodRef

pytestmark = pytest.mark.e2e

# When the client's first resize arrives after the session started: one network round trip.
FIRST_RESIZE_DELAY_SECONDS = 0.05
# Bound on the whole command.
RUN_TIMEOUT_SECONDS = 10.0
ROWS, COLS = 40, 120


async def sizes_after_delay(ended: asyncio.Event) -> AsyncIterator[TerminalSize]:
    """One size, a little late; then the stream stays open while the session lasts."""
    await asyncio.sleep(FIRST_RESIZE_DELAY_SECONDS)
    yield TerminalSize(width=COLS, height=ROWS)
    await ended.wait()


async def test_command_sees_the_first_size() -> None:
    ours, theirs = memory_stream_pair()
    ended = asyncio.Event()
    io = ExecIO(stdin=None, stdout=theirs, stderr=None, tty=True, resizes=sizes_after_delay(ended))

    async def collect() -> bytes:
        out = bytearray()
        while chunk := await ours.receive():
            out += chunk
        return bytes(out)

    async def run() -> int:
        try:
            return await LocalTarget().exec(PodRef("default", "demo"), None, ["stty", "size"], io)
        finally:
            ended.set()
            await theirs.send_eof()

    async with asyncio.timeout(RUN_TIMEOUT_SECONDS):
        code, output = await asyncio.gather(run(), collect())
    assert code == 0
    assert output == b"%d %d\r\n" % (ROWS, COLS)
