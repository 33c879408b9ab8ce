"""Helpers for the UDP port-forward tests (imported by module name from every suite that needs
them; keep the name unique).

Every exchange is windowed (at most WINDOW datagrams in flight) so loopback never drops, and
every datagram carries a unique sequence number: a reply counts only when it matches an
outstanding request byte for byte, so the matched count equals the sent count exactly or the
test fails.
"""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from podgate.aio.streams import ByteStream
from podgate.proto.datagram import DatagramDecoder, encode_datagram

DATAGRAMS = 10_000
# Datagrams in flight at once: well inside any socket buffer, so nothing is lost on loopback.
WINDOW = 64
# Bound on one whole exchange.
EXCHANGE_TIMEOUT_SECONDS = 120.0

# A UDP echo server for a container: binds exactly argv[1]:argv[2], echoes every datagram,
# says "listening" once bound. SIGTERM ends it at once.
UDP_ECHO_SERVER = r"""
import os, signal, socket, sys
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
host, port = sys.argv[1], int(sys.argv[2])
family = socket.AF_INET6 if ":" in host else socket.AF_INET
s = socket.socket(family, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
s.bind((host, port))
print("listening", host, port, flush=True)
while True:
    data, peer = s.recvfrom(65535)
    s.sendto(data, peer)
"""


async def wait_until(
    predicate: Callable[[], bool], what: str, timeout: float = 10.0, poll: float = 0.01
) -> None:
    """Poll `predicate` until it holds; AssertionError naming `what` after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        if predicate():
            return
        if loop.time() >= deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        await asyncio.sleep(poll)


def payload(tag: bytes, seq: int, rng: random.Random) -> bytes:
    """tag, an 8-digit sequence number, and 0-200 random bytes (sizes vary, content too)."""
    return tag + b"%08d" % seq + rng.randbytes(rng.randrange(0, 201))


@dataclass
class Tally:
    """What an exchange saw: matched replies, and anything that did not match."""

    sent: int = 0
    matched: int = 0
    unmatched: list[bytes] = field(default_factory=list)
    payload_bytes: int = 0  # of every datagram sent (each came back if all matched)


async def exchange_framed(
    data: ByteStream,
    count: int = DATAGRAMS,
    *,
    window: int = WINDOW,
    tag: bytes = b"S",
    seed: int = 1,
) -> Tally:
    """`count` datagrams through a UDP flow's data stream (framed by hand) to an echo server."""
    rng = random.Random(seed)
    outstanding: dict[bytes, bytes] = {}
    slots = asyncio.Semaphore(window)
    tally = Tally()

    async def send() -> None:
        for seq in range(count):
            await slots.acquire()
            item = payload(tag, seq, rng)
            outstanding[item[: len(tag) + 8]] = item
            await data.send(encode_datagram(item))
            tally.sent += 1
            tally.payload_bytes += len(item)

    async def receive() -> None:
        decoder = DatagramDecoder()
        while tally.matched < count:
            chunk = await data.receive()
            if not chunk:
                raise AssertionError(f"the flow ended after {tally.matched} of {count} replies")
            for reply in decoder.feed(chunk):
                key = reply[: len(tag) + 8]
                if outstanding.get(key) == reply:
                    del outstanding[key]
                    tally.matched += 1
                    slots.release()
                else:
                    tally.unmatched.append(reply)

    async with asyncio.timeout(EXCHANGE_TIMEOUT_SECONDS), asyncio.TaskGroup() as group:
        group.create_task(send())
        group.create_task(receive())
    return tally


class UdpEcho:
    """A UDP echo on 127.0.0.1 in this event loop; echoes the empty datagram too (asyncio's
    datagram transport would silently skip sending that)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.setblocking(False)
        self.port: int = self.sock.getsockname()[1]
        self.received = 0
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(self.sock.fileno(), self._readable)

    def _readable(self) -> None:
        while True:
            try:
                data, peer = self.sock.recvfrom(65535)
            except BlockingIOError:
                return
            self.received += 1
            self.sock.sendto(data, peer)

    def close(self) -> None:
        if self.sock.fileno() != -1:
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()


class LocalPeer(asyncio.DatagramProtocol):
    """A local UDP client of a relay: its own socket, its own replies."""

    def __init__(self) -> None:
        self.transport: asyncio.DatagramTransport | None = None
        self.replies: asyncio.Queue[tuple[bytes, Any]] = asyncio.Queue()

    @classmethod
    async def open(cls, relay_address: tuple[Any, ...]) -> LocalPeer:
        loop = asyncio.get_running_loop()
        _, peer = await loop.create_datagram_endpoint(
            cls, local_addr=("127.0.0.1", 0), remote_addr=relay_address[:2]
        )
        return peer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # asyncio's datagram transport does not subclass DatagramTransport (3.11).
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.replies.put_nowait((data, addr))

    @property
    def address(self) -> tuple[Any, ...]:
        assert self.transport is not None
        sockname: tuple[Any, ...] = self.transport.get_extra_info("sockname")
        return sockname

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.sendto(data)

    async def reply(self, timeout: float = 10.0) -> bytes:
        data, _ = await asyncio.wait_for(self.replies.get(), timeout)
        return data

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    async def exchange(
        self, count: int, *, window: int = WINDOW, tag: bytes = b"P", seed: int = 1
    ) -> Tally:
        """`count` datagrams through the relay to an echo, `window` in flight."""
        rng = random.Random(seed)
        outstanding: dict[bytes, bytes] = {}
        slots = asyncio.Semaphore(window)
        tally = Tally()

        async def send() -> None:
            for seq in range(count):
                await slots.acquire()
                item = payload(tag, seq, rng)
                outstanding[item[: len(tag) + 8]] = item
                self.send(item)
                tally.sent += 1

        async def receive() -> None:
            while tally.matched < count:
                reply, _ = await self.replies.get()
                key = reply[: len(tag) + 8]
                if outstanding.get(key) == reply:
                    del outstanding[key]
                    tally.matched += 1
                    slots.release()
                else:
                    tally.unmatched.append(reply)

        async with asyncio.timeout(EXCHANGE_TIMEOUT_SECONDS), asyncio.TaskGroup() as group:
            group.create_task(send())
            group.create_task(receive())
        return tally
