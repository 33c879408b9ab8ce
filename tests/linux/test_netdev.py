"""/proc/net/dev parsing, and reading this process's own network namespace."""

from __future__ import annotations

import os

from podgate.linux.netdev import InterfaceCounters, parse_net_dev, read_net_dev

# The kernel's layout (two header lines, `name:` then 16 columns), spaces squeezed.
TABLE = "\n".join(
    [
        "Inter-|   Receive                                                |  Transmit",
        " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets ...",
        "    lo: 3360 40 0 0 0 0 0 0 3360 40 0 0 0 0 0 0",
        "  eth0:123456789 1000 7 1 0 0 0 3 987654321 900 2 0 0 0 0 0",
        "bad line without a colon",
        " veth1: 1 2 3",
    ]
)


def test_parse_takes_bytes_and_errors_of_both_directions() -> None:
    assert parse_net_dev(TABLE) == [
        InterfaceCounters("lo", 3360, 0, 3360, 0),
        InterfaceCounters("eth0", 123456789, 7, 987654321, 2),
    ]


def test_header_only_is_empty() -> None:
    assert parse_net_dev("\n".join(TABLE.splitlines()[:2])) == []


def test_own_namespace_has_loopback() -> None:
    assert "lo" in {i.name for i in read_net_dev(os.getpid())}


def test_a_gone_process_has_no_interfaces() -> None:
    assert read_net_dev(2**22 + 1) == []  # above pid_max's ceiling
