"""What the streaming handlers need from whatever runs pods: the seam below the protocols.

The handlers never see namespaces, runtimes or backends; a target never sees SPDY or WebSocket.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from podgate.aio.streams import ByteStream
from podgate.proto.remotecommand import TerminalSize


@dataclass(frozen=True, slots=True)
class PodRef:
    namespace: str
    name: str
    uid: str = ""
    sandbox_id: str = ""  # the runtime's id, where there is one
    # Who the stream is for, where a gateway knows (it keeps tenants' upstream sessions apart).
    tenant: str = ""

    @property
    def label(self) -> str:
        """How upstream names a pod in error messages: its sandbox id, else its name."""
        return self.sandbox_id or self.name

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(slots=True)
class ExecIO:
    """The client's side of a command's stdio. Unrequested streams are None."""

    stdin: ByteStream | None
    stdout: ByteStream | None
    stderr: ByteStream | None
    tty: bool
    resizes: AsyncIterator[TerminalSize] | None = None


class TargetError(Exception):
    """The target could not do what was asked; the message goes to the client verbatim."""


class StreamTarget(Protocol):
    async def exec(
        self, pod: PodRef, container: str | None, command: Sequence[str], io: ExecIO
    ) -> int:
        """Run `command` in the container with `io` as its stdio; return its exit code."""
        ...

    async def attach(self, pod: PodRef, container: str | None, io: ExecIO) -> int:
        """Connect `io` to the container's main process; return its exit code."""
        ...

    async def open_port(self, pod: PodRef, port: int, *, protocol: str = "tcp") -> ByteStream:
        """A byte stream to `port` inside the pod; TargetError if it cannot be reached.

        For protocol "udp" the stream carries framed datagrams (podgate.proto.datagram) to and
        from a UDP socket connected to the pod's 127.0.0.1:`port`; closing the stream (or its
        EOF) closes that socket."""
        ...
