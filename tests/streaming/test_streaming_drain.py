"""The streaming server's shutdown: it stops accepting at once, lets a stream in progress
finish within the grace period, and cuts one that outlives it."""

from __future__ import annotations

import asyncio

from podgate.aio.memory import memory_stream_pair
from podgate.proto import remotecommand as rc
from podgate.proto.upgrade import StreamKind
from podgate.streaming.client import ExecResult, endpoint_from_url, exec_spdy
from podgate.streaming.local import LocalTarget
from podgate.streaming.target import PodRef
from podgate.streaming.tokenserver import PendingStream, StreamingServer
from udp_support import wait_until

POD = PodRef("default", "drain")


async def _exec(server: StreamingServer, script: str) -> tuple[asyncio.Task[object], bytearray]:
    url = server.url_for(
        PendingStream(
            StreamKind.EXEC,
            POD,
            options=rc.ExecOptions(command=("sh", "-c", script), stdout=True),
        )
    )
    endpoint, path = endpoint_from_url(url)
    ours, theirs = memory_stream_pair()
    received = bytearray()

    async def collect() -> None:
        while chunk := await ours.receive():
            received.extend(chunk)

    async def run() -> object:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(collect())
            result = await exec_spdy(endpoint, path, stdout=theirs)
            await theirs.send_eof()
        return result

    task = asyncio.create_task(run())
    return task, received


async def _started(received: bytearray) -> None:
    await wait_until(lambda: b"started" in received, "the command started", timeout=30)


async def test_a_stream_in_progress_finishes_within_the_grace() -> None:
    server = StreamingServer(LocalTarget())
    await server.start()
    task, received = await _exec(server, "echo started; sleep 1; echo finished")
    await _started(received)
    await server.stop(grace=30)
    result = await asyncio.wait_for(task, 30)
    assert received == b"started\nfinished\n"
    assert getattr(result, "exit_code", None) == 0
    # No longer accepting: a new connection is refused.
    try:
        _, writer = await asyncio.open_connection(server.host, server.port)
    except OSError:
        pass
    else:
        writer.close()
        raise AssertionError("the stopped server still accepts connections")


async def test_a_stream_that_outlives_the_grace_is_cut() -> None:
    server = StreamingServer(LocalTarget())
    await server.start()
    task, received = await _exec(server, "echo started; sleep 600; echo finished")
    await _started(received)
    loop = asyncio.get_running_loop()
    began = loop.time()
    await server.stop(grace=0.5)
    # Cut: the client's exec ends (with an error or a non-zero result), well before 600 s.
    done, _ = await asyncio.wait({task}, timeout=60)
    assert task in done
    assert loop.time() - began < 60
    assert b"finished" not in received
    # The client reads an error, never a clean end.
    if task.exception() is None:
        result = task.result()
        assert isinstance(result, ExecResult)
        assert result.exit_code != 0
        assert result.error is not None and "shutting down" in result.error
