"""A port-forward that survives: per-connection errors, lost sessions, replaced pods.

One `TargetForward` per pod. It listens on every local address of every port pair first, then
keeps one port-forward session (SPDY, or SPDY tunnelled in WebSocket) to the pod:

- each local connection opens its own stream pair on the current session; an error on it (the
  pod refused, reset, the error stream's text) ends that connection only;
- the session is watched (its read loop, pings, and now and then the pod itself); when it is
  lost, in-flight connections are reset, listeners stay open, and a new session is made with
  exponential backoff. A connection that arrives meanwhile waits for it (bounded);
- a pod recreated under the same name (a new uid, or the same uid with a new creation time or
  IP) gets a new session, to follow it;
- the target ends for good when the API refuses access (401/403) or when the pod has been
  missing (404) for longer than the gone timeout.

Everything the engine does is reported as `ForwardEvent`s to a `ForwardStatus`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import random
import socket
import ssl
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, IntEnum

from podgate.aio.errors import StreamError
from podgate.aio.splice import splice
from podgate.aio.streams import (
    DEFAULT_RECEIVE_BYTES,
    Buffer,
    ByteStream,
    SocketStream,
    start_server,
)
from podgate.aio.tasks import cancel_and_wait
from podgate.forward.pods import PodLookupError, get_pod
from podgate.forward.specs import PortSpec, Protocol, TargetSpec
from podgate.forward.status import EventKind, ForwardEvent, ForwardStatus
from podgate.forward.udp import FlowEvent, FlowEventKind, UdpRelay
from podgate.kubeconfig import ApiServer
from podgate.proto.errors import ProtocolError
from podgate.streaming.client import (
    ForwardedStream,
    PortForwardSession,
    UpgradeError,
    pod_path,
)

log = logging.getLogger(__name__)


# Reconnect backoff: first retry soon (a gateway restart takes a moment), then at most every
# 5 s; each wait is jittered by ±20 % so many forwards do not retry in lockstep.
BACKOFF_INITIAL_SECONDS = 0.2
BACKOFF_MAX_SECONDS = 5.0
BACKOFF_JITTER = 0.2
# How long a new local connection waits for a session while one is being (re)made.
CONNECT_WAIT_SECONDS = 10.0
# Default of --gone-timeout: how long a pod may be missing (404) before the target is gone.
GONE_TIMEOUT_SECONDS = 30.0
# Session health: a PING every 5 s (as kubectl), each answered within 5 s; two unanswered in a
# row mean the connection is dead even though TCP has not noticed (a network blip, a peer that
# vanished without a FIN).
PING_INTERVAL_SECONDS = 5.0
PING_TIMEOUT_SECONDS = 5.0
PING_FAILURES_LOST = 2
# How often the pod is read to notice it was deleted or recreated under the same name.
POD_CHECK_SECONDS = 2.0
# After a connection's data stream ended, how long its error text may take to arrive.
ERROR_TEXT_WAIT_SECONDS = 1.0
# A local write slower than this means the local client is not reading: the session's read loop
# may then be held up by backpressure, and a late PING answer is not a dead connection.
LOCAL_STALL_SECONDS = 0.05
# Longest error text kept from an error stream.
MAX_ERROR_TEXT_BYTES = 4096
# Pod phases in which a pod will not serve again by itself: counted towards the gone timeout.
FINISHED_PHASES = ("Succeeded", "Failed")


class ExitCode(IntEnum):
    """podgate port-forward's exit codes."""

    INTERRUPTED = 0  # the user stopped it (SIGINT/SIGTERM)
    FATAL = 1  # anything else fatal (TLS verification failed, a bad answer, ...)
    USAGE = 2  # a usage error (click's)
    GONE = 3  # the pod has been missing for longer than --gone-timeout
    DENIED = 4  # the API refused the upgrade (401/403)
    LISTEN_FAILED = 5  # a local address could not be listened on (in use, not available)


