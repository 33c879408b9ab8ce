"""Exec and attach sessions the proxy serves on its own streaming server (--exec-via-proxy):
each relays to the one-time URL the upstream runtime handed out for that call, and is audited
(one structured line when it starts, one when it ends)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence

from podgate.aio.streams import ByteStream
from podgate.node.upstream import relay_exec
from podgate.proto.remotecommand import ExecOptions
from podgate.streaming.target import ExecIO, PodRef, TargetError

audit = logging.getLogger("podgate.proxy.audit")


def audit_line(**entry: object) -> None:
    audit.info("%s", json.dumps(entry, separators=(",", ":"), default=str))


class RelayTarget:
    """The StreamTarget of one exec or attach: the upstream's URL for that very call."""

    def __init__(self, url: str, container_id: str, options: ExecOptions) -> None:
        self.url = url
        self.container_id = container_id
        # The upstream's server expects exactly the streams its CRI request named.
        self.options = options

    async def exec(
        self, pod: PodRef, container: str | None, command: Sequence[str], io: ExecIO
    ) -> int:
        return await self._run("exec", list(command), io)

    async def attach(self, pod: PodRef, container: str | None, io: ExecIO) -> int:
        return await self._run("attach", None, io)

    async def open_port(self, pod: PodRef, port: int, *, protocol: str = "tcp") -> ByteStream:
        raise TargetError("an exec or attach URL does not port-forward")

    async def _run(self, kind: str, command: list[str] | None, io: ExecIO) -> int:
        started = time.monotonic()
        audit_line(event="stream_started", kind=kind, container=self.container_id, command=command)
        outcome, exit_code = "error", None
        try:
            stdio = ExecIO(
                stdin=io.stdin if self.options.stdin else None,
                stdout=io.stdout if self.options.stdout else None,
                stderr=io.stderr if self.options.stderr else None,
                tty=io.tty,
                resizes=io.resizes,
            )
            want_stderr = self.options.stderr and not self.options.tty
            exit_code = await relay_exec(self.url, stdio, want_stderr=want_stderr)
            outcome = "exited"
            return exit_code
        except TargetError as exc:
            outcome = f"error: {exc}"
            raise
        finally:
            audit_line(
                event="stream_finished",
                kind=kind,
                container=self.container_id,
                command=command,
                outcome=outcome,
                exit_code=exit_code,
                seconds=round(time.monotonic() - started, 3),
            )
