"""Client side of every streaming protocol: exec/attach and port-forward, SPDY and WebSocket.

The `podgate exec/attach/port-forward` commands and the tests build on these. Each call
connects, performs the HTTP upgrade, and runs the session the way client-go does (stream order,
pings, half-closes), so a podgate client talks to a real API server as kubectl would.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import ssl
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import quote, unquote, urlsplit

from podgate.aio.errors import BrokenStreamError, StreamError
from podgate.aio.spdy import SpdySession, SpdyStream
from podgate.aio.streams import ByteStream, SocketStream
from podgate.aio.tasks import cancel_and_wait
from podgate.aio.wschannel import ChannelSession, TunnelWire
from podgate.proto import k8s
from podgate.proto import portforward as pf
from podgate.proto import remotecommand as rc
from podgate.proto.errors import LocalProtocolError, ProtocolError
from podgate.proto.spdy import Role
from podgate.proto.upgrade import (
    TUNNEL_PROTOCOL_PREFIX,
    ClientHandshake,
    UpgradeResponse,
    build_spdy_request,
    build_ws_request,
)
from podgate.proto.wschannel import ChannelConnection, PortForwardChannels, TunnelConnection
from podgate.proto.wschannel import Role as WsRole
from podgate.streaming.portforward import flow_control_window

# What client-go offers, in its order.
EXEC_SPDY_PROTOCOLS = (
    "v5.channel.k8s.io",
    "v4.channel.k8s.io",
    "v3.channel.k8s.io",
    "v2.channel.k8s.io",
    "channel.k8s.io",
)
EXEC_WS_PROTOCOLS = ("v5.channel.k8s.io",)
TUNNEL_PROTOCOL = "SPDY/3.1+portforward.k8s.io"
# client-go's ping periods: direct SPDY and inside the WebSocket tunnel.
SPDY_PING_SECONDS = 5.0
TUNNEL_PING_SECONDS = 10.0
# Longest upgrade response head accepted.
UPGRADE_TIMEOUT_SECONDS = 30.0


class UpgradeError(Exception):
    """The server refused the upgrade; `status` is its HTTP status (0: no answer)."""

    def __init__(self, message: str, status: int = 0, body: bytes = b"") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where the API (or a streaming server) is, and how to authenticate to it."""

    host: str
    port: int
    ssl_context: ssl.SSLContext | None = None
    server_hostname: str | None = None
    headers: tuple[tuple[str, str], ...] = field(default=())
    unix_path: str | None = None  # connect here instead of host:port (host is only the Host)

    @property
    def authority(self) -> str:
        if self.unix_path is not None:
            return self.host
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


# Host header sent to a server on a unix socket, which has no host name of its own.
UNIX_SOCKET_HOST = "localhost"
_DEFAULT_PORTS = {"http": 80, "https": 443}


def endpoint_from_url(
    url: str, *, ssl_context: ssl.SSLContext | None = None
) -> tuple[Endpoint, str]:
    """Split a streaming URL (`http://h:p/x`, `https://…`, `http+unix://%2Fpath.sock/x`, as
    CRI Exec/Attach/PortForward return) into an endpoint and the request path (with query).

    `ssl_context` is used for https; without one the system's default verification applies.
    """
    parts = urlsplit(url)
    scheme, _, transport = parts.scheme.lower().partition("+")
    if scheme not in _DEFAULT_PORTS or transport not in ("", "unix"):
        raise ValueError(f"unsupported streaming URL scheme: {parts.scheme!r}")
    context = None
    if scheme == "https":
        context = ssl_context or ssl.create_default_context()
    path = parts.path or "/"
    if parts.query:
        path = f"{path}?{parts.query}"
    if transport == "unix":
        socket_path = unquote(parts.netloc)
        if not socket_path:
            raise ValueError(f"no socket path in {url!r}")
        endpoint = Endpoint(UNIX_SOCKET_HOST, 0, context, unix_path=socket_path)
        return endpoint, path
    if not parts.hostname:
        raise ValueError(f"no host in {url!r}")
    port = parts.port or _DEFAULT_PORTS[scheme]
    return Endpoint(parts.hostname, port, context), path


def pod_path(namespace: str, pod: str, subresource: str) -> str:
    return f"/api/v1/namespaces/{quote(namespace)}/pods/{quote(pod)}/{subresource}"


def exec_query(
    command: Sequence[str] = (),
    *,
    container: str | None = None,
    stdin: bool = False,
    stdout: bool = True,
    stderr: bool = True,
    tty: bool = False,
) -> str:
    """The query kubectl sends: repeated `command`, only true booleans, keys sorted."""
    pairs = [("command", c) for c in command]
    if container:
        pairs.append(("container", container))
    for name, value in (("stderr", stderr and not tty), ("stdin", stdin), ("stdout", stdout)):
        if value:
            pairs.append((name, "true"))
    if tty:
        pairs.append(("tty", "true"))
    return "&".join(f"{k}={quote(v, safe='')}" for k, v in pairs)


