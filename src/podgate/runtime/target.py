"""The runtime as a StreamTarget: exec through runc exec (or nsenter), attach through the
shim, port-forward through the pod's backend; and the same for a gateway in this process."""

from __future__ import annotations

from collections.abc import Sequence

from podgate.aio.errors import StreamError
from podgate.aio.streams import ByteStream
from podgate.backends.base import BackendError, Backends
from podgate.proto.errors import ProtocolError
from podgate.runtime.api import RuntimeError_
from podgate.runtime.attach import run_attach
from podgate.runtime.cri import convert
from podgate.runtime.oci import discard
from podgate.runtime.runtime import Runtime
from podgate.streaming.local import run_process
from podgate.streaming.target import ExecIO, PodRef, TargetError


class RuntimeTarget:
    def __init__(self, runtime: Runtime, backends: Backends) -> None:
        self.runtime = runtime
        self.backends = backends

    async def exec(
        self, pod: PodRef, container: str | None, command: Sequence[str], io: ExecIO
    ) -> int:
        try:
            record = self.runtime.running_container(container or "")
        except RuntimeError_ as exc:
            raise TargetError(str(exc)) from exc
        argv, cleanup = self.runtime.exec_command(record, command, tty=io.tty)
        try:
            return await run_process(argv, io)
        finally:
            if cleanup:
                discard(cleanup)
                discard(f"{cleanup}.error")

    async def attach(self, pod: PodRef, container: str | None, io: ExecIO) -> int:
        try:
            record = self.runtime.running_container(container or "")
        except RuntimeError_ as exc:
            raise TargetError(str(exc)) from exc
        socket_path = str(self.runtime.store.run_path(record.id) / "attach.sock")
        try:
            return await run_attach(socket_path, io)
        except (StreamError, ProtocolError) as exc:
            raise TargetError(f"cannot attach to container {record.id}: {exc}") from exc

    async def open_port(self, pod: PodRef, port: int, *, protocol: str = "tcp") -> ByteStream:
        try:
            record = self.runtime.get_pod(pod.sandbox_id)
            return await self.backends.open(record, port, protocol=protocol)
        except (RuntimeError_, BackendError) as exc:
            raise TargetError(str(exc)) from exc


class InProcessTarget:
    """The runtime as a gateway's StreamTarget in the same process (`podgate up`).

    It stands for the CRI path a gateway takes to any runtime (CRI Exec/Attach/PortForward,
    then a SPDY client session to the one-time URL) without the loopback hop: each stream is
    checked as the CRI call would check it, with the same words on refusal, then handed to
    the RuntimeTarget that the streaming server would have run it on. The gateway's PodRef
    names the sandbox and the container by the runtime's ids, as its CRI pod source gives
    them."""

    def __init__(self, runtime: Runtime, target: RuntimeTarget) -> None:
        self.runtime = runtime
        self.target = target

    async def exec(
        self, pod: PodRef, container: str | None, command: Sequence[str], io: ExecIO
    ) -> int:
        try:
            pending = self.runtime.exec_request(
                _container(container), convert.command(command), **_stdio(io)
            )
        except RuntimeError_ as exc:
            raise TargetError(str(exc)) from exc
        return await self.target.exec(pending.pod, pending.container_id, command, io)

    async def attach(self, pod: PodRef, container: str | None, io: ExecIO) -> int:
        try:
            pending = self.runtime.attach_request(_container(container), **_stdio(io))
        except RuntimeError_ as exc:
            raise TargetError(str(exc)) from exc
        return await self.target.attach(pending.pod, pending.container_id, io)

    async def open_port(self, pod: PodRef, port: int, *, protocol: str = "tcp") -> ByteStream:
        if not pod.sandbox_id:
            raise TargetError(f"pod {pod} has no sandbox")
        if protocol not in ("tcp", "udp"):
            raise TargetError(f"unsupported port-forward protocol {protocol!r}")
        try:
            pending = self.runtime.port_forward_request(pod.sandbox_id)
        except RuntimeError_ as exc:
            raise TargetError(str(exc)) from exc
        return await self.target.open_port(pending.pod, port, protocol=protocol)

    async def aclose(self) -> None:
        """Nothing pooled: every stream is the runtime's own."""


def _container(container: str | None) -> str:
    if not container:
        raise TargetError("no container given")
    return container


def _stdio(io: ExecIO) -> dict[str, bool]:
    """The stdio flags a CRI request would carry for the client's streams (no stderr with a
    tty)."""
    return {
        "tty": io.tty,
        "stdin": io.stdin is not None,
        "stdout": io.stdout is not None,
        "stderr": io.stderr is not None and not io.tty,
    }
