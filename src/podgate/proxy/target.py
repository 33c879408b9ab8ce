"""The StreamTarget behind the proxy's port-forward URLs: the pod's sandbox agent where one is
configured and running, else a forwarder run through the upstream's Exec (TCP only)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from podgate.aio.streams import ByteStream
from podgate.node.upstream import CriTarget
from podgate.proxy.agentforward import AgentForwarder
from podgate.streaming.target import ExecIO, PodRef, TargetError

log = logging.getLogger(__name__)


class ProxyTarget:
    def __init__(self, exec_target: CriTarget, agent: AgentForwarder | None = None) -> None:
        self.exec_target = exec_target
        self.agent = agent

    async def exec(
        self, pod: PodRef, container: str | None, command: Sequence[str], io: ExecIO
    ) -> int:
        return await self.exec_target.exec(pod, container, command, io)

    async def attach(self, pod: PodRef, container: str | None, io: ExecIO) -> int:
        return await self.exec_target.attach(pod, container, io)

    async def open_port(self, pod: PodRef, port: int, *, protocol: str = "tcp") -> ByteStream:
        if protocol not in ("tcp", "udp"):
            raise TargetError(f"unsupported port-forward protocol {protocol!r}")
        if self.agent is not None and self.agent.has_agent(pod):
            log.debug("port-forward pod=%s port=%d/%s via=agent", pod, port, protocol)
            return await self.agent.open_port(pod, port, protocol)
        log.debug("port-forward pod=%s port=%d/%s via=exec", pod, port, protocol)
        return await self.exec_target.open_port(pod, port, protocol=protocol)

    async def aclose(self) -> None:
        await self.exec_target.aclose()
