"""The gateway's audit log: JSON lines, written by a thread of its own, rotated by size, with
denials of unknown or misbehaving clients rate-limited and summed up.

Nothing here blocks the event loop: `write` puts the line on a bounded queue and the writer
thread does the file I/O (and the rotation). Denials go through `denied`, which writes the
first few per source and interval in full and only counts the rest; once per interval, when
something was counted, one summary line gives the counts per source and reason. So a client
sending thousands of bad requests a second costs a few lines a second, not megabytes.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Final, TextIO

from podgate.files import rotate

__all__ = [
    "DEFAULT_AUDIT_KEEP",
    "DEFAULT_AUDIT_MAX_BYTES",
    "DENIALS_PER_SOURCE",
    "DENIAL_INTERVAL_SECONDS",
    "AuditLog",
]

log = logging.getLogger(__name__)

# The log is rotated (audit.log → audit.log.1 → …) once it passes this size, bytes.
DEFAULT_AUDIT_MAX_BYTES: Final = 100 * 1024 * 1024
# Rotated files kept besides the live one; older ones are deleted.
DEFAULT_AUDIT_KEEP: Final = 5
# Denials are counted per source over this many seconds.
DENIAL_INTERVAL_SECONDS: Final = 10.0
# Denials of one source written in full per interval; the rest are only counted.
DENIALS_PER_SOURCE: Final = 20
# Denials of all sources written in full per interval (many sources cannot flood either).
DENIALS_PER_INTERVAL: Final = 100
# Sources named in one summary line; the others are summed under "other".
SUMMARY_SOURCES: Final = 100
# Lines waiting for the writer thread; beyond this they are dropped and counted, so a stalled
# disk costs memory up to a bound and never blocks a request.
QUEUE_LINES: Final = 10_000

_STOP: Final = object()


def _now() -> str:
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z"


def _source(address: str) -> str:
    """The client's host, without the port (a flood uses a new port per connection)."""
    if address.startswith("["):
        return address[1 : address.find("]")] if "]" in address else address
    return address.rsplit(":", 1)[0] if address.count(":") == 1 else address


class _Denials:
    """Per-interval budgets and counts of denials; used from the event loop and the writer."""

    def __init__(self, per_source: int, per_interval: int) -> None:
        self.per_source = per_source
        self.per_interval = per_interval
        self._lock = threading.Lock()
        self._written: collections.Counter[str] = collections.Counter()
        self._written_total = 0
        self._counted: dict[str, collections.Counter[str]] = {}
        self.started = time.monotonic()

    def admit(self, source: str, reason: str) -> bool:
        """True if this denial is written in full; else it is counted for the summary."""
        with self._lock:
            if self._written[source] < self.per_source and self._written_total < self.per_interval:
                self._written[source] += 1
                self._written_total += 1
                return True
            self._counted.setdefault(source, collections.Counter())[reason] += 1
            return False

    def roll(self) -> dict[str, Any] | None:
        """End the interval: its summary entry if anything was only counted."""
        with self._lock:
            counted, self._counted = self._counted, {}
            self._written.clear()
            self._written_total = 0
            started, self.started = self.started, time.monotonic()
        if not counted:
            return None
        ranked = sorted(counted.items(), key=lambda kv: -sum(kv[1].values()))
        sources = {src: dict(reasons) for src, reasons in ranked[:SUMMARY_SOURCES]}
        other = sum(sum(r.values()) for _, r in ranked[SUMMARY_SOURCES:])
        entry: dict[str, Any] = {
            "outcome": "denied",
            "summary": True,
            "interval": round(time.monotonic() - started, 3),
            "suppressed": sum(sum(r.values()) for r in counted.values()),
            "sources": sources,
        }
        if other:
            entry["other_sources"] = other
        return entry


class AuditLog:
    """JSON lines, one per decision and per finished stream, written off the event loop."""

    def __init__(
        self,
        path: str | None,
        *,
        max_bytes: int = DEFAULT_AUDIT_MAX_BYTES,
        keep: int = DEFAULT_AUDIT_KEEP,
        interval: float = DENIAL_INTERVAL_SECONDS,
        per_source: int = DENIALS_PER_SOURCE,
        per_interval: int = DENIALS_PER_INTERVAL,
    ) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self.interval = interval
        self.dropped = 0
        self._denials = _Denials(per_source, per_interval)
        self._queue: queue.Queue[object] = queue.Queue(QUEUE_LINES)
        self._file: TextIO | None = None
        self._size = 0
        self._thread: threading.Thread | None = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._open()
        self._thread = threading.Thread(target=self._run, name="audit writer", daemon=True)
        self._thread.start()

    # -- the event loop's side

    def write(self, **entry: Any) -> None:
        line = json.dumps({"time": _now(), **entry}, separators=(",", ":"), default=str)
        try:
            self._queue.put_nowait(line)
        except queue.Full:
            self.dropped += 1

    def denied(self, **entry: Any) -> None:
        """A denial: written in full within the source's budget, else counted."""
        if self._denials.admit(_source(str(entry.get("address", ""))), str(entry.get("reason"))):
            self.write(**entry)

    def flush(self) -> None:
        """Wait until every line written so far is in the file (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    # -- the writer thread

    def _open(self) -> None:
        assert self.path is not None
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._file = os.fdopen(fd, "a", encoding="utf-8")
        self._size = os.fstat(fd).st_size

    def _run(self) -> None:
        deadline = time.monotonic() + self.interval
        while True:
            try:
                item = self._queue.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                item = None
            try:
                if time.monotonic() >= deadline:
                    deadline = time.monotonic() + self.interval
                    self._summarize()
                if item is _STOP:
                    self._summarize()
                    if self._file is not None:
                        self._file.close()
                    return
                if isinstance(item, str):
                    self._emit(item)
            except Exception:
                log.exception("audit log write failed")
            finally:
                if item is not None:
                    self._queue.task_done()

    def _summarize(self) -> None:
        summary = self._denials.roll()
        if self.dropped:
            summary = summary or {"outcome": "dropped"}
            summary["dropped"], self.dropped = self.dropped, 0
        if summary is not None:
            self._emit(json.dumps({"time": _now(), **summary}, separators=(",", ":")))

    def _emit(self, line: str) -> None:
        if self._file is None:
            log.info("audit %s", line)
            return
        data = line + "\n"
        if self._size and self._size + len(data) > self.max_bytes:
            self._rotate()
        self._file.write(data)
        self._file.flush()
        self._size += len(data.encode("utf-8"))

    def _rotate(self) -> None:
        assert self.path is not None and self._file is not None
        self._file.close()
        rotate(self.path, self.keep)
        self._open()
