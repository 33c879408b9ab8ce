"""The runtime as a StreamTarget: exec through runc exec (or nsenter), attach through the
shim, port-forward through the pod's backend."""

from __future__ import annotations

from collections.abc import Sequence

from podgate.aio.errors import StreamError
from podgate.aio.streams import ByteStream
from podgate.backends.base import BackendError, Backends
from podgate.proto.errors import ProtocolError
from podgate.runtime.api import RuntimeError_
from podgate.runtime.attach import run_attach
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
