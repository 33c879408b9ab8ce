"""Owners for tasks that outlive the call that starts them.

Work scoped to one call uses `asyncio.TaskGroup`. What a server starts per connection, per
forward or per plugin lives longer than any call: a `TaskSet` owns it — every task is named and
kept until it ends, an unexpected failure is logged once, and `aclose(grace)` lets the tasks
finish for a grace period, then cancels the rest and waits for them. Cancelling the caller of
`aclose` is never swallowed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class TaskSet:
    def __init__(self, name: str, log: logging.Logger | None = None) -> None:
        self.name = name
        self._log = log or logging.getLogger(__name__)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str) -> asyncio.Task[T]:
        """Start `coro` as a task owned by this set (RuntimeError once the set is closed)."""
        if self._closed:
            coro.close()
            raise RuntimeError(f"{self.name}: closed, not starting {name}")
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._log.error("%s: task %s failed: %s", self.name, task.get_name(), exc, exc_info=exc)

    async def join(self) -> None:
        """Wait until no task is running (tasks started meanwhile are waited for too)."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def aclose(self, grace: float = 0.0) -> None:
        """Take no new tasks; wait up to `grace` seconds for the running ones, then cancel and
        wait for them. A task of this set that closes it is left to finish by itself."""
        self._closed = True
        current = asyncio.current_task()

        def others() -> set[asyncio.Task[Any]]:
            return {t for t in self._tasks if t is not current}

        if others() and grace > 0:
            await asyncio.wait(others(), timeout=grace)
        while pending := others():
            for task in pending:
                task.cancel()
            # Each task's own CancelledError is its end; this call's cancellation propagates.
            await asyncio.wait(pending)


async def cancel_and_wait(*tasks: asyncio.Future[Any]) -> None:
    """Cancel `tasks` (helpers of a call that is ending) and wait until each has ended.

    A helper's own CancelledError or failure is its end and is not raised here (failures that
    matter are the helper's to report); the caller's own cancellation propagates.
    """
    for task in tasks:
        task.cancel()
    if not tasks:
        return
    await asyncio.wait(tasks)
    for task in tasks:
        # Retrieved either way. A cancelled task keeps its CancelledError until then, and that
        # error's traceback holds the task's frames: whatever owns the task and is referenced
        # from them (a stream holding its reader task) would be freed only by the cycle
        # collector. Retrieving it drops it.
        if task.cancelled():
            with contextlib.suppress(asyncio.CancelledError):
                task.result()
        else:
            task.exception()  # ended by its own failure after all
