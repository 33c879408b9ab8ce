"""A CRI streaming server: where CRI Exec/Attach/PortForward URLs point (the runtime's, and the
CRI proxy's for the streams it answers itself).

It listens on loopback (or a unix socket) only, unless a TLS certificate is configured: an
unauthenticated streaming port on a routable address is how runtimes have leaked exec to
anyone on the network. Each URL holds a one-time token that names the request.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote

from podgate.aio.http import linger_close, next_request
from podgate.aio.streams import SocketStream, start_server, start_unix_server
from podgate.aio.tasks import TaskSet
from podgate.proto import k8s
from podgate.proto import remotecommand as rc
from podgate.proto.errors import RemoteProtocolError
from podgate.proto.upgrade import HandshakeError, ServerHandshake, StreamKind
from podgate.streaming.hooks import NO_HOOKS, SessionHooks
from podgate.streaming.server import StreamRequest, serve_stream
from podgate.streaming.target import PodRef, StreamTarget
from podgate.streaming.tokens import TokenCache

log = logging.getLogger(__name__)

# Kubernetes' default: a streaming connection with no traffic for this long is closed.
DEFAULT_STREAM_IDLE_TIMEOUT_SECONDS = 4 * 3600.0

_ROUTES = {
    "exec": StreamKind.EXEC,
    "attach": StreamKind.ATTACH,
    "portforward": StreamKind.PORTFORWARD,
}


class InsecureAddressError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class PendingStream:
    """What a token stands for."""

    kind: StreamKind
    pod: PodRef
    container_id: str | None = None
    options: rc.ExecOptions | None = None
    ports: tuple[int, ...] = ()
    # This one stream's target, where it is not the server's (a proxy relaying to a URL).
    target: StreamTarget | None = None
    hooks: SessionHooks = NO_HOOKS


def check_address(host: str, tls: bool) -> None:
    """Refuse a non-loopback address without TLS."""
    if tls:
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise InsecureAddressError(
            f"refusing to serve streams on {host} without TLS: use 127.0.0.1, ::1 or a unix "
            "socket, or configure a certificate"
        )


class StreamingServer:
    def __init__(
        self,
        target: StreamTarget,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        unix_path: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        idle_timeout: float = DEFAULT_STREAM_IDLE_TIMEOUT_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if unix_path is None:
            check_address(host, ssl_context is not None)
        self.target = target
        self.host = host
        self.port = port
        self.unix_path = unix_path
        self.ssl_context = ssl_context
        self.idle_timeout = idle_timeout
        self.clock = clock
        self.tokens: TokenCache[PendingStream] = TokenCache()
        self._server: asyncio.Server | None = None
        # Every connection's handler: drained on stop.
        self._connections = TaskSet("streaming connections", log)

    async def start(self) -> None:
        if self.unix_path is not None:
            self._server = await start_unix_server(
                self._guarded,
                self.unix_path,
                ssl_context=self.ssl_context,
                tasks=self._connections,
            )
        else:
            self._server = await start_server(
                self._guarded,
                self.host,
                self.port,
                ssl_context=self.ssl_context,
                tasks=self._connections,
            )
            self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self, grace: float = 0.0) -> None:
        """Stop accepting; let the streams in progress go on for `grace` seconds, then cut
        them."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        if self._connections:
            log.info(
                "streaming: %d connections open, draining for up to %gs",
                len(self._connections),
                grace,
            )
        await self._connections.aclose(grace)

    @property
    def base_url(self) -> str:
        scheme = "https" if self.ssl_context else "http"
        if self.unix_path is not None:
            return f"{scheme}+unix://{quote(self.unix_path, safe='')}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    def url_for(self, pending: PendingStream) -> str:
        """Store the request; TooManyRequestsError when 1000 are outstanding."""
        token = self.tokens.insert(pending, self.clock())
        return f"{self.base_url}/{pending.kind.name.lower()}/{token}"

    # -- connections
    async def _guarded(self, conn: SocketStream) -> None:
        try:
            await self.handle(conn)
        except Exception:
            log.exception("streaming connection failed")

    async def handle(self, conn: SocketStream) -> None:
        handshake = ServerHandshake()
        while True:
            try:
                request = await next_request(conn, handshake)
            except HandshakeError as exc:
                body = k8s.http_status_body(exc.status, "BadRequest", exc.message)
                await conn.send(
                    handshake.respond(exc.status, [(b"Content-Type", b"application/json")], body)
                )
                await linger_close(conn)
                return
            except RemoteProtocolError:
                return
            if request is None:
                return
            parts = request.path.strip("/").split("/")
            kind = _ROUTES.get(parts[0]) if len(parts) == 2 else None
            pending = self.tokens.consume(parts[1], self.clock()) if kind is not None else None
            if pending is None or pending.kind is not kind:
                await conn.send(
                    handshake.respond(
                        404, [(b"Content-Type", b"text/plain")], b"404 page not found\n"
                    )
                )
                if handshake.must_close:
                    return
                continue
            what = StreamRequest(
                pending.kind,
                pending.pod,
                container=pending.container_id,
                options=pending.options,
                ports=pending.ports,
                hooks=pending.hooks,
            )
            target = pending.target if pending.target is not None else self.target
            await serve_stream(
                conn, handshake, request, what, target, idle_timeout=self.idle_timeout
            )
            return
