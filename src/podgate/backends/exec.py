"""Port-forward by running a forwarder inside the pod's first running container (the fallback
containerd #6638 and Windows' wincat use): its stdin and stdout are the connection.

The first of these the container has is used (one probe per container, then remembered):
`python -m podgate agent forward PORT` (where podgate is importable there: containers sharing
the host's filesystem), `socat`, `busybox nc`, and a few lines of `python3`.

UDP is not offered: a forwarder's stdio is a single byte stream and none of these tools frames
datagrams on it, so a UDP forward is BackendUnavailableError (the next backend may do it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Coroutine, Sequence
from typing import Final, Protocol, TypeVar

from podgate.aio.errors import ClosedStreamError, ConflictGuard, ForwardError
from podgate.aio.splice import HALF_CLOSE_GRACE_SECONDS
from podgate.aio.streams import CLOSE_FLUSH_SECONDS, DEFAULT_RECEIVE_BYTES, Buffer, ByteStream
from podgate.backends.base import BackendUnavailableError
from podgate.forwarders import NO_TOOL, PROBE_SCRIPT, forwarder_argv
from podgate.model import ContainerRecord, ContainerState, PodRecord
from podgate.proto.portforward import forward_error_message

# How long the probe for a forwarder may take (an interpreter start or two), seconds.
PROBE_TIMEOUT_SECONDS: Final = 15.0
# At EOF of the forwarder's stdout, how long to wait for it to exit and say whether it failed
# (a refused connect exits at once; a half-closed one keeps running), seconds.
EXIT_CHECK_SECONDS: Final = 0.2
# After our side closes, how long the forwarder may take to exit before SIGKILL, seconds.
EXIT_WAIT_SECONDS: Final = 2.0
# stderr kept for the error message; a forwarder says what went wrong in a line or two.
STDERR_LIMIT_BYTES: Final = 4096
# Containers whose probe result is remembered; past this the memory starts over.
TOOL_CACHE_ENTRIES: Final = 4096

UDP_UNSUPPORTED: Final = "UDP port-forward is not supported by the exec backend"


class ExecRuntime(Protocol):
    def pod_containers(self, pod_id: str) -> list[ContainerRecord]: ...

    def exec_argv(self, container: ContainerRecord, command: Sequence[str]) -> list[str]: ...


class ExecBackend:
    name = "exec"

    def __init__(self, runtime: ExecRuntime, *, interpreter: str = sys.executable) -> None:
        self.runtime = runtime
        # Tried before the container's python3: the runtime's own, which has podgate, is there
        # for containers that share the host's filesystem.
        self.interpreter = interpreter
        self._tools: dict[str, str] = {}  # container id -> what the probe found

    async def open(self, pod: PodRecord, port: int, protocol: str = "tcp") -> ByteStream:
        if protocol != "tcp":
            # A forwarder's stdio is one byte stream; none of the tools frames datagrams.
            raise BackendUnavailableError(UDP_UNSUPPORTED)
        running = [
            c
            for c in self.runtime.pod_containers(pod.id)
            if c.state is ContainerState.RUNNING and c.process is not None
        ]
        if not running:
            raise BackendUnavailableError(
                f"no running container in pod {pod.id} to run a port-forward tool in"
            )
        container = running[0]
        tool = self._tools.get(container.id)
        if tool is None:
            tool = await self._probe(container)
            if len(self._tools) >= TOOL_CACHE_ENTRIES:
                self._tools.clear()
            self._tools[container.id] = tool
        if tool == "none":
            raise BackendUnavailableError(NO_TOOL)
        process = await asyncio.create_subprocess_exec(
            *self.runtime.exec_argv(
                container, forwarder_argv(tool, port, half_close_grace=HALF_CLOSE_GRACE_SECONDS)
            ),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            limit=DEFAULT_RECEIVE_BYTES,
        )
        label = f"{tool.split()[0]} in container {container.metadata.name}"
        return ProcessStream(
            process, label, forward_error_message(port, pod.id, pod.metadata.uid, "")
        )

    async def _probe(self, container: ContainerRecord) -> str:
        argv = self.runtime.exec_argv(
            container, ["sh", "-c", PROBE_SCRIPT, "probe", self.interpreter]
        )
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_SECONDS):
                out, _ = await process.communicate()
        except TimeoutError:
            _kill_group(process)
            await process.wait()
            return "none"
        lines = out.decode(errors="replace").splitlines()
        return lines[-1].strip() if process.returncode == 0 and lines else "none"


_T = TypeVar("_T")


def _kill_group(process: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


class ProcessStream(ByteStream):
    """A forwarder's stdout/stdin as a byte stream; a forwarder that fails becomes a
    ForwardError carrying what it printed on stderr."""

    def __init__(self, process: asyncio.subprocess.Process, label: str, prefix: str) -> None:
        assert process.stdin and process.stdout and process.stderr
        self._process = process
        self._stdin = process.stdin
        self._stdout = process.stdout
        self._label = label
        self._prefix = prefix  # "error forwarding port P to pod ID, uid UID: "
        self._stderr = bytearray()
        # Owned by this stream: awaited (or cut) in aclose.
        self._stderr_task = asyncio.create_task(
            self._read_stderr(process.stderr), name=f"{label} stderr"
        )
        self._closed = False
        self._eof_sent = False
        self._ended = asyncio.Event()  # set by aclose(): wakes a blocked receive() or send()
        self._receiving = ConflictGuard("receiving")
        self._sending = ConflictGuard("sending")

    async def _read_stderr(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(STDERR_LIMIT_BYTES):
            self._stderr += chunk[: STDERR_LIMIT_BYTES - len(self._stderr)]

    async def _failure(self, wait: float) -> ForwardError | None:
        """The forwarder's failure once it has exited non-zero within `wait` seconds."""
        try:
            async with asyncio.timeout(wait):
                code = await self._process.wait()
                await self._stderr_task
        except TimeoutError:
            return None
        if code == 0:
            return None
        said = self._stderr.decode(errors="replace").strip() or f"exit status {code}"
        return ForwardError(f"{self._prefix}{self._label}: {said}")

    async def receive(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        with self._receiving:
            chunk = await self._unless_closed(self._stdout.read(max_bytes))
            if not chunk and (failure := await self._failure(EXIT_CHECK_SECONDS)) is not None:
                raise failure
            return chunk

    async def send(self, data: Buffer) -> None:
        with self._sending:
            if self._eof_sent:
                raise ClosedStreamError("write after EOF")
            try:
                if self._closed:
                    raise ClosedStreamError("stream is closed")
                self._stdin.write(data)
                await self._unless_closed(self._stdin.drain())
            except (BrokenPipeError, ConnectionResetError) as exc:
                failure = await self._failure(EXIT_WAIT_SECONDS)
                raise failure or ForwardError(f"{self._prefix}{self._label}: {exc}") from exc

    async def _unless_closed(self, io: Coroutine[object, object, _T]) -> _T:
        """`io`, unless aclose() comes first (then ClosedStreamError, as every ByteStream)."""
        if self._closed:
            io.close()
            raise ClosedStreamError("stream is closed")
        task = asyncio.ensure_future(io)
        ended = asyncio.ensure_future(self._ended.wait())
        try:
            await asyncio.wait({task, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            raise ClosedStreamError("stream is closed")
        return task.result()

    async def send_eof(self) -> None:
        self._eof_sent = True
        if not self._stdin.is_closing():
            self._stdin.close()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            await self._stdin.wait_closed()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._ended.set()
        self._eof_sent = True
        self._stdin.close()
        try:
            # What completed sends queued may flush; a forwarder that stopped reading is not
            # waited for (its unsent input is dropped).
            async with asyncio.timeout(CLOSE_FLUSH_SECONDS):
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    await self._stdin.wait_closed()
        except TimeoutError:
            self._stdin.transport.abort()
        try:
            async with asyncio.timeout(EXIT_WAIT_SECONDS):
                await self._process.wait()
        except TimeoutError:
            _kill_group(self._process)
            await self._process.wait()
        # stderr ends with the process unless a child of it holds the pipe: then cut it.
        await asyncio.wait({self._stderr_task}, timeout=EXIT_WAIT_SECONDS)
        self._stderr_task.cancel()
        await asyncio.wait({self._stderr_task})
