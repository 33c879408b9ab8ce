"""Sockets made ahead of time inside a pod's network namespace, so that a new forwarded
connection takes one at once: no hop to a worker thread and no /proc access per connection.

Per pod, the pool holds the pod process's pidfd and a file descriptor of its netns, both opened
once (the pid's start time checked then, so a reused pid is never taken for the pod). The
worker thread makes unconnected IPv4 TCP sockets in batches, one setns pair per batch, and
refills in the background when the pool runs low. When the pod's process exits, its pidfd
turns readable and the pool closes everything it holds, so the namespace is not kept alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections import deque
from collections.abc import Callable
from typing import Final

from podgate.linux.ns import NamespaceError, NetnsWorker, SocketMaker, in_netns

log = logging.getLogger(__name__)

# Unconnected sockets kept ready per pod (file descriptors held while the pod is up; an idle
# pod keeps at most this many).
POOL_SOCKETS: Final = 16
# A refill starts when fewer than this many are left, so a steady stream of connections
# never waits for one.
REFILL_BELOW: Final = 8


def _start_time(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return int(fields[19])  # field 22: start time in clock ticks since boot


def _make_batch(ns_fd: int, count: int) -> list[socket.socket]:
    """On a worker thread: `count` IPv4 TCP sockets in the netns of `ns_fd`."""
    made: list[socket.socket] = []
    with in_netns(f"/proc/self/fd/{ns_fd}"):
        try:
            for _ in range(count):
                made.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        except OSError:
            if not made:
                raise
    for sock in made:
        sock.setblocking(False)
    return made


class PodSockets:
    """The pool of one pod; `socket()` serves IPv4 TCP from it, anything else via the worker."""

    def __init__(
        self, worker: NetnsWorker, pid: int, start_time: int, on_gone: Callable[[], None]
    ) -> None:
        self._worker = worker
        self._loop = asyncio.get_running_loop()
        self._ready: deque[socket.socket] = deque()
        self._refill: asyncio.Task[None] | None = None
        self._on_gone = on_gone
        self._closed = False
        self._pidfd = os.pidfd_open(pid)
        try:
            if _start_time(pid) != start_time:
                raise NamespaceError(0, f"process {pid} is not the pod's any more")
            self._ns_fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            os.close(self._pidfd)
            raise
        self._loop.add_reader(self._pidfd, self._gone)

    @property
    def ready(self) -> int:
        return len(self._ready)

    async def socket(self, path: str, family: int, type: int = socket.SOCK_STREAM) -> socket.socket:
        if family != socket.AF_INET or type != socket.SOCK_STREAM or self._closed:
            return await self._worker.socket(path, family, type)
        if not self._ready:
            await self._fill()
        sock = self._ready.popleft()
        if len(self._ready) < REFILL_BELOW and self._refill is None:
            self._refill = asyncio.create_task(self._background_fill(), name="netns pool")
        return sock

    async def _fill(self) -> None:
        batch = await self._worker.call(_make_batch, self._ns_fd, POOL_SOCKETS)
        if self._closed:
            for sock in batch:
                sock.close()
            raise NamespaceError(0, "the pod's network namespace is gone")
        self._ready.extend(batch)

    async def _background_fill(self) -> None:
        try:
            await self._fill()
        except OSError as exc:  # the next connection's own fill reports it
            log.debug("netns socket pool refill failed: %s", exc)
        finally:
            self._refill = None

    def _gone(self) -> None:
        self.close()
        self._on_gone()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._pidfd)
        if self._refill is not None:
            self._refill.cancel()
        while self._ready:
            self._ready.popleft().close()
        os.close(self._pidfd)
        os.close(self._ns_fd)


class NetnsPools:
    """One PodSockets per pod process, made on the first connection and dropped when the
    process exits (or at close)."""

    def __init__(self, worker: NetnsWorker) -> None:
        self.worker = worker
        self._pools: dict[tuple[int, int], PodSockets] = {}

    def __len__(self) -> int:
        return len(self._pools)

    def for_process(self, pid: int, start_time: int) -> SocketMaker:
        """The pod's pool; the plain worker if one cannot be made (the dial reports why)."""
        key = (pid, start_time)
        pool = self._pools.get(key)
        if pool is None:
            try:
                pool = PodSockets(self.worker, pid, start_time, lambda: self._drop(key))
            except (OSError, ValueError) as exc:
                log.debug("no socket pool for process %d: %s", pid, exc)
                return self.worker
            self._pools[key] = pool
        return pool

    def _drop(self, key: tuple[int, int]) -> None:
        self._pools.pop(key, None)

    def close(self) -> None:
        for pool in self._pools.values():
            with contextlib.suppress(OSError):
                pool.close()
        self._pools.clear()
