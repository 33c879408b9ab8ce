"""The CRI proxy: a gRPC server on the kubelet's side, the upstream runtime behind it, and
podgate's own streaming server for the streams it answers itself.

Everything passes through as bytes (passthrough.py) except:
- PortForward for a selected sandbox: a URL on podgate's streaming server, whose target
  reaches the port through the sandbox's agent where one is configured, else through the
  upstream's Exec (a forwarder process in the pod's container), so it works where the
  runtime's own dial into the pod's network namespace cannot.
- Exec and Attach with `exec_via_proxy`: the upstream's call is made, and its URL is wrapped in
  one of ours that relays to it (so the session is audited here).
- RemovePodSandbox: passed through, then the sandbox is forgotten.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Final

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

from podgate.cri import api_pb2 as pb
from podgate.node.cri_client import CriClient
from podgate.node.upstream import CriTarget
from podgate.proto import remotecommand as rc
from podgate.proto.upgrade import StreamKind
from podgate.proxy.agentforward import AgentForwarder
from podgate.proxy.config import ProxyConfig, upstream_socket
from podgate.proxy.passthrough import MAX_MESSAGE_BYTES, PassThrough, upstream_channel
from podgate.proxy.relay import RelayTarget
from podgate.proxy.sandboxes import SandboxCache
from podgate.proxy.target import ProxyTarget
from podgate.streaming.target import PodRef
from podgate.streaming.tokens import TooManyRequestsError
from podgate.streaming.tokenserver import PendingStream, StreamingServer

log = logging.getLogger(__name__)

RUNTIME_SERVICE: Final = "/runtime.v1.RuntimeService"
# The listening socket is the runtime's API: root and the socket's group only, as containerd's.
SOCKET_MODE: Final = 0o660
# How long in-flight calls may finish when the proxy stops, seconds.
STOP_GRACE_SECONDS: Final = 5.0


class CriProxy:
    def __init__(self, config: ProxyConfig) -> None:
        if not config.listen:
            raise ValueError("no socket to listen on")
        self.config = config
        socket_path = upstream_socket(config.upstream)
        self.channel = upstream_channel(f"unix://{socket_path}")
        self.passthrough = PassThrough(self.channel)
        self.sandboxes = SandboxCache(self.channel, config.select)
        # The exec forwarder's calls share the reconnecting channel.
        self.client = CriClient(socket_path, channel=self.channel)
        agent = None
        if config.agent_socket:
            agent = AgentForwarder(config.agent_socket, config.agent_dialback)
        self.target = ProxyTarget(CriTarget(self.client, via_exec=True), agent)
        self.streaming = StreamingServer(
            self.target,
            host=config.stream_address,
            port=config.stream_port,
            unix_path=config.stream_socket or None,
        )
        self.passthrough.intercepts[f"{RUNTIME_SERVICE}/PortForward"] = self._port_forward
        if config.exec_via_proxy:
            self.passthrough.intercepts[f"{RUNTIME_SERVICE}/Exec"] = self._exec
            self.passthrough.intercepts[f"{RUNTIME_SERVICE}/Attach"] = self._attach
        self.passthrough.observers[f"{RUNTIME_SERVICE}/RemovePodSandbox"] = self._removed
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        await self.streaming.start()
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ]
        )
        server.add_generic_rpc_handlers((self.passthrough,))
        # A socket left by an earlier run (or a crash) is replaced, as containerd does.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.config.listen)
        if not server.add_insecure_port(f"unix://{self.config.listen}"):
            raise OSError(f"cannot listen on {self.config.listen}")
        await server.start()
        os.chmod(self.config.listen, SOCKET_MODE)
        self._server = server
        log.info(
            "proxy listening listen=%s upstream=%s streaming=%s exec_via_proxy=%s",
            self.config.listen,
            self.config.upstream,
            self.streaming.base_url,
            self.config.exec_via_proxy,
        )

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(STOP_GRACE_SECONDS)
            self._server = None
            # The kubelet then sees "no such file", not a socket nobody answers.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.listen)
        await self.streaming.stop()
        await self.target.aclose()
        await self.client.close()
        await self.channel.close()

    # -- interceptions

    async def _port_forward(
        self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes | None:
        try:
            parsed = pb.PortForwardRequest.FromString(request)
        except DecodeError:  # malformed: the upstream answers it with its own error
            return None
        sandbox = await self.sandboxes.lookup(parsed.pod_sandbox_id, context.time_remaining())
        if sandbox is None or not sandbox.selected:
            return None
        url = await self._url(
            context, PendingStream(StreamKind.PORTFORWARD, sandbox.pod, ports=tuple(parsed.port))
        )
        log.info(
            "port-forward answered by the proxy sandbox=%s pod=%s handler=%s",
            parsed.pod_sandbox_id,
            sandbox.pod,
            sandbox.runtime_handler,
        )
        return pb.PortForwardResponse(url=url).SerializeToString()

    async def _exec(
        self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes | None:
        response = await self.passthrough.call_upstream(f"{RUNTIME_SERVICE}/Exec", request, context)
        try:
            parsed = pb.ExecRequest.FromString(request)
            answer = pb.ExecResponse.FromString(response)
        except DecodeError:
            return response  # the upstream took it; what we cannot read we leave alone
        options = rc.ExecOptions(
            command=tuple(parsed.cmd),
            container=parsed.container_id,
            stdin=parsed.stdin,
            stdout=parsed.stdout,
            stderr=parsed.stderr,
            tty=parsed.tty,
        )
        answer.url = await self._relayed(
            context, StreamKind.EXEC, parsed.container_id, options, answer.url
        )
        # Reserialised from the upstream's message: fields unknown to us are kept.
        return answer.SerializeToString()

    async def _attach(
        self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes | None:
        response = await self.passthrough.call_upstream(
            f"{RUNTIME_SERVICE}/Attach", request, context
        )
        try:
            parsed = pb.AttachRequest.FromString(request)
            answer = pb.AttachResponse.FromString(response)
        except DecodeError:
            return response
        options = rc.ExecOptions(
            container=parsed.container_id,
            stdin=parsed.stdin,
            stdout=parsed.stdout,
            stderr=parsed.stderr,
            tty=parsed.tty,
        )
        answer.url = await self._relayed(
            context, StreamKind.ATTACH, parsed.container_id, options, answer.url
        )
        return answer.SerializeToString()

    async def _relayed(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        kind: StreamKind,
        container_id: str,
        options: rc.ExecOptions,
        upstream_url: str,
    ) -> str:
        pending = PendingStream(
            kind,
            PodRef("", container_id),
            container_id=container_id,
            options=options,
            target=RelayTarget(upstream_url, container_id, options),
        )
        return await self._url(context, pending)

    async def _url(
        self, context: grpc.aio.ServicerContext[Any, Any], pending: PendingStream
    ) -> str:
        try:
            return self.streaming.url_for(pending)
        except TooManyRequestsError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            raise AssertionError("abort returned") from exc  # pragma: no cover

    def _removed(self, request: bytes, response: bytes) -> None:
        with contextlib.suppress(DecodeError):
            self.sandboxes.forget(pb.RemovePodSandboxRequest.FromString(request).pod_sandbox_id)