async def _upgrade(
    endpoint: Endpoint, request: bytes, handshake: ClientHandshake
) -> tuple[SocketStream, UpgradeResponse]:
    if endpoint.unix_path is not None:
        conn = await SocketStream.connect_unix(
            endpoint.unix_path,
            ssl_context=endpoint.ssl_context,
            server_hostname=endpoint.server_hostname or endpoint.host,
        )
    else:
        conn = await SocketStream.connect(
            endpoint.host,
            endpoint.port,
            ssl_context=endpoint.ssl_context,
            server_hostname=endpoint.server_hostname or endpoint.host,
        )
    try:
        conn.write(request)
        async with asyncio.timeout(UPGRADE_TIMEOUT_SECONDS):
            while True:
                data = await conn.receive()
                if not data:
                    raise UpgradeError("unexpected EOF")
                response = handshake.receive_data(data)
                if response is not None:
                    break
    except BaseException:
        await conn.aclose()
        raise
    if not response.upgraded:
        await conn.aclose()
        raise UpgradeError(
            response.error or f"upgrade refused ({response.status})", response.status, response.body
        )
    conn.unread(handshake.trailing_data)
    return conn, response


async def connect_spdy(
    endpoint: Endpoint,
    path: str,
    protocols: Sequence[str],
    *,
    window_for: Callable[[str], int | None] | None = None,
) -> tuple[SpdySession, str, asyncio.Task[None]]:
    """POST + Upgrade: SPDY/3.1; returns the running session and the negotiated protocol.

    `window_for` maps the negotiated protocol to the session's flow-control window (None: off,
    as always without it)."""
    request = build_spdy_request(
        "POST", path, endpoint.authority, list(protocols), list(endpoint.headers)
    )
    conn, response = await _upgrade(endpoint, request, ClientHandshake())
    protocol = response.protocol or ""
    session = SpdySession(
        conn,
        Role.CLIENT,
        ping_interval=SPDY_PING_SECONDS,
        idle_timeout=None,
        flow_control_window=window_for(protocol) if window_for is not None else None,
    )
    reader = asyncio.create_task(session.run(), name=f"spdy client {path}")
    return session, protocol, reader


async def connect_websocket(
    endpoint: Endpoint, path: str, protocols: Sequence[str]
) -> tuple[SocketStream, str]:
    key = base64.b64encode(os.urandom(16)).decode()
    request = build_ws_request(
        path, endpoint.authority, list(protocols), key, list(endpoint.headers)
    )
    conn, response = await _upgrade(endpoint, request, ClientHandshake(ws_key=key))
    if response.protocol not in protocols:
        await conn.aclose()
        raise UpgradeError(f"invalid protocol, expected one of {list(protocols)}", 101)
    return conn, response.protocol or ""


# --------------------------------------------------------------------------- exec / attach


@dataclass(slots=True)
class ExecResult:
    exit_code: int
    error: str | None = None


async def _pump_in(src: ByteStream | None, dst: ByteStream) -> None:
    try:
        if src is not None:
            while chunk := await src.receive():
                await dst.send(chunk)
        await dst.send_eof()
    except StreamError:
        pass


async def _pump_out(src: ByteStream, dst: ByteStream | None) -> None:
    with contextlib.suppress(StreamError):
        while chunk := await src.receive():
            if dst is not None:
                try:
                    await dst.send(chunk)
                except StreamError:
                    dst = None  # keep draining: the exit status comes after the output


async def _pump_resizes(sizes: AsyncIterator[rc.TerminalSize], dst: ByteStream) -> None:
    with contextlib.suppress(StreamError):
        async for size in sizes:
            await dst.send(rc.encode_resize(size.width, size.height))


def _result_from_status(payload: bytes, protocol: str) -> ExecResult:
    if not rc.status_is_json(protocol):
        if payload:
            return ExecResult(
                1, f"error executing remote command: {payload.decode(errors='replace')}"
            )
        return ExecResult(0)
    result = k8s.decode_exec_status(payload)
    if result.error is not None and result.exit_code is None:
        return ExecResult(1, result.error)
    return ExecResult(result.exit_code or 0, result.error)


