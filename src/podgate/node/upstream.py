"""The node gateway's StreamTarget for any CRI runtime: it asks the runtime for a one-time
streaming URL and connects to it as a SPDY client, as the API server's StreamTranslator does.

Exec and attach use one upstream connection each. Port-forward keeps one upstream SPDY session
per pod sandbox and opens a stream pair on it for every forwarded connection; a connection the
runtime cannot make is reported by the runtime itself on the pair's error stream, and that text
is handed on unchanged (UpstreamForwardError).

The pooled session offers podgate's UDP extension first; a runtime that has it (podgate's own)
takes it, any other (containerd, CRI-O) picks plain `portforward.k8s.io`, and a UDP forward to
one of its pods fails with RUNTIME_NO_UDP. TCP pairs are the same under either.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from podgate.aio.errors import BrokenStreamError, ForwardError, StreamError, StreamResetError
from podgate.aio.spdy import MAX_STREAMS_PER_SESSION
from podgate.aio.streams import DEFAULT_RECEIVE_BYTES, Buffer, ByteStream
from podgate.aio.tasks import cancel_and_wait
from podgate.node.cri_client import CriClient, CriError
from podgate.node.execforward import ExecForwarder
from podgate.proto.errors import ProtocolError
from podgate.proto.spdy import RstStatus
from podgate.streaming.client import (
    ExecResult,
    ForwardedStream,
    PortForwardSession,
    UpgradeError,
    endpoint_from_url,
    exec_spdy,
)
from podgate.streaming.target import ExecIO, PodRef, TargetError

log = logging.getLogger(__name__)

# An upstream port-forward session with no forwarded connection for this long is closed.
PORTFORWARD_IDLE_SECONDS = 60.0
# Forwards the gateway puts on one upstream session before it opens another: two streams
# each, within what podgate's streaming server accepts per session (MAX_STREAMS_PER_SESSION)
# with room for pairs still closing on its side. A runtime that refuses streams sooner
# (REFUSED_STREAM) marks the session full at what it carries.
FORWARDS_PER_UPSTREAM_SESSION = MAX_STREAMS_PER_SESSION // 2 - 16
# Sessions one forward tries (a pooled one that broke, or refused for being full) before it
# fails.
OPEN_ATTEMPTS = 4
# After the runtime resets a forwarded stream, how long its error text may take to arrive.
ERROR_TEXT_WAIT_SECONDS = 1.0
# Most error text kept from one pair's error stream (the runtime's is one line).
ERROR_TEXT_MAX_BYTES = 64 * 1024
# After a clean end of the data stream, how long error text may still take to arrive (it is
# written right after the end, on the same connection; only a pair that ended cleanly and
# whose error stream stays open pays this).
ERROR_TEXT_AFTER_EOF_SECONDS = 0.25
# apimachinery's NewInternalError prefix; the gateway's own Status adds it again.
_INTERNAL_ERROR_PREFIX = "Internal error occurred: "
# What a UDP forward meets when the runtime's streaming server lacks the extension.
RUNTIME_NO_UDP = "runtime does not support UDP port-forward"
# ...and when the gateway forwards through CRI Exec, whose forwarders carry one byte stream.
EXEC_NO_UDP = "UDP port-forward is not supported through the exec forwarder"


def pool_key(pod: PodRef) -> str:
    """Which pooled upstream session serves `pod` for its tenant: one per sandbox and user.

    A runtime without SPDY flow control (containerd, CRI-O) can only slow a session down as a
    whole, so a user whose client stops reading stalls the session's read loop; sharing it
    would stall every other user's forwards to the pod too. (A sandbox alone, for callers
    that name no tenant.)"""
    return f"{pod.sandbox_id} {pod.tenant}" if pod.tenant else pod.sandbox_id


class UpstreamForwardError(ForwardError):
    """The runtime could not forward the connection; the message is its own error text
    (e.g. `error forwarding port 9999 to pod …`), which the port-forward server relays to the
    client as is."""


def _failure(result: ExecResult) -> str | None:
    """The error of an exec that could not run (as opposed to one that exited non-zero)."""
    # client-go's text for a non-zero exit, as k8s.decode_exec_status gives it.
    if (
        result.error is None
        or result.error == f"command terminated with exit code {result.exit_code}"
    ):
        return None
    message = result.error
    if message.startswith(_INTERNAL_ERROR_PREFIX):
        message = message[len(_INTERNAL_ERROR_PREFIX) :]
    return message


async def relay_exec(
    url: str,
    io: ExecIO,
    *,
    ssl_context: ssl.SSLContext | None = None,
    want_stderr: bool | None = None,
) -> int:
    """Run an exec or attach session on a runtime's one-time streaming URL with `io` as its
    stdio; the command's exit code, or TargetError with the runtime's text.

    `want_stderr`: whether to open a stderr stream (the URL's request decides; by default one
    is opened unless there is a tty)."""
    try:
        endpoint, path = endpoint_from_url(url, ssl_context=ssl_context)
        result = await exec_spdy(
            endpoint,
            path,
            stdin=io.stdin,
            stdout=io.stdout,
            stderr=io.stderr,
            tty=io.tty,
            resizes=io.resizes,
            want_stdin=io.stdin is not None,
            want_stderr=want_stderr,
        )
    except UpgradeError as exc:
        raise TargetError(f"error connecting to the runtime's streaming server: {exc}") from exc
    except (StreamError, ProtocolError, ValueError) as exc:
        raise TargetError(f"error streaming from the runtime: {exc}") from exc
    message = _failure(result)
    if message is not None:
        raise TargetError(message)
    return result.exit_code


class CriTarget:
    """StreamTarget over a CRI runtime's streaming server."""

    def __init__(
        self,
        client: CriClient,
        *,
        ssl_context: ssl.SSLContext | None = None,
        idle_seconds: float = PORTFORWARD_IDLE_SECONDS,
        via_exec: bool = False,
        forwards_per_session: int = FORWARDS_PER_UPSTREAM_SESSION,
    ) -> None:
        self.client = client
        # Port-forward by a forwarder run through CRI Exec instead of CRI PortForward (for
        # runtimes whose own port-forward cannot reach sandboxed pods).
        self.exec_forwarder = ExecForwarder(client) if via_exec else None
        self.ssl_context = ssl_context
        self.idle_seconds = idle_seconds
        self.forwards_per_session = forwards_per_session
        self._sessions: dict[str, list[_PooledSession]] = {}
        self._connecting: dict[str, asyncio.Task[_PooledSession]] = {}
        self._closing: set[asyncio.Task[None]] = set()

    # -- exec / attach

    async def exec(
        self, pod: PodRef, container: str | None, command: Sequence[str], io: ExecIO
    ) -> int:
        container_id = _require(container)
        try:
            url = await self.client.exec_url(container_id, command, **_stdio(io))
        except CriError as exc:
            raise TargetError(str(exc)) from exc
        return await self._run(url, io)

    async def attach(self, pod: PodRef, container: str | None, io: ExecIO) -> int:
        container_id = _require(container)
        try:
            url = await self.client.attach_url(container_id, **_stdio(io))
        except CriError as exc:
            raise TargetError(str(exc)) from exc
        return await self._run(url, io)

    async def _run(self, url: str, io: ExecIO) -> int:
        return await relay_exec(url, io, ssl_context=self.ssl_context)

    # -- port-forward

    async def open_port(self, pod: PodRef, port: int, *, protocol: str = "tcp") -> ByteStream:
        if not pod.sandbox_id:
            raise TargetError(f"pod {pod} has no sandbox")
        if protocol not in ("tcp", "udp"):
            raise TargetError(f"unsupported port-forward protocol {protocol!r}")
        if self.exec_forwarder is not None:
            if protocol != "tcp":
                raise TargetError(EXEC_NO_UDP)
            return await self.exec_forwarder.open_port(pod, port)
        for _ in range(OPEN_ATTEMPTS):
            # The slot is taken before the pair is opened: concurrent opens spread over the
            # pool instead of all choosing the one session that looked free.
            entry, reused = await self._session(pod.sandbox_id, pool_key(pod))
            if protocol == "udp" and not entry.session.supports_udp:
                entry.release()
                raise TargetError(RUNTIME_NO_UDP)
            try:
                forwarded = await entry.session.open(port, protocol)
            except StreamError as exc:
                entry.release()
                if entry.usable and isinstance(exc, StreamResetError):
                    if exc.status == RstStatus.REFUSED_STREAM and entry.active:
                        # The runtime holds fewer streams per session than we assumed: this
                        # session is full at what it carries now; the next one takes the rest.
                        entry.capacity = entry.active
                        continue
                    # The runtime refused this pair alone; the session is fine.
                    raise TargetError(f"the runtime refused the stream: {exc}") from exc
                self._drop(entry)
                if reused:
                    continue  # it broke while pooled: try again on a fresh one
                raise TargetError(f"error forwarding through the runtime: {exc}") from exc
            return UpstreamStream(forwarded, port, entry.release)
        raise TargetError("error forwarding through the runtime: no upstream session took it")

    async def _session(self, sandbox_id: str, key: str) -> tuple[_PooledSession, bool]:
        """A pooled session with room for one more forward, its slot taken (release() gives
        it back), and whether it was pooled before; a new session is opened when every one is
        full. Only one is opened at a time per key: callers that find no room wait for it."""
        while True:
            entries = self._sessions.get(key, [])
            for entry in list(entries):
                if not entry.usable:
                    self._drop(entry)
                elif entry.active < entry.capacity:
                    entry.acquire()
                    return entry, True
            task = self._connecting.get(key)
            # A finished one (its done-callback not run yet) has its session in the pool
            # already, looked at above: awaiting it again would not yield, and would spin.
            if task is None or task.done():
                task = asyncio.create_task(self._connect(sandbox_id, key), name=f"pf connect {key}")
                self._connecting[key] = task
                task.add_done_callback(lambda t: self._connected(key, t))
            # Shielded: one caller giving up does not abort the others' connection.
            entry = await asyncio.shield(task)
            if entry.usable and entry.active < entry.capacity:
                entry.acquire()
                return entry, False
            # Filled by the callers that woke first: look again (another session follows).

    async def _connect(self, sandbox_id: str, key: str) -> _PooledSession:
        try:
            url = await self.client.port_forward_url(sandbox_id)
            endpoint, path = endpoint_from_url(url, ssl_context=self.ssl_context)
            session = await PortForwardSession.connect(endpoint, path, udp=True)
        except CriError as exc:
            raise TargetError(str(exc)) from exc
        except UpgradeError as exc:
            raise TargetError(f"error connecting to the runtime's streaming server: {exc}") from exc
        except (StreamError, ProtocolError, ValueError) as exc:
            raise TargetError(f"error connecting to the runtime's streaming server: {exc}") from exc
        entry = _PooledSession(key, session, capacity=self.forwards_per_session)
        self._sessions.setdefault(key, []).append(entry)
        entry.on_idle = self._expire
        entry.schedule_idle(self.idle_seconds)
        return entry

    def _connected(self, key: str, task: asyncio.Task[_PooledSession]) -> None:
        if self._connecting.get(key) is task:
            del self._connecting[key]
        if not task.cancelled():
            task.exception()  # retrieved here too, in case every caller was cancelled

    def _expire(self, entry: _PooledSession) -> None:
        if entry.active == 0:
            log.debug("port-forward session for %s idle, closing", entry.key)
            self._drop(entry)

    def _drop(self, entry: _PooledSession) -> None:
        entries = self._sessions.get(entry.key, [])
        if entry in entries:
            entries.remove(entry)
            if not entries:
                del self._sessions[entry.key]
        if entry.closed:
            return
        entry.closed = True
        entry.cancel_idle()
        task = asyncio.create_task(entry.session.aclose(), name=f"pf close {entry.key}")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    @property
    def pooled_sessions(self) -> dict[str, list[PortForwardSession]]:
        """The upstream sessions of each sandbox and tenant, by pool_key (for status pages and
        tests)."""
        return {key: [e.session for e in entries] for key, entries in self._sessions.items()}

    async def aclose(self) -> None:
        """Close every pooled upstream session."""
        connecting = list(self._connecting.values())
        for task in connecting:
            task.cancel()
        await asyncio.gather(*connecting, return_exceptions=True)
        for entries in list(self._sessions.values()):
            for entry in list(entries):
                self._drop(entry)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