EXIT_CODE_HELP = (
    (ExitCode.INTERRUPTED, "interrupted by the user (SIGINT/SIGTERM)"),
    (ExitCode.FATAL, "any other fatal error"),
    (ExitCode.USAGE, "usage error"),
    (ExitCode.GONE, "the pod was missing (404) for longer than --gone-timeout"),
    (ExitCode.DENIED, "access denied (401/403 at the upgrade)"),
    (ExitCode.LISTEN_FAILED, "a local address could not be listened on"),
)
# With several targets the process exits with the worst of their codes; worst is last here.
_SEVERITY = (
    ExitCode.INTERRUPTED,
    ExitCode.GONE,
    ExitCode.DENIED,
    ExitCode.LISTEN_FAILED,
    ExitCode.USAGE,
    ExitCode.FATAL,
)


def worst(codes: list[ExitCode]) -> ExitCode:
    return max(codes, key=_SEVERITY.index, default=ExitCode.INTERRUPTED)


class Transport(Enum):
    """Which upgrade to use: kubectl 1.31+'s WebSocket tunnel with a SPDY fallback (auto), or
    one of them only."""

    AUTO = "auto"
    WEBSOCKET = "websocket"
    SPDY = "spdy"


@dataclass(frozen=True, slots=True)
class EngineOptions:
    gone_timeout: float = GONE_TIMEOUT_SECONDS  # 0: wait for the pod forever
    transport: Transport = Transport.AUTO
    connect_wait: float = CONNECT_WAIT_SECONDS
    backoff_initial: float = BACKOFF_INITIAL_SECONDS
    backoff_max: float = BACKOFF_MAX_SECONDS
    ping_interval: float = PING_INTERVAL_SECONDS
    ping_timeout: float = PING_TIMEOUT_SECONDS
    ping_failures: int = PING_FAILURES_LOST
    pod_check_interval: float = POD_CHECK_SECONDS  # 0: never read the pod


class ListenError(Exception):
    """A local address could not be listened on."""


# Why one attempt to make a session failed, sorted by what to do about it.
class _AttemptFailed(Exception):
    pass


class _Retry(_AttemptFailed):
    """Worth another try after a backoff."""


class _Missing(_Retry):
    """The pod is not there (404) or has finished: retry, but the gone clock runs."""


class _Denied(_AttemptFailed):
    """401/403: retrying will not help."""


class _Fatal(_AttemptFailed):
    """Neither will it here (the server's certificate is not trusted, ...)."""


def backoff_delays(
    initial: float, maximum: float, jitter: float, rng: Callable[[], float]
) -> Callable[[int], float]:
    """Delay before retry `n` (0-based): initial·2ⁿ capped at `maximum`, then ±jitter."""

    def delay(attempt: int) -> float:
        base = min(initial * 2.0 ** min(attempt, 32), maximum)
        return base * (1 + jitter * (2 * rng() - 1))

    return delay


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Session:
    """One live port-forward session and what we know about it."""

    def __init__(self, session: PortForwardSession, identity: str, transport: Transport) -> None:
        self.session = session
        self.identity = identity
        self.transport = transport
        self.lost = asyncio.Event()
        self.reason = ""

    def mark_lost(self, reason: str) -> None:
        if not self.lost.is_set():
            self.reason = reason
            self.lost.set()

    @property
    def dead(self) -> bool:
        return self.lost.is_set() or self.session.session.broken is not None


