"""Network interface counters of a network namespace, from /proc/<pid>/net/dev.

/proc/<pid>/net shows the network namespace of that process, so no thread has to enter the
namespace (as /sys/class/net would need a sysfs mounted from inside it). cAdvisor reads pod
network stats the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["InterfaceCounters", "parse_net_dev", "read_net_dev"]

# /proc/net/dev: 8 receive columns (bytes packets errs drop fifo frame compressed multicast),
# then 8 transmit columns (bytes packets errs drop fifo colls carrier compressed).
_RX_BYTES, _RX_ERRS, _TX_BYTES, _TX_ERRS = 0, 2, 8, 10
_COLUMNS: Final = 16


@dataclass(frozen=True, slots=True)
class InterfaceCounters:
    """One interface's counters, cumulative since the interface was made."""

    name: str
    rx_bytes: int
    rx_errors: int
    tx_bytes: int
    tx_errors: int


def parse_net_dev(text: str) -> list[InterfaceCounters]:
    """The interfaces of a /proc/net/dev table, in its order; malformed lines are skipped."""
    found = []
    for line in text.splitlines()[2:]:  # two header lines
        name, sep, rest = line.partition(":")
        values = rest.split()
        if not sep or len(values) < _COLUMNS or not all(v.isdigit() for v in values):
            continue
        n = [int(v) for v in values]
        found.append(
            InterfaceCounters(name.strip(), n[_RX_BYTES], n[_RX_ERRS], n[_TX_BYTES], n[_TX_ERRS])
        )
    return found


def read_net_dev(pid: int) -> list[InterfaceCounters]:
    """The interfaces of the network namespace `pid` is in; none when the process is gone."""
    try:
        with open(f"/proc/{pid}/net/dev", encoding="ascii") as f:
            return parse_net_dev(f.read())
    except (FileNotFoundError, ProcessLookupError):
        return []
