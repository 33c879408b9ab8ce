"""Give the C heap's free memory back to the system once streams are done with it.

Stream buffers are bytes objects of up to a few hundred KiB. CPython takes those from glibc's
malloc, and glibc's dynamic mmap threshold soon serves them from the heap: once freed, that
memory stays in the process (free inside malloc's arenas, still resident) unless it happens to
sit at the top of the heap. A burst of stalled streams can leave tens of MiB resident for ever
after every byte was released. `malloc_trim(0)` returns free pages from every arena (the middle
of the heap too), so a daemon calls `release_soon()` whenever a session ends: a short series
of trims follows, shared by a whole wave of sessions ending together, each only when enough is
free to be worth the page faults of using it again.

Each trim of the series first runs the cycle collector. What a session leaves in reference
cycles (a transport and its protocol, a traceback and the frames it holds) is freed only by a
full collection, and CPython runs one only after many allocations: a daemon idle after a
burst may hold such garbage, and the buffers it references, for hours.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import time
import weakref

log = logging.getLogger(__name__)

# When to trim after a session ends, in seconds: sessions ending within the first delay share
# the trims, and the later ones catch what is freed after the session (streams that take a
# grace period to close, stalled streams reset, pooled upstream sessions expiring).
TRIM_DELAYS_SECONDS = (1.0, 3.0, 10.0, 30.0)
# Free bytes in malloc's main arena below which a trim is not worth its cost: the heap keeps a
# working set, and pages given back must be faulted in again when streams return.
TRIM_MIN_FREE_BYTES = 8 * 1024 * 1024


class _MallInfo2(ctypes.Structure):
    # glibc's struct mallinfo2 (2.33+): size_t fields, so it does not wrap past 2 GiB.
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim  # noqa: B018 - glibc only (musl has none): probe it here
    except (OSError, AttributeError):
        return None
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.argtypes = []
        libc.mallinfo2.restype = _MallInfo2
    return libc


_LIBC = _libc()
# Per event loop: the next trim of the series and its step.
_pending: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[asyncio.TimerHandle, int]] = (
    weakref.WeakKeyDictionary()
)


def free_heap_bytes() -> int | None:
    """Bytes free inside malloc's main arena (None without glibc's mallinfo2)."""
    if _LIBC is None or not hasattr(_LIBC, "mallinfo2"):
        return None
    return int(_LIBC.mallinfo2().fordblks)


def used_heap_bytes() -> int | None:
    """Bytes malloc has handed out and not had back, in its arenas and mmapped chunks alike
    (None without glibc's mallinfo2)."""
    if _LIBC is None or not hasattr(_LIBC, "mallinfo2"):
        return None
    info = _LIBC.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def trim() -> bool:
    """Return free heap pages to the system now; True if any were returned."""
    if _LIBC is None:
        return False
    free = free_heap_bytes()
    if free is not None and free < TRIM_MIN_FREE_BYTES:
        return False
    released = bool(_LIBC.malloc_trim(0))
    log.debug("malloc_trim: %d bytes were free, released=%s", free or 0, released)
    return released


def collect() -> int:
    """A full run of the cycle collector; the objects it freed."""
    start = time.monotonic()
    freed = gc.collect()
    log.debug("gc: %d objects freed in %.1f ms", freed, (time.monotonic() - start) * 1000)
    return freed


def release_soon() -> None:
    """Collect and trim TRIM_DELAYS_SECONDS after now, however many sessions end meanwhile
    (a session ending while the series runs starts it again from the first delay)."""
    if _LIBC is None:
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    pending = _pending.get(loop)
    if pending is not None:
        handle, step = pending
        if step == 0:
            return  # the first trim is still ahead: it covers this session too
        handle.cancel()
    _schedule(loop, 0, loop.time())


def _schedule(loop: asyncio.AbstractEventLoop, step: int, start: float) -> None:
    if step >= len(TRIM_DELAYS_SECONDS):
        return

    def run() -> None:
        _pending.pop(loop, None)
        collect()
        trim()
        _schedule(loop, step + 1, start)

    _pending[loop] = (loop.call_at(start + TRIM_DELAYS_SECONDS[step], run), step)
