"""One budget for the bytes a process holds received on behalf of its connections.

A connection buffers received bytes before it stops reading its socket. With a fixed mark per
connection (1 MiB, read 256 KiB at a time) memory grew with the number of busy connections.
Instead the connections of one event loop that hold received bytes share one total: each may
hold total / busy, and read that much at once, between a floor (reads still large enough to be
cheap per byte: 64 KiB reads cost a quarter of the soak's throughput, 96 KiB ~8 %) and a
ceiling (what one lone transfer needs). Only backpressure: a connection over its share stops
reading its socket (its peer meets TCP backpressure); nothing is dropped, and one whose reader
never reads holds at most its share and one read, so the others go on.
"""

from __future__ import annotations

import asyncio
import weakref

# Received bytes all busy connections of a process may buffer together. 8 MiB: 64 busy kubectl
# tunnels and their 64 pod sockets read at the floor, and a soak of them stays within 64 MiB
# of growth (16 MiB: +88 to +98 MiB, at the same throughput).
PROCESS_CONNECTION_BYTES = 8 * 1024 * 1024
# Least a busy connection may buffer, however many share the budget. 96 KiB: the 10 GiB soak
# grows +56/+57 MiB (128 KiB: +61/+62, 8 % faster; too close to its 64 MiB bound).
MIN_SHARE_BYTES = 96 * 1024
# Most one connection may buffer, however few are busy (a lone transfer's full buffers).
MAX_SHARE_BYTES = 1024 * 1024


class ConnectionBudget:
    """The busy connections of one event loop and each one's share of the total."""

    __slots__ = ("busy", "ceiling", "floor", "total")

    def __init__(
        self,
        total: int = PROCESS_CONNECTION_BYTES,
        *,
        floor: int = MIN_SHARE_BYTES,
        ceiling: int = MAX_SHARE_BYTES,
    ) -> None:
        if not 0 < floor <= ceiling:
            raise ValueError("need 0 < floor <= ceiling")
        self.total = total
        self.floor = floor
        self.ceiling = ceiling
        self.busy = 0  # connections holding bytes now

    def share(self) -> int:
        """What one busy connection may hold now."""
        return max(self.floor, min(self.ceiling, self.total // max(1, self.busy)))


_budgets: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, ConnectionBudget] = (
    weakref.WeakKeyDictionary()
)


def connection_budget(loop: asyncio.AbstractEventLoop | None = None) -> ConnectionBudget:
    """The budget shared by the connections of `loop` (default: the running loop)."""
    loop = loop or asyncio.get_running_loop()
    budget = _budgets.get(loop)
    if budget is None:
        budget = _budgets[loop] = ConnectionBudget()
    return budget


def set_connection_budget(budget: ConnectionBudget, loop: asyncio.AbstractEventLoop) -> None:
    """Use `budget` for the connections made on `loop` from now on (tests, a daemon's config)."""
    _budgets[loop] = budget
