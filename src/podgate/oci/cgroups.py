"""A container's cgroup under the cgroupfs driver: v1 (one hierarchy per controller, as on
these machines) or v2 (unified), usage figures for stats and the OOM-kill count; and the
memory and CPU limits of a pod's cgroup, the parent of its containers' (`set_limits`).

runc places a container at `cgroupsPath` below each hierarchy's root; these functions read
the same places. A missing file reads as zero: a container that has just gone away has no
usage, not an error.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Final

__all__ = [
    "CGROUP_ROOT",
    "CgroupStats",
    "Limits",
    "controller_dirs",
    "is_v2",
    "memory_limit",
    "oom_kills",
    "remove",
    "set_limits",
    "stats",
]

CGROUP_ROOT: Final = "/sys/fs/cgroup"
# v1 controllers runc manages whose directories podgate reads or removes.
V1_CONTROLLERS: Final = (
    "cpu",
    "cpuacct",
    "cpuset",
    "memory",
    "devices",
    "freezer",
    "blkio",
    "pids",
    "hugetlb",
    "net_cls",
    "net_prio",
    "perf_event",
    "systemd",
    "unified",  # the v2 hierarchy beside v1 ("hybrid"): runc makes a directory there too
)
# memory.limit_in_bytes of an unlimited v1 cgroup (PAGE_COUNTER_MAX pages of 4 KiB).
V1_UNLIMITED_FLOOR: Final = 1 << 62
# The CFS period when none is given (the kernel's default), microseconds.
DEFAULT_CPU_PERIOD_US: Final = 100_000
# cpu.shares bounds (kernel) and the cpu.weight range of v2, for runc's shares→weight mapping.
MIN_CPU_SHARES: Final = 2
MAX_CPU_SHARES: Final = 262_144
MAX_CPU_WEIGHT: Final = 10_000


def is_v2(root: str = CGROUP_ROOT) -> bool:
    """The unified hierarchy is mounted at the root (not merely beside v1 as "unified")."""
    return os.path.exists(os.path.join(root, "cgroup.controllers"))


def _dir(root: str, controller: str, path: str) -> str:
    return os.path.join(root, controller, path.lstrip("/"))


def controller_dirs(path: str, root: str = CGROUP_ROOT) -> list[str]:
    """Every directory the cgroup `path` has on this host."""
    if is_v2(root):
        return [os.path.join(root, path.lstrip("/"))]
    return [_dir(root, c, path) for c in V1_CONTROLLERS if os.path.isdir(os.path.join(root, c))]


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError, OSError):
        return ""


def _int(text: str) -> int:
    text = text.strip()
    if not text or text == "max":
        return 0
    try:
        return int(text)
    except ValueError:
        return 0


def _keyed(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        out[key] = _int(value)
    return out


@dataclass(frozen=True, slots=True)
class CgroupStats:
    timestamp: int  # ns since the epoch
    cpu_usage_ns: int
    memory_usage: int
    memory_working_set: int  # usage - inactive_file, as containerd and the kubelet count it
    memory_rss: int
    page_faults: int
    major_page_faults: int
    pids: int


def stats(path: str, root: str = CGROUP_ROOT) -> CgroupStats:
    now = time.time_ns()
    if is_v2(root):
        base = os.path.join(root, path.lstrip("/"))
        cpu = _keyed(_read(os.path.join(base, "cpu.stat"))).get("usage_usec", 0) * 1000
        usage = _int(_read(os.path.join(base, "memory.current")))
        mem = _keyed(_read(os.path.join(base, "memory.stat")))
        inactive = mem.get("inactive_file", 0)
        rss = mem.get("anon", 0)
        faults, major = mem.get("pgfault", 0), mem.get("pgmajfault", 0)
        pids = _int(_read(os.path.join(base, "pids.current")))
    else:
        cpu = _int(_read(os.path.join(_dir(root, "cpuacct", path), "cpuacct.usage")))
        memdir = _dir(root, "memory", path)
        usage = _int(_read(os.path.join(memdir, "memory.usage_in_bytes")))
        mem = _keyed(_read(os.path.join(memdir, "memory.stat")))
        inactive = mem.get("total_inactive_file", 0)
        rss = mem.get("total_rss", 0)
        faults, major = mem.get("total_pgfault", 0), mem.get("total_pgmajfault", 0)
        pids = _int(_read(os.path.join(_dir(root, "pids", path), "pids.current")))
    return CgroupStats(now, cpu, usage, max(usage - inactive, 0), rss, faults, major, pids)


def memory_limit(path: str, root: str = CGROUP_ROOT) -> int:
    """The memory limit in bytes; 0 = unlimited."""
    if is_v2(root):
        return _int(_read(os.path.join(root, path.lstrip("/"), "memory.max")))
    value = _int(_read(os.path.join(_dir(root, "memory", path), "memory.limit_in_bytes")))
    return 0 if value >= V1_UNLIMITED_FLOOR else value


def oom_kills(path: str, root: str = CGROUP_ROOT) -> int:
    """Processes the OOM killer killed in this cgroup (v1 memory.oom_control, v2
    memory.events)."""
    if is_v2(root):
        return _keyed(_read(os.path.join(root, path.lstrip("/"), "memory.events"))).get(
            "oom_kill", 0
        )
    text = _read(os.path.join(_dir(root, "memory", path), "memory.oom_control"))
    return _keyed(text).get("oom_kill", 0)


def remove(path: str, root: str = CGROUP_ROOT) -> None:
    """rmdir the cgroup in every hierarchy; one still in use or already gone is left alone."""
    for directory in controller_dirs(path, root):
        try:
            os.rmdir(directory)
        except OSError:
            pass


@dataclass(frozen=True, slots=True)
class Limits:
    """A cgroup's memory and CPU limits; 0 = unlimited (memory, quota) or unchanged (shares)."""

    memory: int = 0  # bytes
    cpu_quota: int = 0  # microseconds per period
    cpu_period: int = DEFAULT_CPU_PERIOD_US
    cpu_shares: int = 0


