"""The local side of a UDP port-forward: one UDP socket, one forwarded flow per local peer.

`kubectl port-forward` has nothing like it: UDP travels over podgate's UDP extension
(podgate.proto.datagram), where one stream pair is one flow to one UDP socket in the pod. The
relay keeps the mapping a NAT would:

- a datagram from a new local peer (address, port) opens a stream pair for it
  (`open_stream()`, e.g. `session.open(port, "udp")`); datagrams that arrive while it opens
  wait in a small queue;
- what comes back on that pair goes to that peer only;
- a peer that sent and received nothing for `idle_timeout` seconds has its flow closed (FIN;
  the pod side then closes its socket); its next datagram opens a new one;
- a flow that fails (the stream cannot be opened, breaks, or the server writes error text) is
  reported through `on_event` and the counters, and the peer's next datagram opens a new one;
- at most `max_peers` flows exist at once; datagrams from further peers are dropped, with a
  warning when the limit is first hit.

Datagrams are dropped, never queued without bound: a full per-peer queue or a local peer that
does not read loses datagrams as a full socket buffer would. Counters are in `stats` for a
status display; `on_event` sees each flow open, close and fail.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final, Protocol

from podgate.aio.errors import StreamError
from podgate.aio.streams import ByteStream
from podgate.aio.tasks import TaskSet, cancel_and_wait
from podgate.proto.datagram import DatagramDecoder, TruncatedDatagramError, encode_datagram

__all__ = [
    "CLOSE_WAIT_SECONDS",
    "DEFAULT_IDLE_TIMEOUT_SECONDS",
    "MAX_PEERS",
    "PEER_QUEUE_DATAGRAMS",
    "DatagramChannel",
    "FlowEvent",
    "FlowEventKind",
    "UdpRelay",
    "UdpRelayStats",
]

log = logging.getLogger(__name__)

# kube-proxy's default UDP conntrack timeout is 30 s, common NATs use 30-120 s; a minute keeps
# request/response protocols (DNS, syslog) on one flow without holding dead ones for long.
DEFAULT_IDLE_TIMEOUT_SECONDS: Final = 60.0
# Flows at once: each is two SPDY streams, two tasks and a socket in the pod.
MAX_PEERS: Final = 1024
# Datagrams one peer may have waiting for its stream (while it opens, or when it is slow);
# more are dropped, as a full socket buffer would drop them.
PEER_QUEUE_DATAGRAMS: Final = 1024
# After our FIN, how long the pod side may take to end the flow before it is reset, seconds.
CLOSE_WAIT_SECONDS: Final = 5.0
# Once the data stream ended, how long the server's error text may take to arrive, seconds.
ERROR_WAIT_SECONDS: Final = 1.0
# Bounds of the idle sweep period (a quarter of the idle timeout), seconds.
MIN_SWEEP_SECONDS: Final = 0.01
MAX_SWEEP_SECONDS: Final = 1.0

Address = tuple[Any, ...]  # what the socket reports: (host, port) or (host, port, flow, scope)


class DatagramChannel(Protocol):
    """One forwarded UDP flow, as PortForwardSession.open(port, "udp") returns it."""

    @property
    def data(self) -> ByteStream: ...

    async def error(self) -> str: ...

    async def aclose(self) -> None: ...


OpenStream = Callable[[], Awaitable[DatagramChannel]]


class FlowEventKind(StrEnum):
    OPENED = "opened"  # a new peer got its stream pair
    CLOSED = "closed"  # its flow ended cleanly (idle, relay closed, or the pod side ended it)
    FAILED = "failed"  # it could not be opened or broke; `message` says why
    REFUSED = "refused"  # a new peer was turned away at the peer limit


@dataclass(frozen=True, slots=True)
class FlowEvent:
    kind: FlowEventKind
    peer: str  # "host:port" or "[v6]:port"
    datagrams_to_pod: int = 0
    bytes_to_pod: int = 0
    datagrams_from_pod: int = 0
    bytes_from_pod: int = 0
    message: str = ""


@dataclass(slots=True)
class UdpRelayStats:
    """Totals since the relay started. Bytes are payload bytes (no framing)."""

    datagrams_to_pod: int = 0
    bytes_to_pod: int = 0
    datagrams_from_pod: int = 0
    bytes_from_pod: int = 0
    peers: int = 0  # flows open now
    flows_opened: int = 0
    flows_expired: int = 0  # closed for being idle
    errors: int = 0  # flows that failed
    dropped: int = 0  # datagrams lost here: full queues, the peer limit, failed opens
    peers_refused: int = 0  # datagrams from new peers dropped at the peer limit


def format_peer(addr: Address) -> str:
    host, port = str(addr[0]), addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(eq=False, slots=True)
class _Flow:
    addr: Address
    label: str
    last_active: float
    queue: collections.deque[bytes] = field(default_factory=collections.deque)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    closing: bool = False
    datagrams_to_pod: int = 0
    bytes_to_pod: int = 0
    datagrams_from_pod: int = 0
    bytes_from_pod: int = 0
    task: asyncio.Task[None] | None = None

    def event(self, kind: FlowEventKind, message: str = "") -> FlowEvent:
        return FlowEvent(
            kind,
            self.label,
            self.datagrams_to_pod,
            self.bytes_to_pod,
            self.datagrams_from_pod,
            self.bytes_from_pod,
            message,
        )


class _LocalSocket(asyncio.DatagramProtocol):
    def __init__(self, relay: UdpRelay) -> None:
        self.relay = relay
        # The transport's own flow control: set while its send buffer is over the high mark.
        self.paused = False

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False

    def datagram_received(self, data: bytes, addr: Address) -> None:
        self.relay._from_peer(data, addr)

    def error_received(self, exc: Exception) -> None:
        # A local peer went away (ICMP); its flow ends by itself when idle.
        log.debug("%s: local socket: %s", self.relay.name, exc)


class UdpRelay:
    """Relays datagrams between local peers on `local` and per-peer forwarded flows."""

    def __init__(
        self,
        open_stream: OpenStream,
        local: tuple[str, int],
        *,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT_SECONDS,
        max_peers: int = MAX_PEERS,
        on_event: Callable[[FlowEvent], None] | None = None,
        name: str = "udp relay",
    ) -> None:
        if idle_timeout <= 0:
            raise ValueError("idle_timeout must be positive")
        if max_peers < 1:
            raise ValueError("max_peers must be at least 1")
        self.open_stream = open_stream
        self.local = local
        self.idle_timeout = idle_timeout
        self.max_peers = max_peers
        self.on_event = on_event
        self.name = name
        self.stats = UdpRelayStats()
        self._flows: dict[Address, _Flow] = {}
        self._tasks = TaskSet("udp flows", log)
        self._transport: asyncio.DatagramTransport | None = None
        self._socket: _LocalSocket | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._at_limit = False
        self._closed = False

    # -- lifecycle
    async def start(self) -> None:
        """Bind the local socket and start relaying."""
        loop = asyncio.get_running_loop()
        transport, protocol = await loop.create_datagram_endpoint(
            lambda: _LocalSocket(self), local_addr=self.local
        )
        self._transport, self._socket = transport, protocol
        self._sweeper = loop.create_task(self._sweep(), name=f"{self.name} idle sweep")

    @property
    def address(self) -> Address:
        """The bound local address (the real port when `local` asked for port 0)."""
        if self._transport is None:
            raise RuntimeError("the relay is not started")
        sockname: Address = self._transport.get_extra_info("sockname")
        return sockname

    @property
    def peers(self) -> list[str]:
        """Local peers with a flow now."""
        return [flow.label for flow in self._flows.values()]

    async def aclose(self) -> None:
        """Stop receiving, close every flow (FIN, then a bounded wait), release the socket."""
        if self._closed:
            return
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._transport is not None:
            self._transport.close()
        for flow in list(self._flows.values()):
            self._close_flow(flow)
        await self._tasks.aclose(CLOSE_WAIT_SECONDS + ERROR_WAIT_SECONDS)
        if self._sweeper is not None:
            await cancel_and_wait(self._sweeper)

    async def __aenter__(self) -> UdpRelay:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- local side
    def _from_peer(self, data: bytes, addr: Address) -> None:
        if self._closed:
            return
        flow = self._flows.get(addr)
        if flow is None:
            flow = self._new_flow(addr)
            if flow is None:
                return
        if len(flow.queue) >= PEER_QUEUE_DATAGRAMS:
            self.stats.dropped += 1
            return
        flow.queue.append(data)
        flow.last_active = asyncio.get_running_loop().time()
        flow.wakeup.set()

    def _new_flow(self, addr: Address) -> _Flow | None:
        if self._closed:
            return None  # a datagram that arrived while closing
        label = format_peer(addr)
        if len(self._flows) >= self.max_peers:
            self.stats.dropped += 1
            self.stats.peers_refused += 1
            if not self._at_limit:
                self._at_limit = True
                log.warning(
                    "%s: %d peers have flows, the limit: dropping datagrams from new peers "
                    "(first: %s) until one goes idle",
                    self.name,
                    self.max_peers,
                    label,
                )
                self._emit(FlowEvent(FlowEventKind.REFUSED, label, message="peer limit reached"))
            return None
        self._at_limit = False
        loop = asyncio.get_running_loop()
        flow = _Flow(addr, label, loop.time())
        self._flows[addr] = flow
        self.stats.peers = len(self._flows)
        flow.task = self._tasks.spawn(self._run_flow(flow), name=f"{self.name} {label}")
        return flow

    def _to_peer(self, flow: _Flow, datagram: bytes) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            self.stats.dropped += 1
            return
        if self._socket is not None and self._socket.paused:
            self.stats.dropped += 1  # replies pile up faster than the kernel takes them
            return
        transport.sendto(datagram, flow.addr)
        flow.datagrams_from_pod += 1
        flow.bytes_from_pod += len(datagram)
        self.stats.datagrams_from_pod += 1
        self.stats.bytes_from_pod += len(datagram)

    # -- flows
    async def _run_flow(self, flow: _Flow) -> None:
        try:
            try:
                channel = await self.open_stream()
            except Exception as exc:  # whatever the opener raises: report it, try again later
                self._failed(flow, f"cannot open a stream: {exc}")
                return
            self.stats.flows_opened += 1
            self._emit(flow.event(FlowEventKind.OPENED))
            log.debug("%s: flow for %s opened", self.name, flow.label)
            try:
                failure = await self._relay(flow, channel)
            except Exception as exc:  # a bug below must not leave the task's error unseen
                log.exception("%s: flow for %s", self.name, flow.label)
                failure = f"{type(exc).__name__}: {exc}"
            if failure:
                self._failed(flow, failure)
            else:
                log.debug("%s: flow for %s closed", self.name, flow.label)
                self._emit(flow.event(FlowEventKind.CLOSED))
        finally:
            self._forget(flow)

    async def _relay(self, flow: _Flow, channel: DatagramChannel) -> str:
        """Run the flow to its end; returns why it failed ("" when it ended cleanly)."""
        data = channel.data
        reader = asyncio.create_task(self._pod_to_peer(flow, data), name=f"{flow.label} in")
        writer = asyncio.create_task(self._peer_to_pod(flow, data), name=f"{flow.label} out")
        problem = ""
        try:
            done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            if writer in done and writer.exception() is None:
                # We sent FIN: the pod side ends the flow in turn.
                await asyncio.wait({reader}, timeout=CLOSE_WAIT_SECONDS)
            for task in (reader, writer):
                if task.done() and (exc := task.exception()) is not None:
                    problem = problem or str(exc) or type(exc).__name__
            if not reader.done():
                problem = problem or "the pod side did not end the flow"
        finally:
            await cancel_and_wait(reader, writer)
            text = ""
            with contextlib.suppress(TimeoutError, StreamError):
                text = await asyncio.wait_for(channel.error(), ERROR_WAIT_SECONDS)
            with contextlib.suppress(StreamError):
                await channel.aclose()
        if text:
            return text  # the server's own words beat what we saw of it
        if not problem and not flow.closing:
            log.debug("%s: the pod side ended the flow for %s", self.name, flow.label)
        return problem

    async def _peer_to_pod(self, flow: _Flow, data: ByteStream) -> None:
        while True:
            if flow.queue:
                batch = list(flow.queue)
                flow.queue.clear()
                await data.send(b"".join(encode_datagram(d) for d in batch))
                size = sum(len(d) for d in batch)
                flow.datagrams_to_pod += len(batch)
                flow.bytes_to_pod += size
                self.stats.datagrams_to_pod += len(batch)
                self.stats.bytes_to_pod += size
                continue
            if flow.closing:
                await data.send_eof()
                return
            flow.wakeup.clear()
            await flow.wakeup.wait()

    async def _pod_to_peer(self, flow: _Flow, data: ByteStream) -> None:
        decoder = DatagramDecoder()
        loop = asyncio.get_running_loop()
        while chunk := await data.receive():
            for datagram in decoder.feed(chunk):
                self._to_peer(flow, datagram)
            flow.last_active = loop.time()
        try:
            decoder.receive_eof()
        except TruncatedDatagramError as exc:
            raise StreamError(str(exc)) from exc

    def _failed(self, flow: _Flow, message: str) -> None:
        self.stats.errors += 1
        log.warning("%s: flow for %s failed: %s", self.name, flow.label, message)
        self._emit(flow.event(FlowEventKind.FAILED, message))

    def _close_flow(self, flow: _Flow) -> None:
        """Finish the flow (queued datagrams still go first) and let the peer start anew."""
        flow.closing = True
        flow.wakeup.set()
        if self._flows.get(flow.addr) is flow:
            del self._flows[flow.addr]
            self.stats.peers = len(self._flows)

    def _forget(self, flow: _Flow) -> None:
        self.stats.dropped += len(flow.queue)  # never sent: the flow ended first
        flow.queue.clear()
        if self._flows.get(flow.addr) is flow:
            del self._flows[flow.addr]
            self.stats.peers = len(self._flows)

    async def _sweep(self) -> None:
        period = min(max(self.idle_timeout / 4, MIN_SWEEP_SECONDS), MAX_SWEEP_SECONDS)
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(period)
            now = loop.time()
            for flow in list(self._flows.values()):
                if now - flow.last_active >= self.idle_timeout:
                    self.stats.flows_expired += 1
                    log.debug("%s: flow for %s idle, closing", self.name, flow.label)
                    self._close_flow(flow)

    def _emit(self, event: FlowEvent) -> None:
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:
                log.exception("%s: event handler failed", self.name)