@dataclass(eq=False, slots=True)
class _PooledSession:
    key: str  # pool_key(): the sandbox, and the tenant it serves
    session: PortForwardSession
    capacity: int = 1  # forwards it may carry at once
    active: int = 0
    closed: bool = False
    on_idle: Callable[[_PooledSession], None] | None = None
    _idle: asyncio.TimerHandle | None = field(default=None, repr=False)
    _idle_seconds: float = 0.0

    @property
    def usable(self) -> bool:
        spdy = self.session.session
        return not self.closed and spdy.broken is None and not spdy.goaway_received

    def acquire(self) -> None:
        self.active += 1
        self.cancel_idle()

    def release(self) -> None:
        self.active -= 1
        if self.active == 0 and not self.closed:
            self.schedule_idle(self._idle_seconds)

    def schedule_idle(self, seconds: float) -> None:
        self._idle_seconds = seconds
        self.cancel_idle()
        if self.on_idle is not None:
            self._idle = asyncio.get_running_loop().call_later(seconds, self.on_idle, self)

    def cancel_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None


class UpstreamStream(ByteStream):
    """A forwarded connection's data stream; when the runtime ends it with error text, that
    text is raised as UpstreamForwardError."""

    def __init__(self, forwarded: ForwardedStream, port: int, on_close: Callable[[], None]) -> None:
        self.port = port
        self._data = forwarded.data
        self._error_stream = forwarded.error_stream
        self._error_text = bytearray()
        self._text_arrived = asyncio.Event()
        self._on_close: Callable[[], None] | None = on_close
        # Read from the start, as client-go does: the runtime may write it at any time.
        self._error_reader = asyncio.create_task(self._read_error(), name=f"pf {port} error")

    @property
    def error_text(self) -> str:
        return self._error_text.decode(errors="replace")

    async def _read_error(self) -> None:
        with contextlib.suppress(StreamError):
            while chunk := await self._error_stream.receive():
                room = ERROR_TEXT_MAX_BYTES - len(self._error_text)
                self._error_text += chunk[: max(room, 0)]
                self._text_arrived.set()

    async def _upstream_error(self, *, wait: bool) -> UpstreamForwardError | None:
        if wait:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._error_reader), ERROR_TEXT_WAIT_SECONDS)
        else:
            # containerd ends the data stream before it writes the error text, so the text may
            # still be on its way: wait briefly for text, or for the error stream's end.
            texted = asyncio.ensure_future(self._text_arrived.wait())
            await asyncio.wait(
                {texted, self._error_reader},
                timeout=ERROR_TEXT_AFTER_EOF_SECONDS,
                return_when=asyncio.FIRST_COMPLETED,
            )
            texted.cancel()
        if self._error_text:
            return UpstreamForwardError(self.error_text)
        return None

    def _lost(self, exc: BrokenStreamError) -> UpstreamForwardError:
        """The session to the runtime went away under the pair (the runtime crashed or
        restarted): for the client an error like any other failed forward, never the end
        of a connection the pod closed."""
        return UpstreamForwardError(
            f"error forwarding port {self.port}: lost the connection to the runtime: {exc}"
        )

    async def receive(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        try:
            chunk = await self._data.receive(max_bytes)
        except StreamResetError as exc:
            error = await self._upstream_error(wait=True)
            if error is None:
                raise
            raise error from exc
        except BrokenStreamError as exc:
            raise self._lost(exc) from exc
        if not chunk:
            # A kubelet-style server ends a failed pair with FIN, not RST, after the text.
            error = await self._upstream_error(wait=False)
            if error is not None:
                raise error
        return chunk

    async def send(self, data: Buffer) -> None:
        try:
            await self._data.send(data)
        except StreamResetError as exc:
            error = await self._upstream_error(wait=True)
            if error is None:
                raise
            raise error from exc
        except BrokenStreamError as exc:
            raise self._lost(exc) from exc

    async def send_eof(self) -> None:
        await self._data.send_eof()

    async def aclose(self) -> None:
        await self._data.aclose()
        await self._error_stream.aclose()
        await cancel_and_wait(self._error_reader)
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()


def _require(container: str | None) -> str:
    if not container:
        raise TargetError("no container given")
    return container


def _stdio(io: ExecIO) -> dict[str, bool]:
    """CRI's stdio flags for the client's streams (CRI forbids stderr with a tty)."""
    return {
        "tty": io.tty,
        "stdin": io.stdin is not None,
        "stdout": io.stdout is not None,
        "stderr": io.stderr is not None and not io.tty,
    }


__all__ = [
    "ERROR_TEXT_MAX_BYTES",
    "ERROR_TEXT_WAIT_SECONDS",
    "EXEC_NO_UDP",
    "PORTFORWARD_IDLE_SECONDS",
    "RUNTIME_NO_UDP",
    "CriTarget",
    "UpstreamForwardError",
    "UpstreamStream",
    "relay_exec",
]
