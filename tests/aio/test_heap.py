"""Free C heap given back after sessions end: one series of trims for a wave of sessions.

(What a trim releases is measured end to end, on a daemon, in
tests/gateway/test_gateway_streams.py: inside the test process glibc may serve stream-sized
buffers by mmap, which leaves nothing in the heap to trim.)"""

from __future__ import annotations

import asyncio

import pytest

from podgate.aio import heap


async def test_a_session_ending_schedules_one_series_of_trims(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[float] = []
    monkeypatch.setattr(heap, "TRIM_DELAYS_SECONDS", (0.05, 0.1))
    monkeypatch.setattr(heap, "trim", lambda: calls.append(asyncio.get_running_loop().time()))
    for _ in range(10):  # a wave of sessions ending together
        heap.release_soon()
    await asyncio.sleep(0.3)
    assert len(calls) == 2  # one series, not one per session
