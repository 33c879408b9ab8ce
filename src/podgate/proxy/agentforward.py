"""Port-forward through podgate's in-sandbox agent, for sandboxes that run one: call the
agent's ttrpc PortForward (service podgate.agent.v1.Agent) on its socket, and accept the one
connection it dials back on a unix socket (the hybrid-vsock form `UDS_<port>` a VMM gives a
guest's dial to the host, or the agent's `--host hvsock://UDS` outside a VM).

The agent dials the port inside the sandbox, where the pod's listeners are, so TCP and UDP
both work (UDP as framed datagrams on the dial-back connection).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
from pathlib import Path
from typing import Final

from podgate.agent.agent_pb2 import PortForwardRequest, PortForwardResponse
from podgate.aio.errors import ConnectError
from podgate.aio.streams import ByteStream, SocketStream
from podgate.aio.ttrpc import TtrpcClient
from podgate.proto.ttrpc import TtrpcError
from podgate.streaming.target import PodRef, TargetError

AGENT_SERVICE: Final = "podgate.agent.v1.Agent"
# The agent replies after both connections are up: its dial inside plus its dial-back.
CALL_TIMEOUT_SECONDS: Final = 30.0
# The dial-back arrives before the reply; this bounds a lost one.
ACCEPT_TIMEOUT_SECONDS: Final = 10.0
# Dial-back ports are picked at random from the unprivileged vsock range.
_MIN_PORT: Final = 1024
_PORT_SPAN: Final = (1 << 31) - _MIN_PORT


class AgentForwarder:
    """open_port through the agent of the pod's sandbox; `socket_template` names the agent's
    ttrpc socket ({sandbox_id} is replaced), `dialback` the prefix the agent dials back to."""

    def __init__(self, socket_template: str, dialback: str) -> None:
        self.socket_template = socket_template
        self.dialback = dialback

    def agent_socket(self, pod: PodRef) -> Path:
        return Path(self.socket_template.replace("{sandbox_id}", pod.sandbox_id))

    def has_agent(self, pod: PodRef) -> bool:
        return self.agent_socket(pod).exists()

    async def open_port(self, pod: PodRef, port: int, protocol: str = "tcp") -> ByteStream:
        vsock_port = _MIN_PORT + secrets.randbelow(_PORT_SPAN)
        path = f"{self.dialback}_{vsock_port}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            listener.bind(path)
            listener.listen(1)
            listener.setblocking(False)
            accepted = asyncio.ensure_future(asyncio.get_running_loop().sock_accept(listener))
            try:
                await self._call(pod, port, vsock_port, protocol)
                async with asyncio.timeout(ACCEPT_TIMEOUT_SECONDS):
                    conn, _ = await accepted
            except TimeoutError:
                raise TargetError(f"the sandbox agent of pod {pod} did not dial back") from None
            finally:
                accepted.cancel()
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await accepted
        finally:
            listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        return await SocketStream.from_socket(conn)

    async def _call(self, pod: PodRef, port: int, vsock_port: int, protocol: str) -> None:
        # The pod's containers share its network: the sandbox id names it in the agent's logs.
        request = PortForwardRequest(
            container_id=pod.sandbox_id,
            port=port,
            vsock_port=vsock_port,
            protocol="" if protocol == "tcp" else protocol,
        )
        try:
            client = await TtrpcClient.connect_unix(self.agent_socket(pod), name=f"agent {pod}")
        except (ConnectError, OSError) as exc:
            raise TargetError(f"the sandbox agent of pod {pod} is not running: {exc}") from exc
        try:
            reply = await client.call(
                AGENT_SERVICE,
                "PortForward",
                request.SerializeToString(),
                timeout=CALL_TIMEOUT_SECONDS,
            )
        except TtrpcError as exc:  # TtrpcClosedError too: the agent went away
            raise TargetError(exc.message) from exc
        finally:
            await client.aclose()
        if protocol == "udp" and PortForwardResponse.FromString(reply).protocol != "udp":
            raise TargetError(f"the sandbox agent of pod {pod} cannot forward UDP")
