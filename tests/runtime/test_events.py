"""The container event hub in memory: order, fan-out, the bound, and closing."""

from __future__ import annotations

import asyncio

import pytest

from podgate.runtime.events import (
    ContainerEvent,
    ContainerEvents,
    ContainerEventType,
    SubscriberLaggedError,
)


def event(n: int, kind: ContainerEventType = ContainerEventType.CREATED) -> ContainerEvent:
    return ContainerEvent(f"c{n}", kind, created_at=n, pod=None, containers=())


async def test_every_subscriber_gets_every_event_in_order() -> None:
    hub = ContainerEvents()
    first, second = hub.subscribe(), hub.subscribe()
    for n in range(5):
        hub.publish(event(n))
    for sub in (first, second):
        assert [(await sub.next()).container_id for _ in range(5)] == [  # type: ignore[union-attr]
            f"c{n}" for n in range(5)
        ]
    await hub.aclose()
    assert await first.next() is None


async def test_events_before_subscribing_are_not_replayed() -> None:
    hub = ContainerEvents()
    hub.publish(event(0))
    sub = hub.subscribe()
    hub.publish(event(1))
    got = await sub.next()
    assert got is not None and got.container_id == "c1"
    await hub.aclose()


async def test_a_full_queue_drops_that_subscriber_only() -> None:
    hub = ContainerEvents(queue_events=3)
    slow, fast = hub.subscribe(), hub.subscribe()
    for n in range(10):
        hub.publish(event(n))  # never waits
        got = await fast.next()
        assert got is not None and got.container_id == f"c{n}"
    assert len(hub) == 1
    with pytest.raises(SubscriberLaggedError):
        await slow.next()
    await hub.aclose()


async def test_close_wakes_a_waiting_reader_with_the_end() -> None:
    hub = ContainerEvents()
    sub = hub.subscribe()
    waiting = asyncio.create_task(sub.next())
    await asyncio.sleep(0)
    await hub.aclose()
    assert await waiting is None
    assert await hub.subscribe().next() is None  # a closed hub ends new subscriptions at once


async def test_poll_runs_only_while_someone_subscribes() -> None:
    polls = 0

    def poll() -> None:
        nonlocal polls
        polls += 1

    hub = ContainerEvents(poll=poll)
    await asyncio.sleep(0)
    assert polls == 0
    sub = hub.subscribe()
    await asyncio.sleep(0)
    assert polls == 1
    sub.close()
    await hub.aclose()


async def test_publish_from_a_worker_thread_reaches_the_loop() -> None:
    hub = ContainerEvents()
    sub = hub.subscribe()
    await asyncio.to_thread(hub.publish, event(7, ContainerEventType.STOPPED))
    got = await sub.next()
    assert got is not None and got.type is ContainerEventType.STOPPED
    await hub.aclose()