class _CountingStream(ByteStream):
    """The local side of a forwarded connection: counts bytes as they move, notices when the
    local client is slow to read, and leaves closing to the engine (which may reset it)."""

    def __init__(self, inner: SocketStream, forward: TargetForward, spec: PortSpec) -> None:
        self.inner = inner
        self.forward = forward
        self.spec = spec
        self.bytes_in = 0
        self.bytes_out = 0

    async def receive(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        chunk = await self.inner.receive(max_bytes)
        self.bytes_out += len(chunk)
        self.forward._count(self.spec, 0, len(chunk))
        return chunk

    async def send(self, data: Buffer) -> None:
        forward = self.forward
        forward._local_sends += 1
        start = time.monotonic()
        try:
            await self.inner.send(data)
        finally:
            forward._local_sends -= 1
            end = time.monotonic()
            if end - start > LOCAL_STALL_SECONDS:
                forward._last_stall = end
        self.bytes_in += len(data)
        forward._count(self.spec, len(data), 0)

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        pass  # the engine closes or resets the socket once it knows how the forward ended


class TargetForward:
    """Forwards the port pairs of one pod; see the module docstring.

    UDP pairs travel over podgate's UDP extension (podgate.proto.datagram), offered only when a
    pair asks for UDP; on a server without it each UDP flow fails with that message."""

    def __init__(
        self,
        api: ApiServer,
        spec: TargetSpec,
        addresses: tuple[str, ...],
        status: ForwardStatus,
        options: EngineOptions | None = None,
        *,
        clock: Callable[[], float] = time.time,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.api = api
        self.spec = spec
        self.namespace = spec.namespace or api.namespace
        self.name = f"{self.namespace}/{spec.pod}"
        self.addresses = addresses
        self.status = status
        self.options = options or EngineOptions()
        self._clock = clock
        self._delay = backoff_delays(
            self.options.backoff_initial, self.options.backoff_max, BACKOFF_JITTER, rng
        )
        self.stats = status.add_target(self.name, spec.ports)
        self._portforward_path = api.path(pod_path(self.namespace, spec.pod, "portforward"))
        self._pod_path = api.path(pod_path(self.namespace, spec.pod, "")).rstrip("/")
        self._servers: list[asyncio.AbstractServer] = []
        self._relays: list[UdpRelay] = []
        self._udp = any(p.protocol is Protocol.UDP for p in spec.ports)
        self._connections: set[asyncio.Task[None]] = set()
        self._current: _Session | None = None
        self._open_sessions: set[_Session] = set()
        self._ready = asyncio.Event()
        self._finished = asyncio.Event()
        self._check_pod_now = asyncio.Event()
        self._prefer_spdy = self.options.transport is Transport.SPDY
        self._connection_ids = 0
        self._local_sends = 0
        self._last_stall = 0.0
        self._last_error = ""
        self.bound: list[tuple[PortSpec, str, int]] = []  # (spec, address, port) once listening

    # -- reporting
    def _emit(self, kind: EventKind, **fields: object) -> None:
        event = ForwardEvent(kind, self.name, self._clock(), **fields)  # type: ignore[arg-type]
        self.status.apply(event)

    def _count(self, spec: PortSpec, inbound: int, outbound: int) -> None:
        self.status.add_bytes(
            self.name, spec.remote, spec.protocol.value, inbound=inbound, outbound=outbound
        )

    # -- listening
    async def listen(self) -> None:
        """Listen on every address of every port pair; all or nothing (raises ListenError)."""
        try:
            for spec in self.spec.ports:
                if spec.protocol is Protocol.UDP:
                    await self._listen_udp(spec)
                else:
                    await self._listen_tcp(spec)
        except ListenError as exc:
            await self._close_servers()
            self._emit(EventKind.LISTEN_FAILED, error=str(exc))
            raise

    async def _listen_tcp(self, spec: PortSpec) -> None:
        port = spec.local
        bound_any = False
        for address in self.addresses:
            listening = [""]  # filled in once bound: the handler runs only after that

            async def handler(
                stream: SocketStream, spec: PortSpec = spec, where: list[str] = listening
            ) -> None:
                await self._handle_tcp(stream, spec, where[0])

            try:
                server = await start_server(handler, address, port)
            except OSError as exc:
                if address == "::1" and exc.errno == errno.EADDRNOTAVAIL and bound_any:
                    log.info("%s: no IPv6 loopback here, not listening on [::1]", self.name)
                    continue
                where = format_address(address, port)
                raise ListenError(f"unable to listen on {where}: {exc.strerror or exc}") from exc
            self._servers.append(server)
            bound_any = True
            sock = server.sockets[0]
            port = sock.getsockname()[1]  # a random port, if asked for, is then the same for all
            self.bound.append((spec, address, port))
            listening[0] = format_address(address, port)
            self._emit(
                EventKind.LISTENING,
                local=format_address(address, port),
                remote=spec.remote,
                protocol=spec.protocol.value,
            )

    async def _listen_udp(self, spec: PortSpec) -> None:
        port = spec.local
        bound_any = False
        for address in self.addresses:
            flows = _UdpFlows(self, spec)
            relay = UdpRelay(
                flows.open_stream,
                (address, port),
                on_event=flows.on_event,
                name=f"{self.name} udp {spec.remote}",
            )
            try:
                await relay.start()
            except OSError as exc:
                if address == "::1" and exc.errno == errno.EADDRNOTAVAIL and bound_any:
                    continue
                where = format_address(address, port)
                raise ListenError(
                    f"unable to listen on {where}/udp: {exc.strerror or exc}"
                ) from exc
            self._relays.append(relay)
            bound_any = True
            port = int(relay.address[1])
            self.bound.append((spec, address, port))
            flows.listener = format_address(address, port)
            self._emit(
                EventKind.LISTENING,
                local=flows.listener,
                remote=spec.remote,
                protocol=spec.protocol.value,
            )

    async def _close_servers(self) -> None:
        for server in self._servers:
            server.close()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()
        self._servers.clear()
        relays, self._relays = self._relays, []
        await asyncio.gather(*(r.aclose() for r in relays), return_exceptions=True)

    # -- the session supervisor
    async def run(self) -> ExitCode:
        """Keep a session until the target is denied, gone or fails; cancel to stop."""
        try:
            return await self._supervise()
        finally:
            self._finished.set()
            self._ready.set()  # wake waiting connections: there will be no session
            await self._shutdown()

    async def _supervise(self) -> ExitCode:
        attempt = 0
        missing_since: float | None = None
        connected_before = False
        while True:
            try:
                live = await self._connect()
            except _Denied as exc:
                self._emit(EventKind.TARGET_DENIED, error=str(exc))
                return ExitCode.DENIED
            except _Fatal as exc:
                self._emit(EventKind.TARGET_FAILED, error=str(exc))
                return ExitCode.FATAL
            except _Retry as exc:
                now = time.monotonic()
                if isinstance(exc, _Missing):
                    missing_since = missing_since if missing_since is not None else now
                    gone = self.options.gone_timeout
                    if gone > 0 and now - missing_since >= gone:
                        self._emit(
                            EventKind.TARGET_GONE,
                            error=f"{exc} (for more than {gone:g} s)",
                        )
                        return ExitCode.GONE
                else:
                    missing_since = None
                self._last_error = str(exc)
                self._emit(EventKind.RECONNECTING, error=str(exc))
                await asyncio.sleep(self._delay(attempt))
                attempt += 1
                continue
            attempt = 0
            missing_since = None
            self._open_sessions.add(live)
            self._current = live
            self._ready.set()
            note = ""
            if self._udp and not live.session.supports_udp:
                note = "the server does not support UDP port-forward: UDP flows will fail"
            self._emit(
                EventKind.RECONNECTED if connected_before else EventKind.CONNECTED,
                protocol=live.transport.value,
                error=note,
            )
            connected_before = True
            kind, reason = EventKind.SESSION_LOST, "stopped"
            try:
                kind, reason = await self._watch(live)
            finally:
                self._ready.clear()
                self._current = None
                live.mark_lost(reason)  # in-flight connections on it end now
            self._emit(kind, error=reason)
            await self._drop(live)

    async def _drop(self, live: _Session) -> None:
        # Closing resets every stream of the session: in-flight connections end with an error.
        self._open_sessions.discard(live)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(live.session.aclose(), PING_TIMEOUT_SECONDS)

    async def _connect(self) -> _Session:
        identity = ""
        if self.options.pod_check_interval > 0:
            identity = await self._check_pod_before_connect()
        session, transport = await self._upgrade()
        return _Session(session, identity, transport)

    async def _check_pod_before_connect(self) -> str:
        try:
            info = await get_pod(self.api.endpoint, self._pod_path)
        except PodLookupError as exc:
            raise self._connect_failure(exc) from exc
        if info.status == 404:
            raise _Missing(f"pod {self.name} not found")
        if info.status == 401:
            raise _Denied(f"Unauthorized: {info.message}")
        if info.status == 403:
            return ""  # may forward without being allowed to read the pod: nothing to follow
        if info.status != 200:
            raise _Retry(f"reading pod {self.name}: {info.message}")
        if info.phase in FINISHED_PHASES:
            raise _Missing(f"pod {self.name} has finished ({info.phase})")
        if info.phase and info.phase != "Running":
            raise _Retry(f"pod {self.name} is not running ({info.phase})")
        return info.identity

    @staticmethod
    def _connect_failure(exc: BaseException) -> _AttemptFailed:
        cause: BaseException | None = exc
        while cause is not None:
            if isinstance(cause, ssl.SSLCertVerificationError):
                return _Fatal(f"the API server's certificate is not trusted: {cause}")
            cause = cause.__cause__
        return _Retry(f"cannot reach the API server: {exc}")

    def _upgrade_failure(self, exc: UpgradeError) -> _AttemptFailed:
        if exc.status in (401, 403):
            return _Denied(f"{'Unauthorized' if exc.status == 401 else 'Forbidden'}: {exc}")
        if exc.status == 404:
            return _Missing(f"pod {self.name} not found: {exc}")
        return _Retry(f"upgrade failed: {exc}")

    async def _upgrade(self) -> tuple[PortForwardSession, Transport]:
        endpoint, path = self.api.endpoint, self._portforward_path
        try:
            if not self._prefer_spdy:
                try:
                    # podgate's extension is offered even for TCP-only targets: against a
                    # podgate server it also brings per-stream flow control, so one stalled
                    # connection cannot hold up the others on the session.
                    ws = await PortForwardSession.connect(endpoint, path, websocket=True, udp=True)
                    return ws, Transport.WEBSOCKET
                except UpgradeError as exc:
                    # As kubectl: any complete non-101 answer means "try SPDY"; no answer at
                    # all does not (kubectl-api-surface.md §1.3).
                    if self.options.transport is Transport.WEBSOCKET or exc.status == 0:
                        raise
                    log.debug("%s: WebSocket refused (%s), trying SPDY", self.name, exc)
            session = await PortForwardSession.connect(endpoint, path, websocket=False, udp=True)
            if self.options.transport is Transport.AUTO:
                self._prefer_spdy = True  # WebSocket was refused: save the round trip next time
            return session, Transport.SPDY
        except UpgradeError as exc:
            raise self._upgrade_failure(exc) from exc
        except (StreamError, OSError, ProtocolError) as exc:
            raise self._connect_failure(exc) from exc

    async def _watch(self, live: _Session) -> tuple[EventKind, str]:
        """Wait until the session is lost; returns the event to report and why."""
        watchers = [
            asyncio.create_task(self._watch_reader(live), name=f"{self.name} reader"),
            asyncio.create_task(self._watch_pings(live), name=f"{self.name} pings"),
        ]
        if self.options.pod_check_interval > 0 and live.identity:
            watchers.append(asyncio.create_task(self._watch_pod(live), name=f"{self.name} pod"))
        try:
            done, _ = await asyncio.wait(watchers, return_when=asyncio.FIRST_COMPLETED)
            return next(iter(done)).result()
        finally:
            await cancel_and_wait(*watchers)

    async def _watch_reader(self, live: _Session) -> tuple[EventKind, str]:
        spdy = live.session.session
        await spdy.done.wait()
        if spdy.goaway_received:
            return EventKind.SESSION_LOST, "the server ended the session (GOAWAY)"
        reason = str(spdy.broken) if spdy.broken is not None else "connection closed"
        return EventKind.SESSION_LOST, reason

    async def _watch_pings(self, live: _Session) -> tuple[EventKind, str]:
        failures = 0
        options = self.options
        while True:
            await asyncio.sleep(options.ping_interval)
            started = time.monotonic()
            try:
                await live.session.session.ping(timeout=options.ping_timeout)
            except (TimeoutError, StreamError):
                # A local client that does not read holds up the session's read loop (that is
                # the backpressure); a late answer then says nothing about the connection.
                if self._local_sends > 0 or self._last_stall >= started - options.ping_timeout:
                    continue
                failures += 1
                if failures >= options.ping_failures:
                    return (
                        EventKind.SESSION_LOST,
                        f"no answer to {failures} pings within {options.ping_timeout:g} s",
                    )
            else:
                failures = 0

    async def _watch_pod(self, live: _Session) -> tuple[EventKind, str]:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.options.pod_check_interval):
                    await self._check_pod_now.wait()
            self._check_pod_now.clear()
            try:
                info = await get_pod(self.api.endpoint, self._pod_path)
            except PodLookupError:
                continue  # the API is unreachable: the session's own health decides
            if info.status == 404:
                return EventKind.SESSION_LOST, f"pod {self.name} was deleted"
            if info.status == 200 and info.identity and info.identity != live.identity:
                return EventKind.POD_REPLACED, f"pod {self.name} was recreated (uid {info.uid})"

    async def _wait_session(self) -> _Session | None:
        deadline = time.monotonic() + self.options.connect_wait
        while not self._finished.is_set():
            live = self._current
            if live is not None and not live.dead:
                return live
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, 0.5)):
                    await self._ready.wait()
            if self._current is None:
                await asyncio.sleep(0)
        return None

    # -- one local TCP connection
    async def _handle_tcp(self, local: SocketStream, spec: PortSpec, listener: str) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        self._connection_ids += 1
        cid = self._connection_ids
        peer = local.peername
        peer_text = (
            format_address(str(peer[0]), int(peer[1]))
            if isinstance(peer, tuple) and len(peer) >= 2
            else str(peer)
        )
        fields: dict[str, object] = {
            "local": listener,
            "peer": peer_text,
            "remote": spec.remote,
            "protocol": spec.protocol.value,
            "connection": cid,
        }
        self._emit(EventKind.CONNECTION_OPENED, **fields)
        counting = _CountingStream(local, self, spec)
        try:
            error = await self._forward_tcp(counting, spec)
        except asyncio.CancelledError:
            _reset(local)
            self._emit(EventKind.CONNECTION_ERROR, error="stopped", **fields, **_bytes(counting))
            raise
        except Exception as exc:  # a bug here must not take the listener down
            log.exception("%s: connection %d failed", self.name, cid)
            error = f"internal error: {exc}"
        finally:
            self._connections.discard(task)
        if error:
            _reset(local)  # a reset tells the local client the stream was cut, unlike a FIN
            self._emit(EventKind.CONNECTION_ERROR, error=error, **fields, **_bytes(counting))
        else:
            await local.aclose()
            self._emit(EventKind.CONNECTION_CLOSED, **fields, **_bytes(counting))

    async def _forward_tcp(self, local: _CountingStream, spec: PortSpec) -> str:
        """Forward one connection; returns "" when it ended cleanly, else what went wrong."""
        live = await self._wait_session()
        if live is None:
            why = f": {self._last_error}" if self._last_error else ""
            return f"no session to the pod within {self.options.connect_wait:g} s{why}"
        try:
            forwarded = await live.session.open(spec.remote)
        except (StreamError, ProtocolError) as exc:
            self._check_pod_now.set()
            return f"cannot open a stream on the session: {exc}"
        # Helpers of this connection: all cancelled and awaited before it returns.
        error_text = asyncio.create_task(_read_error(forwarded.error_stream), name="error text")
        copying = asyncio.create_task(splice(local, forwarded.data), name="copy")
        lost = asyncio.create_task(live.lost.wait(), name="session lost")
        try:
            await asyncio.wait({copying, lost}, return_when=asyncio.FIRST_COMPLETED)
            if not copying.done():
                # The session is gone: its streams will never finish. Cut the connection.
                await cancel_and_wait(copying)
                return f"session lost: {live.reason}"
            result = copying.result()
            text = ""
            with contextlib.suppress(TimeoutError, StreamError):
                text = await asyncio.wait_for(asyncio.shield(error_text), ERROR_TEXT_WAIT_SECONDS)
        finally:
            await cancel_and_wait(copying, lost, error_text)
            await forwarded.error_stream.aclose()
        if text:
            self._check_pod_now.set()  # the pod may be gone or replaced: look now
            return text
        if live.dead:
            return f"session lost: {live.reason or live.session.session.broken}"
        if result.error is not None:
            return f"{type(result.error).__name__}: {result.error}"
        return ""

    # -- shutting down
    def report_stopped(self) -> None:
        if not self.stats.state.final:
            self._emit(EventKind.STOPPED)

    async def _shutdown(self) -> None:
        await self._close_servers()
        await cancel_and_wait(*self._connections)
        self._current = None
        for live in list(self._open_sessions):
            live.mark_lost("stopped")
            await self._drop(live)


