"""The per-stream rate limit: a token bucket with one second of burst, checked with a fake
clock so the test measures what the limiter asks for, not how fast the machine is."""

from __future__ import annotations

import pytest

from podgate.aio.memory import memory_stream_pair
from podgate.streaming import hooks
from podgate.streaming.hooks import SessionHooks, ThrottledStream


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(hooks.time, "monotonic", fake.monotonic)
    monkeypatch.setattr(hooks.asyncio, "sleep", fake.sleep)
    return fake


async def test_sending_waits_for_the_rate_after_the_burst(clock: FakeClock) -> None:
    a, b = memory_stream_pair(capacity=64 * 1024 * 1024)
    limited = ThrottledStream(a, rate=1_000_000)
    await limited.send(b"x" * 5_000_000)
    # One second of burst is free; the other 4 MB need 4 s at 1 MB/s.
    assert sum(clock.slept) == pytest.approx(4.0, rel=1e-6)
    await limited.send_eof()
    received = 0
    while chunk := await b.receive():
        received += len(chunk)
    assert received == 5_000_000


async def test_receiving_is_limited_too(clock: FakeClock) -> None:
    a, b = memory_stream_pair(capacity=64 * 1024 * 1024)
    await b.send(b"y" * 3_000_000)
    await b.send_eof()
    limited = ThrottledStream(a, rate=500_000)
    got = 0
    while chunk := await limited.receive():
        assert len(chunk) <= 500_000  # never more than one second's worth at once
        got += len(chunk)
    assert got == 3_000_000
    assert sum(clock.slept) == pytest.approx(5.0, rel=1e-6)  # 3 MB - 0.5 MB burst at 0.5 MB/s


async def test_idle_time_refills_the_bucket_only_up_to_the_burst(clock: FakeClock) -> None:
    a, _ = memory_stream_pair(capacity=64 * 1024 * 1024)
    limited = ThrottledStream(a, rate=100_000)
    await limited.send(b"z" * 100_000)  # the burst
    assert clock.slept == []
    clock.now += 3600  # an hour idle earns no more than one second of burst
    await limited.send(b"z" * 300_000)
    assert sum(clock.slept) == pytest.approx(2.0, rel=1e-6)


def test_hooks_wrap_only_when_a_limit_is_set() -> None:
    a, _ = memory_stream_pair()
    assert SessionHooks().wrap(a) is a
    limited = SessionHooks()
    limited.max_bytes_per_sec = 10.0
    assert isinstance(limited.wrap(a), ThrottledStream)
