"""Following a CRI log: a container that exited ends the follow cleanly once the file is
drained; a runtime that no longer answers ends it with LogSourceLost, never as an exit."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from podgate.node.logs import LogSourceLost, read_log

PROMPT_SECONDS = 20.0
LINES = b"2026-01-01T00:00:00Z stdout F one\n2026-01-01T00:00:01Z stdout F two\n"


async def _follow(path: Path, answers: list[bool | Exception]) -> list[bytes]:
    async def still_running() -> bool:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    got: list[bytes] = []
    async with asyncio.timeout(PROMPT_SECONDS):
        async for chunk in read_log(str(path), follow=True, still_running=still_running):
            got.append(chunk)
    return got


async def test_an_exited_container_ends_the_follow_after_its_last_lines(tmp_path: Path) -> None:
    log = tmp_path / "c.log"
    log.write_bytes(LINES)
    assert await _follow(log, [True, False]) == [b"one\n", b"two\n"]


async def test_a_runtime_that_no_longer_answers_ends_the_follow_with_an_error(
    tmp_path: Path,
) -> None:
    log = tmp_path / "c.log"
    log.write_bytes(LINES)
    with pytest.raises(LogSourceLost, match="runtime gone"):
        await _follow(log, [True, LogSourceLost("runtime gone")])