def _write(directory: str, name: str, value: str) -> None:
    with open(os.path.join(directory, name), "w", encoding="ascii") as f:
        f.write(value)


def _weight(shares: int) -> int:
    """cpu.shares as v2 cpu.weight, the way runc converts it."""
    shares = min(max(shares, MIN_CPU_SHARES), MAX_CPU_SHARES)
    span = MAX_CPU_SHARES - MIN_CPU_SHARES
    return 1 + ((shares - MIN_CPU_SHARES) * (MAX_CPU_WEIGHT - 1)) // span


def set_limits(path: str, limits: Limits, root: str = CGROUP_ROOT) -> None:
    """Write `limits` to the cgroup `path` (made when missing, as runc would on the first
    container). Raises OSError when the kernel refuses a value (a memory limit below usage)."""
    if is_v2(root):
        directory = os.path.join(root, path.lstrip("/"))
        os.makedirs(directory, exist_ok=True)
        _write(directory, "memory.max", str(limits.memory) if limits.memory else "max")
        quota = str(limits.cpu_quota) if limits.cpu_quota else "max"
        _write(directory, "cpu.max", f"{quota} {limits.cpu_period}")
        if limits.cpu_shares:
            _write(directory, "cpu.weight", str(_weight(limits.cpu_shares)))
        return
    memory, cpu = _dir(root, "memory", path), _dir(root, "cpu", path)
    os.makedirs(memory, exist_ok=True)
    os.makedirs(cpu, exist_ok=True)
    _write(memory, "memory.limit_in_bytes", str(limits.memory or -1))
    # The period first: a quota is checked against the period in force.
    _write(cpu, "cpu.cfs_period_us", str(limits.cpu_period))
    _write(cpu, "cpu.cfs_quota_us", str(limits.cpu_quota or -1))
    if limits.cpu_shares:
        _write(cpu, "cpu.shares", str(limits.cpu_shares))