async def exec_spdy(
    endpoint: Endpoint,
    path: str,
    *,
    stdin: ByteStream | None = None,
    stdout: ByteStream | None = None,
    stderr: ByteStream | None = None,
    tty: bool = False,
    resizes: AsyncIterator[rc.TerminalSize] | None = None,
    protocols: Sequence[str] = EXEC_SPDY_PROTOCOLS,
    want_stdin: bool | None = None,
    want_stderr: bool | None = None,
) -> ExecResult:
    """Run an exec/attach over SPDY. `path` includes the query (see exec_query)."""
    session, protocol, reader = await connect_spdy(endpoint, path, protocols)
    tasks: list[asyncio.Task[None]] = []
    helpers: list[asyncio.Task[None]] = []
    try:
        error = await session.open_stream({"streamtype": "error"})
        opened: dict[str, SpdyStream] = {}
        has_stdin = want_stdin if want_stdin is not None else stdin is not None
        if has_stdin:
            opened["stdin"] = await session.open_stream({"streamtype": "stdin"})
        opened["stdout"] = await session.open_stream({"streamtype": "stdout"})
        if not tty and (want_stderr if want_stderr is not None else True):
            opened["stderr"] = await session.open_stream({"streamtype": "stderr"})
        elif tty and rc.supports_resize(protocol):
            opened["resize"] = await session.open_stream({"streamtype": "resize"})
        tasks.append(asyncio.create_task(_pump_out(opened["stdout"], stdout)))
        if "stderr" in opened:
            tasks.append(asyncio.create_task(_pump_out(opened["stderr"], stderr)))
        if "stdin" in opened:
            helpers.append(asyncio.create_task(_pump_in(stdin, opened["stdin"])))
        if "resize" in opened and resizes is not None:
            helpers.append(asyncio.create_task(_pump_resizes(resizes, opened["resize"])))
        await asyncio.gather(*tasks)
        payload = b""
        with contextlib.suppress(StreamError):
            while chunk := await error.receive():
                payload += chunk
        return _result_from_status(payload, protocol)
    finally:
        await cancel_and_wait(*tasks, *helpers)
        await session.aclose()
        await cancel_and_wait(reader)


async def exec_websocket(
    endpoint: Endpoint,
    path: str,
    *,
    stdin: ByteStream | None = None,
    stdout: ByteStream | None = None,
    stderr: ByteStream | None = None,
    tty: bool = False,
    resizes: AsyncIterator[rc.TerminalSize] | None = None,
    protocols: Sequence[str] = EXEC_WS_PROTOCOLS,
) -> ExecResult:
    """Run an exec/attach over the WebSocket channel protocol (kubectl's v5 by default)."""
    conn, protocol = await connect_websocket(endpoint, path, protocols)
    channels = ChannelSession(
        conn, ChannelConnection(WsRole.CLIENT, protocol), name="ws exec", inbound={1, 2, 3}
    )
    reader = asyncio.create_task(channels.run(), name="ws exec client read loop")
    helpers: list[asyncio.Task[None]] = []
    outs: list[asyncio.Task[None]] = []
    try:
        if stdin is not None:
            helpers.append(asyncio.create_task(_pump_in(stdin, channels.stream(0))))
        if resizes is not None:
            helpers.append(asyncio.create_task(_pump_resizes(resizes, channels.stream(4))))
        outs += [
            asyncio.create_task(_pump_out(channels.stream(1), stdout)),
            asyncio.create_task(_pump_out(channels.stream(2), stderr)),
        ]
        payload = b""
        status_channel = channels.stream(3)
        with contextlib.suppress(StreamError):
            while chunk := await status_channel.receive():
                payload += chunk
        await asyncio.gather(*outs)
        await reader
        if channels.close_code not in (1000, None) or channels.broken is not None:
            code = channels.close_code
            raise BrokenStreamError(f"websocket closed abnormally ({code})")
        return _result_from_status(payload, protocol)
    finally:
        await cancel_and_wait(*helpers, *outs)
        await channels.aclose()
        await cancel_and_wait(reader)


# --------------------------------------------------------------------------- port-forward


class UdpNotSupportedError(LocalProtocolError):
    """A UDP stream was asked of a session whose server did not accept the UDP extension."""


@dataclass(slots=True)
class ForwardedStream:
    """One forwarded connection: its data stream and the server's error text, if any.

    For a UDP flow the data stream carries framed datagrams (podgate.proto.datagram)."""

    data: SpdyStream
    error_stream: SpdyStream
    request_id: str
    protocol: str = "tcp"

    async def error(self) -> str:
        """The error text the server wrote ("" when the connection ended cleanly)."""
        parts = []
        with contextlib.suppress(StreamError):
            while chunk := await self.error_stream.receive():
                parts.append(chunk)
        return b"".join(parts).decode(errors="replace")

    async def aclose(self) -> None:
        """Release both streams (a reset, unless both directions already ended)."""
        await self.data.aclose()
        await self.error_stream.aclose()