class _UdpFlows:
    """The engine's side of one UDP relay: opens flows on the current session and turns the
    relay's flow events into connection events."""

    def __init__(self, forward: TargetForward, spec: PortSpec) -> None:
        self.forward = forward
        self.spec = spec
        self.listener = ""
        self._ids: dict[str, int] = {}

    async def open_stream(self) -> ForwardedStream:
        live = await self.forward._wait_session()
        if live is None:
            last = self.forward._last_error
            why = f": {last}" if last else ""
            raise StreamError(f"no session to the pod{why}")
        return await live.session.open(self.spec.remote, "udp")

    def on_event(self, flow: FlowEvent) -> None:
        forward = self.forward
        fields: dict[str, object] = {
            "local": self.listener,
            "peer": flow.peer,
            "remote": self.spec.remote,
            "protocol": self.spec.protocol.value,
        }
        if flow.kind is FlowEventKind.OPENED:
            forward._connection_ids += 1
            self._ids[flow.peer] = forward._connection_ids
            forward._emit(EventKind.CONNECTION_OPENED, connection=forward._connection_ids, **fields)
            return
        cid = self._ids.pop(flow.peer, 0)
        counts = {"bytes_in": flow.bytes_from_pod, "bytes_out": flow.bytes_to_pod}
        forward._count(self.spec, flow.bytes_from_pod, flow.bytes_to_pod)
        if flow.kind is FlowEventKind.CLOSED:
            forward._emit(EventKind.CONNECTION_CLOSED, connection=cid, **fields, **counts)
        else:
            forward._emit(
                EventKind.CONNECTION_ERROR, connection=cid, error=flow.message, **fields, **counts
            )


def _reset(stream: SocketStream) -> None:
    """Close with a TCP RST (SO_LINGER 0), not a FIN that would look like a clean end."""
    sock = stream.transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    stream.abort()


def _bytes(stream: _CountingStream) -> dict[str, object]:
    return {"bytes_in": stream.bytes_in, "bytes_out": stream.bytes_out}


async def _read_error(stream: ByteStream) -> str:
    parts: list[bytes] = []
    size = 0
    with contextlib.suppress(StreamError):
        while size < MAX_ERROR_TEXT_BYTES and (chunk := await stream.receive()):
            parts.append(chunk)
            size += len(chunk)
    return b"".join(parts)[:MAX_ERROR_TEXT_BYTES].decode("utf-8", "replace").strip()
