"""PipeOutput on real pipes and a real writer process: what is there goes out at once, what
piled up goes out together, a slow consumer stops the reads, every byte arrives."""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys

from podgate.streaming.pipeout import OUTPUT_BUFFER_BYTES, OUTPUT_READ_BYTES, PipeOutput

# Generous: a loaded machine is slow, but a read that never comes must fail, not hang.
READ_TIMEOUT_SECONDS = 30.0
# How long the slow-consumer test lets the reader run without taking anything.
PILE_UP_SECONDS = 0.5
POLL_SECONDS = 0.01
WRITER_BYTES = 4 * OUTPUT_BUFFER_BYTES


async def _read(pipe: PipeOutput) -> bytes:
    async with asyncio.timeout(READ_TIMEOUT_SECONDS):
        return bytes(await pipe.read())


async def test_a_single_byte_is_handed_over_without_waiting_for_more() -> None:
    r, w = os.pipe()
    pipe = PipeOutput(r)
    try:
        os.write(w, b"x")  # one keystroke's echo, and nothing after it
        assert await _read(pipe) == b"x"
        os.write(w, b"y")
        assert await _read(pipe) == b"y"
    finally:
        pipe.stop()
        os.close(r)
        os.close(w)


async def test_what_piled_up_comes_out_in_one_read_then_eof() -> None:
    r, w = os.pipe()
    pipe = PipeOutput(r)
    try:
        for _ in range(1000):
            os.write(w, b"a\n")  # line by line, as a shell's echo writes
        os.close(w)
        assert await _read(pipe) == b"a\n" * 1000
        assert await _read(pipe) == b""
        assert await _read(pipe) == b""  # EOF stays EOF
    finally:
        pipe.stop()
        os.close(r)


async def test_a_slow_consumer_stops_the_reads_and_loses_nothing() -> None:
    r, w = os.pipe()
    writer = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        f"import os; data = os.urandom({WRITER_BYTES}); os.write(2, __import__('hashlib')"
        ".sha256(data).hexdigest().encode()); "
        "view = memoryview(data)\nwhile view: view = view[os.write(1, view):]",
        stdout=w,
        stderr=asyncio.subprocess.PIPE,
    )
    os.close(w)
    pipe = PipeOutput(r)
    try:
        for _ in range(int(READ_TIMEOUT_SECONDS / POLL_SECONDS)):  # nobody takes the output
            if pipe.buffered >= OUTPUT_BUFFER_BYTES:
                break
            await asyncio.sleep(POLL_SECONDS)
        assert pipe.buffered >= OUTPUT_BUFFER_BYTES  # the buffer filled up to its limit
        await asyncio.sleep(PILE_UP_SECONDS)  # the loop runs on: no read may add more
        assert pipe.buffered <= OUTPUT_BUFFER_BYTES + OUTPUT_READ_BYTES
        assert writer.returncode is None  # blocked on its full pipe
        received = hashlib.sha256()
        total = 0
        while chunk := await _read(pipe):
            received.update(chunk)
            total += len(chunk)
        assert total == WRITER_BYTES
        assert writer.stderr is not None
        sent = (await writer.stderr.read()).decode()
        assert received.hexdigest() == sent
        assert await writer.wait() == 0
    finally:
        pipe.stop()
        os.close(r)
        if writer.returncode is None:
            writer.kill()
            await writer.wait()


async def test_stop_ends_a_pending_read() -> None:
    r, w = os.pipe()
    pipe = PipeOutput(r)
    try:
        pending = asyncio.ensure_future(pipe.read())
        await asyncio.sleep(0)
        pipe.stop()
        async with asyncio.timeout(READ_TIMEOUT_SECONDS):
            assert await pending == b""
    finally:
        os.close(r)
        os.close(w)
