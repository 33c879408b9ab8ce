"""TaskSet and cancel_and_wait: every task has an owner, and no cancellation is swallowed."""

from __future__ import annotations

import asyncio
import logging

import pytest

from podgate.aio.tasks import TaskSet, cancel_and_wait


async def test_tasks_finish_within_the_grace_and_the_rest_are_cancelled() -> None:
    tasks = TaskSet("test")
    finished: list[str] = []

    async def work(name: str, seconds: float) -> None:
        await asyncio.sleep(seconds)
        finished.append(name)

    tasks.spawn(work("quick", 0), name="quick")
    slow = tasks.spawn(work("slow", 3600), name="slow")
    assert len(tasks) == 2
    await tasks.aclose(grace=0.5)
    assert finished == ["quick"]
    assert slow.cancelled()
    assert len(tasks) == 0


async def test_a_closed_set_takes_no_new_task() -> None:
    tasks = TaskSet("test")
    await tasks.aclose()
    coro = asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="closed"):
        tasks.spawn(coro, name="late")


async def test_a_failure_is_logged_once_with_the_task_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tasks = TaskSet("test", logging.getLogger("podgate.test"))

    async def boom() -> None:
        raise ValueError("broken")

    tasks.spawn(boom(), name="boom task")
    await tasks.join()
    failures = [r for r in caplog.records if "boom task failed" in r.getMessage()]
    assert len(failures) == 1


async def test_a_task_may_close_its_own_set() -> None:
    tasks = TaskSet("test")
    other = tasks.spawn(asyncio.sleep(3600), name="other")

    async def closer() -> str:
        await tasks.aclose()
        return "closed"

    closing = tasks.spawn(closer(), name="closer")
    assert await closing == "closed"
    assert other.cancelled()


async def test_cancelling_aclose_propagates() -> None:
    tasks = TaskSet("test")

    async def stubborn() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(3600)  # takes its time to end

    tasks.spawn(stubborn(), name="stubborn")
    await asyncio.sleep(0)
    closing = asyncio.create_task(tasks.aclose())
    await asyncio.sleep(0.05)
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    tasks.cancel()
    await tasks.join()


async def test_cancel_and_wait_ends_helpers_and_keeps_the_callers_cancellation() -> None:
    helper = asyncio.create_task(asyncio.sleep(3600))
    failed = asyncio.create_task(asyncio.sleep(0, result=None))
    await cancel_and_wait(helper, failed)
    assert helper.cancelled()

    async def caller() -> None:
        stubborn_started = asyncio.Event()

        async def stubborn() -> None:
            try:
                stubborn_started.set()
                await asyncio.sleep(3600)
            finally:
                await asyncio.sleep(0.2)

        task = asyncio.create_task(stubborn())
        await stubborn_started.wait()
        await cancel_and_wait(task)

    outer = asyncio.create_task(caller())
    await asyncio.sleep(0.05)
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer


async def test_cancel_and_wait_retrieves_a_helpers_failure() -> None:
    async def boom() -> None:
        raise ValueError("broken")

    task = asyncio.create_task(boom())
    await asyncio.sleep(0)
    await cancel_and_wait(task)  # no "exception was never retrieved" later
    assert isinstance(task.exception(), ValueError)
