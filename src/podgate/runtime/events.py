"""Container lifecycle events for CRI GetContainerEvents: one bounded queue per subscriber.

Publishing never waits: the runtime hands each event to every subscriber's queue and goes on.
A subscriber whose queue is full (it stopped reading) is ended, not waited for and not fed a
gap: its stream fails with `SubscriberLaggedError` and the next reader must relist, which is
what the kubelet's evented PLEG does when its stream breaks. (containerd 1.7 instead discards
new events once its one 1000-event channel is full; containerd 2.x queues without a bound and
replays the last 5 minutes to a new subscriber. Nothing is replayed here.)

Events carry snapshots of the pod and of its containers taken when the event happened, as
containerd fills `pod_sandbox_status` and `containers_statuses`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from podgate.aio.tasks import TaskSet
from podgate.model import ContainerRecord, PodRecord

__all__ = [
    "ContainerEvent",
    "ContainerEventType",
    "ContainerEvents",
    "SubscriberLaggedError",
    "Subscription",
]

log = logging.getLogger(__name__)

# Unread events one subscriber may hold: containerd 1.7's event channel size. A kubelet reads
# each event at once; a thousand behind means it is stuck.
SUBSCRIBER_QUEUE_EVENTS: Final = 1000
# How often exits are looked for while someone subscribes: the shim records a container's exit
# in a file, read when the runtime next looks at the container.
EXIT_POLL_SECONDS: Final = 0.5


class ContainerEventType(enum.Enum):
    CREATED = "created"
    STARTED = "started"
    STOPPED = "stopped"
    DELETED = "deleted"


@dataclass(frozen=True, slots=True)
class ContainerEvent:
    container_id: str  # a pod's own events carry the pod's ID, as containerd's do
    type: ContainerEventType
    created_at: int  # ns since the epoch
    pod: PodRecord | None  # None once the pod is gone
    containers: tuple[ContainerRecord, ...]


class SubscriberLaggedError(Exception):
    """The subscriber fell too far behind and was dropped."""


class Subscription:
    """One reader's queue. `next()` returns events in order, None once the hub is closed."""

    def __init__(self, hub: ContainerEvents, limit: int) -> None:
        self._hub = hub
        self._limit = limit
        self._events: deque[ContainerEvent] = deque()
        self._ready = asyncio.Event()
        self._ended = False
        self._lagged = False

    def offer(self, event: ContainerEvent) -> bool:
        """Queue `event`; False when this subscriber has just been dropped for lagging."""
        if self._ended:
            return True
        if len(self._events) >= self._limit:
            self._lagged = True
            self._events.clear()
            self.end()
            return False
        self._events.append(event)
        self._ready.set()
        return True

    def end(self) -> None:
        self._ended = True
        self._ready.set()

    async def next(self) -> ContainerEvent | None:
        while True:
            if self._lagged:
                raise SubscriberLaggedError(
                    f"container event subscriber fell {self._limit} events behind and was "
                    f"dropped; relist and subscribe again"
                )
            if self._events:
                return self._events.popleft()
            if self._ended:
                return None
            self._ready.clear()
            await self._ready.wait()

    def close(self) -> None:
        self.end()
        self._hub.unsubscribe(self)


class ContainerEvents:
    """The runtime's event hub. `poll` is called every EXIT_POLL_SECONDS while anyone
    subscribes, so that exits nobody asks about still become STOPPED events."""

    def __init__(
        self, poll: Callable[[], object] | None = None, queue_events: int = SUBSCRIBER_QUEUE_EVENTS
    ) -> None:
        self._poll = poll
        self._queue_events = queue_events
        self._subscribers: set[Subscription] = set()
        self._tasks = TaskSet("container events", log)
        self._poller: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def __len__(self) -> int:
        return len(self._subscribers)

    def subscribe(self) -> Subscription:
        sub = Subscription(self, self._queue_events)
        if self._closed:
            sub.end()
            return sub
        self._loop = asyncio.get_running_loop()
        self._subscribers.add(sub)
        if self._poll is not None and (self._poller is None or self._poller.done()):
            self._poller = self._tasks.spawn(self._poll_exits(), name="container exit poll")
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subscribers.discard(sub)

    def publish(self, event: ContainerEvent) -> None:
        """Queue `event` for every subscriber; never waits."""
        loop = self._loop
        if loop is None or not self._subscribers:
            return
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._deliver(event)
        else:  # a worker thread: queues belong to the loop
            loop.call_soon_threadsafe(self._deliver, event)

    def _deliver(self, event: ContainerEvent) -> None:
        for sub in list(self._subscribers):
            if not sub.offer(event):
                self._subscribers.discard(sub)
                log.warning(
                    "container event subscriber dropped: %d events unread", self._queue_events
                )

    async def _poll_exits(self) -> None:
        assert self._poll is not None
        while self._subscribers and not self._closed:
            self._poll()
            await asyncio.sleep(EXIT_POLL_SECONDS)

    async def aclose(self) -> None:
        """End every subscription (their streams finish cleanly) and stop polling."""
        self._closed = True
        for sub in list(self._subscribers):
            sub.end()
        self._subscribers.clear()
        await self._tasks.aclose()
