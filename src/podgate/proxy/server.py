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

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable
from typing import Any, Final

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

from podgate.aio.streams import SocketStream, start_unix_server
from podgate.cri import api_pb2 as pb
from podgate.node.cri_client import CriClient
from podgate.node.upstream import CriTarget
from podgate.proto import remotecommand as rc
from podgate.proto.upgrade import StreamKind
from podgate.proxy.agentforward import AgentForwarder
from podgate.proxy.config import ProxyConfig, upstream_socket
from podgate.proxy.h2relay import Rewrite, serve_relay
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
        # The relay data plane: its listener, its connections, the calls it looks into.
        self.upstream_path = socket_path
        self._relay_server: asyncio.Server | None = None
        self._connections: set[SocketStream] = set()
        watched = {f"{RUNTIME_SERVICE}/PortForward", f"{RUNTIME_SERVICE}/RemovePodSandbox"}
        if config.exec_via_proxy:
            watched |= {f"{RUNTIME_SERVICE}/Exec", f"{RUNTIME_SERVICE}/Attach"}
        self._watched = frozenset(watched)

    async def start(self) -> None:
        await self.streaming.start()
        if self.config.data_plane == "relay":
            self._relay_server = await start_unix_server(
                self._relay_connection, self.config.listen, mode=SOCKET_MODE
            )
        else:
            await self._start_grpc()
        log.info(
            "proxy listening listen=%s upstream=%s streaming=%s data_plane=%s exec_via_proxy=%s",
            self.config.listen,
            self.config.upstream,
            self.streaming.base_url,
            self.config.data_plane,
            self.config.exec_via_proxy,
        )

    async def _start_grpc(self) -> None:
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

    async def stop(self) -> None:
        listening = self._server is not None or self._relay_server is not None
        if self._server is not None:
            await self._server.stop(STOP_GRACE_SECONDS)
            self._server = None
        if self._relay_server is not None:
            self._relay_server.close()
            self._relay_server = None
            for client in list(self._connections):
                client.abort()
        if listening:
            # The kubelet then sees "no such file", not a socket nobody answers.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.listen)
        await self.streaming.stop()
        await self.target.aclose()
        await self.client.close()
        await self.channel.close()

    # -- interceptions, shared by both data planes: each builds a Rewrite (the runtime's
    # response message → ours) from the request message

    async def _port_forward_rewrite(self, request: bytes, timeout: float | None) -> Rewrite | None:
        try:
            parsed = pb.PortForwardRequest.FromString(request)
        except DecodeError:  # malformed: the upstream answers it with its own error
            return None
        sandbox = await self.sandboxes.lookup(parsed.pod_sandbox_id, timeout)
        if sandbox is None or not sandbox.selected:
            return None
        pending = PendingStream(StreamKind.PORTFORWARD, sandbox.pod, ports=tuple(parsed.port))

        def rewrite(response: bytes) -> bytes:
            try:
                answer = pb.PortForwardResponse.FromString(response)
            except DecodeError:
                answer = pb.PortForwardResponse()
            answer.url = self.streaming.url_for(pending)
            log.info(
                "port-forward answered by the proxy sandbox=%s pod=%s handler=%s",
                parsed.pod_sandbox_id,
                sandbox.pod,
                sandbox.runtime_handler,
            )
            # Reserialised from the upstream's message: fields unknown to us are kept.
            return answer.SerializeToString()

        return rewrite

    def _stream_rewrite(self, method: str, request: bytes) -> Rewrite | None:
        """Exec or Attach: the runtime's URL wrapped in one of ours that relays to it."""
        kind = StreamKind.EXEC if method.endswith("/Exec") else StreamKind.ATTACH
        response_type: type[pb.ExecResponse] | type[pb.AttachResponse]
        try:
            if kind is StreamKind.EXEC:
                parsed: pb.ExecRequest | pb.AttachRequest = pb.ExecRequest.FromString(request)
                response_type = pb.ExecResponse
            else:
                parsed = pb.AttachRequest.FromString(request)
                response_type = pb.AttachResponse
        except DecodeError:
            return None
        options = rc.ExecOptions(
            command=tuple(parsed.cmd) if isinstance(parsed, pb.ExecRequest) else (),
            container=parsed.container_id,
            stdin=parsed.stdin,
            stdout=parsed.stdout,
            stderr=parsed.stderr,
            tty=parsed.tty,
        )
        container_id = parsed.container_id

        def rewrite(response: bytes) -> bytes | None:
            try:
                answer = response_type.FromString(response)
            except DecodeError:
                return None  # the upstream's answer, unread, goes on unchanged
            answer.url = self.streaming.url_for(
                PendingStream(
                    kind,
                    PodRef("", container_id),
                    container_id=container_id,
                    options=options,
                    target=RelayTarget(answer.url, container_id, options),
                )
            )
            return answer.SerializeToString()

        return rewrite

    # -- the gRPC data plane

    async def _port_forward(
        self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes | None:
        rewrite = await self._port_forward_rewrite(request, context.time_remaining())
        if rewrite is None:
            return None
        return await self._rewritten(context, rewrite, b"")

    async def _exec(
        self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes | None:
        return await self._stream_call(f"{RUNTIME_SERVICE}/Exec", request, context)

    async def _attach(
        self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes | None:
        return await self._stream_call(f"{RUNTIME_SERVICE}/Attach", request, context)

    async def _stream_call(
        self, method: str, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes:
        response = await self.passthrough.call_upstream(method, request, context)
        rewrite = self._stream_rewrite(method, request)
        if rewrite is None:
            return response
        return await self._rewritten(context, rewrite, response)

    async def _rewritten(
        self, context: grpc.aio.ServicerContext[Any, Any], rewrite: Rewrite, response: bytes
    ) -> bytes:
        try:
            answer = rewrite(response)
        except TooManyRequestsError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            raise AssertionError("abort returned") from exc  # pragma: no cover
        return response if answer is None else answer

    # -- the relay data plane

    def _relay_intercept(self, method: str, message: bytes) -> Awaitable[Rewrite | None] | None:
        if method == f"{RUNTIME_SERVICE}/PortForward":
            return self._port_forward_rewrite(message, None)
        if method == f"{RUNTIME_SERVICE}/RemovePodSandbox":
            self._removed(message, b"")
            return None
        if self.config.exec_via_proxy and method in (
            f"{RUNTIME_SERVICE}/Exec",
            f"{RUNTIME_SERVICE}/Attach",
        ):
            ready: asyncio.Future[Rewrite | None] = asyncio.get_running_loop().create_future()
            ready.set_result(self._stream_rewrite(method, message))
            return ready
        return None

    async def _relay_connection(self, client: SocketStream) -> None:
        self._connections.add(client)
        try:
            await serve_relay(client, self.upstream_path, self._watched, self._relay_intercept)
        finally:
            self._connections.discard(client)

    def _removed(self, request: bytes, response: bytes) -> None:
        with contextlib.suppress(DecodeError):
            self.sandboxes.forget(pb.RemovePodSandboxRequest.FromString(request).pod_sandbox_id)
