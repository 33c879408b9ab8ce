"""Finding processes a test left behind (imported by module name from any test directory)."""

from __future__ import annotations

import contextlib
from pathlib import Path


def processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains `text`, in ascending order."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if text.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return sorted(found)