class PortForwardSession:
    """A port-forward connection over SPDY (direct or tunnelled); one stream pair per open().

    `protocol` is the negotiated SPDY protocol (inside the tunnel, too); `supports_udp` says
    whether the server accepted podgate's UDP extension, and with it the session has per-stream
    flow control (`session.flow_control_window`)."""

    def __init__(
        self,
        session: SpdySession,
        reader: asyncio.Task[None],
        protocol: str = pf.PORTFORWARD_PROTOCOL,
    ) -> None:
        self.session = session
        self.protocol = protocol
        self._reader = reader
        self._ids = pf.PortForwardRequestIds()
        self._open_lock = asyncio.Lock()

    @property
    def supports_udp(self) -> bool:
        return pf.allows_udp(self.protocol)

    @classmethod
    async def connect(
        cls, endpoint: Endpoint, path: str, *, websocket: bool = False, udp: bool = False
    ) -> PortForwardSession:
        """Upgrade as kubectl does; with `udp`, offer podgate's extension first (the server may
        still choose plain port-forward: see `supports_udp`). The extension brings UDP pairs
        and flow control; without `udp` the upgrade is exactly kubectl's."""
        if not websocket:
            offered = pf.CLIENT_SPDY_PROTOCOLS_WITH_UDP if udp else (pf.PORTFORWARD_PROTOCOL,)
            session, protocol, reader = await connect_spdy(
                endpoint, path, offered, window_for=flow_control_window
            )
            if protocol not in offered:
                await session.aclose()
                supported = " ".join(f'"{p}"' for p in offered)
                raise UpgradeError(
                    f"unable to negotiate protocol: client supports {supported}, "
                    f'server returned "{protocol}"'
                )
            return cls(session, reader, protocol)
        tunnels = pf.CLIENT_TUNNEL_PROTOCOLS_WITH_UDP if udp else (TUNNEL_PROTOCOL,)
        conn, chosen = await connect_websocket(endpoint, path, tunnels)
        protocol = chosen.removeprefix(TUNNEL_PROTOCOL_PREFIX)
        wire = TunnelWire(conn, TunnelConnection(WsRole.CLIENT))
        session = SpdySession(
            wire,
            Role.CLIENT,
            ping_interval=TUNNEL_PING_SECONDS,
            idle_timeout=None,
            flow_control_window=flow_control_window(protocol),
        )
        reader = asyncio.create_task(session.run(), name=f"tunnel client {path}")
        return cls(session, reader, protocol)

    async def open(self, port: int, protocol: str = "tcp") -> ForwardedStream:
        """Open an error+data pair for `port` as client-go does (one at a time).

        protocol "udp" needs a session that negotiated the UDP extension (UdpNotSupportedError
        otherwise); its data stream then carries framed datagrams."""
        if protocol == "udp" and not self.supports_udp:
            raise UdpNotSupportedError(
                "the server does not support UDP port-forward: it did not accept "
                f"{pf.UDP_PORTFORWARD_PROTOCOL} (negotiated {self.protocol})"
            )
        async with self._open_lock:
            request_id = self._ids.next()
            error = await self.session.open_stream(
                pf.stream_headers("error", port, request_id, protocol)
            )
            await error.send_eof()
            data = await self.session.open_stream(
                pf.stream_headers("data", port, request_id, protocol)
            )
        return ForwardedStream(data, error, request_id, protocol)

    async def aclose(self) -> None:
        await self.session.aclose()
        await cancel_and_wait(self._reader)


async def portforward_websocket(
    endpoint: Endpoint, path: str, ports: Sequence[int]
) -> tuple[ChannelSession, dict[int, ByteStream], asyncio.Task[None]]:
    """v4 channel port-forward (the Python client's way): one stream per port."""
    query = "&".join(f"ports={p}" for p in ports)
    conn, protocol = await connect_websocket(endpoint, f"{path}?{query}", ["v4.channel.k8s.io"])
    core = ChannelConnection(
        WsRole.CLIENT, protocol, port_channels=PortForwardChannels(list(ports), WsRole.CLIENT)
    )
    channels = ChannelSession(conn, core, name="ws portforward")
    reader = asyncio.create_task(channels.run(), name="ws pf client read loop")
    return channels, {p: channels.stream(2 * i) for i, p in enumerate(ports)}, reader


__all__ = [
    "Endpoint",
    "ExecResult",
    "ForwardedStream",
    "PortForwardSession",
    "ProtocolError",
    "UdpNotSupportedError",
    "UpgradeError",
    "endpoint_from_url",
    "exec_query",
    "exec_spdy",
    "exec_websocket",
    "pod_path",
    "portforward_websocket",
]
