"""Serve one upgraded exec/attach/port-forward request against a StreamTarget.

Whoever parsed the request (the runtime's streaming server, a test API) says which pod and what
kind of stream it is; this module negotiates the protocol, answers the upgrade, and runs the
session in whichever protocol generation the client chose.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from podgate.aio.spdy import MAX_STREAMS_PER_SESSION, SpdySession
from podgate.aio.streams import SocketStream, Wire
from podgate.aio.tasks import cancel_and_wait
from podgate.aio.wschannel import ChannelSession, TunnelWire
from podgate.proto import k8s
from podgate.proto import portforward as pf
from podgate.proto import remotecommand as rc
from podgate.proto.errors import ProtocolError
from podgate.proto.spdy import Role
from podgate.proto.upgrade import (
    Accepted,
    Rejected,
    ServerHandshake,
    StreamKind,
    Transport,
    UpgradeRequest,
    negotiate,
)
from podgate.proto.wschannel import ChannelConnection, TunnelConnection, parse_ports
from podgate.proto.wschannel import Role as WsRole
from podgate.streaming.hooks import NO_HOOKS, SessionHooks
from podgate.streaming.portforward import (
    SpdyPortForwardServer,
    flow_control_window,
    serve_websocket_portforward,
)
from podgate.streaming.remotecommand import serve_spdy_exec, serve_ws_exec
from podgate.streaming.target import ExecIO, PodRef, StreamTarget

log = logging.getLogger(__name__)

# Stream pairs a port-forward session may hold beyond its forward cap while they are opened
# (kubectl sends the error stream, then the data stream) or closed (both ends must finish).
PAIRS_IN_FLIGHT = 32


@dataclass(frozen=True, slots=True)
class StreamRequest:
    """What the caller learned from the URL."""

    kind: StreamKind
    pod: PodRef
    container: str | None = None
    # exec/attach options come from the query; kubelet-style URLs spell booleans "1"
    kubelet_style: bool = False
    # A CRI streaming server knows the options from the CRI call (the token), not the query.
    options: rc.ExecOptions | None = None
    ports: tuple[int, ...] = ()
    hooks: SessionHooks = NO_HOOKS


async def reject(
    conn: SocketStream, handshake: ServerHandshake, code: int, reason: str, message: str
) -> None:
    """A non-upgrade answer with a Kubernetes Status body (kubectl then falls back or prints)."""
    body = k8s.http_status_body(code, reason, message)
    await conn.send(handshake.respond(code, [(b"Content-Type", b"application/json")], body))


async def serve_stream(
    conn: SocketStream,
    handshake: ServerHandshake,
    request: UpgradeRequest,
    what: StreamRequest,
    target: StreamTarget,
    *,
    idle_timeout: float | None = None,
) -> int | None:
    """Negotiate, answer the upgrade and run the session. Returns an exec's exit code."""
    options: rc.ExecOptions | None = None
    ports: list[int] = []
    try:
        if what.options is not None:
            options = what.options
        elif what.kind is not StreamKind.PORTFORWARD:
            options = rc.parse_options(request.query, kubelet_style=what.kubelet_style)
            if what.kind is StreamKind.ATTACH:
                options = rc.ExecOptions(
                    command=(),
                    container=options.container,
                    stdin=options.stdin,
                    stdout=options.stdout,
                    stderr=options.stderr,
                    tty=options.tty,
                )
    except ProtocolError as exc:
        await reject(conn, handshake, 400, "BadRequest", exc.message)
        return None

    if what.kind is StreamKind.PORTFORWARD:
        # podgate's UDP extension is one more protocol version; kubectl never offers it.
        decision = negotiate(
            request.method,
            request.headers,
            what.kind,
            spdy_protocols=pf.SERVER_SPDY_PROTOCOLS,
            ws_protocols=pf.SERVER_WS_PROTOCOLS,
        )
    else:
        decision = negotiate(request.method, request.headers, what.kind)
    if isinstance(decision, Rejected):
        await conn.send(handshake.respond(decision.status, decision.headers, decision.body))
        return None
    assert isinstance(decision, Accepted)
    if what.ports:
        ports = list(what.ports)
    elif decision.transport is Transport.WEBSOCKET and what.kind is StreamKind.PORTFORWARD:
        try:
            ports = parse_ports(request.query)
        except ProtocolError as exc:
            await reject(conn, handshake, 400, "BadRequest", exc.message)
            return None
    what.hooks.negotiated(decision.transport.name.lower(), decision.protocol)
    conn.write(handshake.accept(decision))
    conn.unread(handshake.trailing_data)

    container = what.container or (options.container if options else None)

    async def run(io: ExecIO) -> int:
        assert options is not None
        io = _limited(io, what.hooks)
        if what.kind is StreamKind.ATTACH:
            return await target.attach(what.pod, container, io)
        return await target.exec(what.pod, container, options.command, io)

    label = f"{what.kind.name.lower()} {what.pod}"
    # Flow control only when podgate's extension says the client is podgate (exec: never).
    window = flow_control_window(decision.inner_protocol)
    if decision.transport in (Transport.SPDY, Transport.WEBSOCKET_TUNNEL):
        spdy_wire: Wire = conn
        if decision.transport is Transport.WEBSOCKET_TUNNEL:
            spdy_wire = TunnelWire(conn, TunnelConnection(WsRole.SERVER))
        session = SpdySession(
            spdy_wire,
            Role.SERVER,
            idle_timeout=idle_timeout,
            flow_control_window=window,
            name=label,
            max_streams=_stream_cap(what),
            control_budget=what.hooks.control_budget,
            on_flood=what.hooks.flooded,
            # Port-forward payload may be spliced in the kernel (plain sockets only).
            kernel_splice=what.kind is StreamKind.PORTFORWARD,
        )
        if what.kind is StreamKind.PORTFORWARD:
            server = SpdyPortForwardServer(
                what.pod,
                target,
                label=label,
                hooks=what.hooks,
                udp=pf.allows_udp(decision.inner_protocol),
            )
            session.on_stream = server.on_stream
            await server.serve(session)
            return None
        # The tunnel only ever carries port-forward (negotiation refuses anything else).
        assert options is not None
        return await serve_spdy_exec(session, decision.protocol, options, run)
    if what.kind is StreamKind.PORTFORWARD:
        inbound = {2 * i for i in range(len(ports))}  # data channels; errors are ours alone
    else:
        assert options is not None
        inbound = {0} if options.stdin else set()
        if options.tty:
            inbound.add(4)
    channels = ChannelSession(
        conn,
        ChannelConnection(WsRole.SERVER, decision.protocol),
        name=label,
        inbound=inbound,
        idle_timeout=idle_timeout,
        # Each port is a connection of its own: a pod that stops reading one is reset.
        stall_reset=what.kind is StreamKind.PORTFORWARD,
    )
    if what.kind is StreamKind.PORTFORWARD:
        reader = asyncio.create_task(channels.run(), name=f"{label} read loop")
        try:
            for message in _port_headers(ports):
                channels.send_nowait(*message)
            await serve_websocket_portforward(channels, ports, what.pod, target, what.hooks)
        finally:
            await channels.aclose(1000)
            await cancel_and_wait(reader)
        return None
    assert options is not None
    return await serve_ws_exec(channels, options, run)


def _stream_cap(what: StreamRequest) -> int:
    """The session's stream cap: when the hooks set forwards per session, a data and an
    error stream per forward and room for pairs still being opened or closed."""
    forwards = what.hooks.max_forwards
    if what.kind is not StreamKind.PORTFORWARD or forwards is None:
        return MAX_STREAMS_PER_SESSION
    return 2 * (forwards + PAIRS_IN_FLIGHT)


def _limited(io: ExecIO, hooks: SessionHooks) -> ExecIO:
    """The client's stdio under the session's rate limit, if it has one."""
    if not hooks.max_bytes_per_sec:
        return io
    return ExecIO(
        stdin=hooks.wrap(io.stdin) if io.stdin else None,
        stdout=hooks.wrap(io.stdout) if io.stdout else None,
        stderr=hooks.wrap(io.stderr) if io.stderr else None,
        tty=io.tty,
        resizes=io.resizes,
    )


def _port_headers(ports: list[int]) -> list[tuple[int, bytes]]:
    out = []
    for i, port in enumerate(ports):
        prefix = port.to_bytes(2, "little")
        out.append((2 * i, prefix))
        out.append((2 * i + 1, prefix))
    return out
