"""What a gateway adds around a streaming session: per-port decisions, accounting, limits.

The streaming handlers call these hooks; the runtime's own streaming server passes none.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from podgate.aio.spdy import ControlBudget
from podgate.aio.streams import DEFAULT_RECEIVE_BYTES, Buffer, ByteStream


@dataclass(slots=True)
class ForwardRecord:
    """One forwarded connection (TCP) or flow (UDP), for audit and metrics.

    For UDP the byte counts are those of the framed stream: each datagram's payload plus its
    2-byte length."""

    port: int
    protocol: str = "tcp"  # tcp | udp
    started: float = field(default_factory=time.monotonic)
    bytes_in: int = 0  # client → pod
    bytes_out: int = 0  # pod → client
    outcome: str = "allowed"  # allowed | denied | error
    reason: str = ""

    @property
    def duration(self) -> float:
        return time.monotonic() - self.started


class SessionHooks:
    """Defaults: allow everything, record nothing. A gateway subclasses this."""

    #: bytes per second each way for each stream; None = unlimited
    max_bytes_per_sec: float | None = None
    #: forwarded connections one port-forward session may carry at once; None = the SPDY
    #: session's default stream cap
    max_forwards: int | None = None
    #: the control-frame budget the session charges (shared among sessions of one user); None
    #: = one of the session's own
    control_budget: ControlBudget | None = None

    def negotiated(self, transport: str, protocol: str) -> None:
        """The upgrade was accepted with this transport and subprotocol."""

    def flooded(self) -> None:
        """The session was ended because the client flooded it with control frames."""

    def check_port(self, port: int, protocol: str = "tcp") -> str | None:
        """None to allow a forward to `port` over `protocol` (tcp, udp), else the reason it is
        refused."""
        return None

    def forward_started(self, record: ForwardRecord) -> None:
        pass

    def forward_finished(self, record: ForwardRecord) -> None:
        pass

    def wrap(self, stream: ByteStream) -> ByteStream:
        if self.max_bytes_per_sec:
            return ThrottledStream(stream, self.max_bytes_per_sec)
        return stream


NO_HOOKS = SessionHooks()


class ThrottledStream(ByteStream):
    """A token bucket on both directions of a stream (one second of burst)."""

    def __init__(self, inner: ByteStream, rate: float) -> None:
        self.inner = inner
        self.rate = rate
        self._buckets = {"in": _Bucket(rate), "out": _Bucket(rate)}

    async def receive(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        data = await self.inner.receive(min(max_bytes, max(int(self.rate), 1)))
        await self._buckets["in"].take(len(data))
        return data

    async def send(self, data: Buffer) -> None:
        view = memoryview(data)
        step = max(int(self.rate), 1)
        for start in range(0, len(view), step):
            piece = view[start : start + step]
            await self._buckets["out"].take(len(piece))
            await self.inner.send(piece)

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()


class _Bucket:
    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.tokens = rate
        self.stamp = time.monotonic()

    async def take(self, n: int) -> None:
        now = time.monotonic()
        self.tokens = min(self.rate, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        self.tokens -= n
        if self.tokens < 0:
            await asyncio.sleep(-self.tokens / self.rate)
