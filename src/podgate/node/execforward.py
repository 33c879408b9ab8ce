"""Port-forward through CRI Exec, for runtimes whose own port-forward cannot reach the pod:
a forwarder runs in the pod's first running container and its stdin/stdout are the
connection. Works with any CRI runtime that can exec (containerd with any OCI runtime)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Final

from podgate.aio.errors import ClosedStreamError, ForwardError, StreamError
from podgate.aio.memory import memory_stream_pair
from podgate.aio.splice import HALF_CLOSE_GRACE_SECONDS
from podgate.aio.streams import DEFAULT_RECEIVE_BYTES, Buffer, ByteStream
from podgate.forwarders import NO_TOOL, PROBE_SCRIPT, forwarder_argv
from podgate.node.cri_client import CriClient, CriError
from podgate.streaming.client import endpoint_from_url, exec_spdy
from podgate.streaming.target import PodRef, TargetError

# How long the probe for a forwarder may take, seconds (an interpreter start or two).
PROBE_TIMEOUT_SECONDS: Final = 15
# Bytes buffered between the exec session and the forwarded connection, each way.
PIPE_BYTES: Final = 1024 * 1024
# stderr kept for the error message.
STDERR_LIMIT_BYTES: Final = 4096


class ExecForwarder:
    """open_port for CriTarget: one CRI Exec of a forwarder per forwarded connection."""

    def __init__(self, client: CriClient) -> None:
        self.client = client
        self._tools: dict[str, str] = {}  # container id -> the forwarder it has

    async def open_port(self, pod: PodRef, port: int) -> ByteStream:
        container = await self.client.first_running_container(pod.sandbox_id)
        if container is None:
            raise TargetError(f"pod {pod} has no running container to run a forwarder in")
        tool = await self._tool(container)
        url = await self.client.exec_url(
            container,
            forwarder_argv(tool, port, half_close_grace=HALF_CLOSE_GRACE_SECONDS),
            stdin=True,
            stdout=True,
            stderr=True,
        )
        endpoint, path = endpoint_from_url(url)
        ours, theirs = memory_stream_pair(PIPE_BYTES)
        errors, errors_sink = memory_stream_pair(STDERR_LIMIT_BYTES * 4)

        async def run() -> str | None:
            """The forwarder's complaint when it failed, else None."""
            try:
                result = await exec_spdy(
                    endpoint,
                    path,
                    stdin=theirs,
                    stdout=theirs,
                    stderr=errors_sink,
                    want_stdin=True,
                )
            finally:
                with contextlib.suppress(StreamError):
                    await theirs.send_eof()
                await errors_sink.send_eof()
            if result.exit_code == 0:
                return None
            text = b""
            with contextlib.suppress(StreamError):
                while len(text) < STDERR_LIMIT_BYTES and (chunk := await errors.receive()):
                    text += chunk
            return text.decode(errors="replace").strip() or result.error or "forwarder failed"

        task = asyncio.create_task(run(), name=f"exec forward {pod} {port}")
        return ExecForwardStream(ours, task)

    async def _tool(self, container: str) -> str:
        tool = self._tools.get(container)
        if tool is None:
            try:
                out = await self.client.exec_sync(
                    container, ["sh", "-c", PROBE_SCRIPT, "sh", ""], PROBE_TIMEOUT_SECONDS
                )
            except CriError as exc:
                raise TargetError(f"cannot probe the container for a forwarder: {exc}") from exc
            tool = out.strip() or "none"
            self._tools[container] = tool
        if tool == "none":
            raise TargetError(NO_TOOL)
        return tool


# How long a failed connection waits for the forwarder's own explanation of the failure.
FAILURE_WAIT_SECONDS = 2.0


class ExecForwardStream(ByteStream):
    """The connection; a forwarder that failed (e.g. refused port) raises ForwardError with
    what it printed, which the gateway passes on to the client's error stream."""

    def __init__(self, inner: ByteStream, task: asyncio.Task[str | None]) -> None:
        self.inner = inner
        self.task = task

    async def _failure(self) -> None:
        """Raise what the forwarder printed once it ended (a stopped one says nothing)."""
        await asyncio.wait({self.task}, timeout=FAILURE_WAIT_SECONDS)
        if self.task.done() and not self.task.cancelled() and self.task.exception() is None:
            message = self.task.result()
            if message:
                raise ForwardError(message)

    async def receive(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        chunk = await self.inner.receive(max_bytes)
        if not chunk:
            await self._failure()
        return chunk

    async def send(self, data: Buffer) -> None:
        try:
            await self.inner.send(data)
        except ClosedStreamError:
            raise  # our own close or EOF: nothing the forwarder said applies
        except StreamError:
            await self._failure()
            raise

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()
        if not self.task.done():
            self.task.cancel()
        # Wait for the forwarder without taking its cancellation (or failure) as ours.
        await asyncio.wait({self.task})
        if not self.task.cancelled():
            self.task.exception()  # retrieved: its failure was reported on the stream
