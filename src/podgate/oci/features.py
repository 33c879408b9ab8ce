"""What this node can honour of an NRI adjustment (podgate.oci.adjust.HostSupport): cgroup
controllers and knob files, resctrl, and the OCI runtime's version for spec fields that runc
before a given release ignores without a word (its JSON decoder drops unknown fields).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from typing import Any, Final

from podgate.oci import cgroups
from podgate.oci.adjust import NAMESPACE_TYPES, HostSupport

__all__ = ["probe", "runc_features", "runc_version"]

# runc releases that first honour these spec fields (runc's CHANGELOG).
IO_PRIORITY_SINCE: Final = (1, 2, 0)  # process.ioPriority
SCHEDULER_SINCE: Final = (1, 2, 0)  # process.scheduler
NET_DEVICES_SINCE: Final = (1, 3, 0)  # linux.netDevices
MEMORY_POLICY_SINCE: Final = (1, 4, 0)  # linux.memoryPolicy
# `runc --version` answers at once; a hung binary must not hang container creation, seconds.
VERSION_TIMEOUT_SECONDS: Final = 10.0
RESCTRL_ROOT: Final = "/sys/fs/resctrl"
# v1 knob files whose presence depends on the kernel's configuration.
_V1_FILES: Final = (
    "memory/memory.memsw.limit_in_bytes",
    "memory/memory.kmem.tcp.limit_in_bytes",
    "memory/memory.swappiness",
    "memory/memory.oom_control",
    "cpu/cpu.rt_runtime_us",
    "cpu/cpu.rt_period_us",
)


def runc_version(binary: str) -> tuple[int, int, int]:
    """`runc --version`'s release ((0, 0, 0) when it cannot be read)."""
    try:
        out = subprocess.run(
            [binary, "--version"],
            capture_output=True,
            text=True,
            timeout=VERSION_TIMEOUT_SECONDS,
            check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return (0, 0, 0)
    match = re.search(r"version (\d+)\.(\d+)\.(\d+)", out)
    if match is None:
        return (0, 0, 0)
    return (int(match[1]), int(match[2]), int(match[3]))


def runc_features(binary: str) -> dict[str, Any]:
    """`runc features` (runc ≥ 1.1.0): namespaces and seccomp actions it knows; {} if none."""
    try:
        out = subprocess.run(
            [binary, "features"],
            capture_output=True,
            text=True,
            timeout=VERSION_TIMEOUT_SECONDS,
            check=False,
        ).stdout
        data = json.loads(out)
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _controllers(root: str) -> frozenset[str]:
    if cgroups.is_v2(root):
        with open(os.path.join(root, "cgroup.controllers"), encoding="ascii") as f:
            names = set(f.read().split())
        # v2 gives cpuset's and cpu's knobs through the same names runc maps from the spec.
        return frozenset(names)
    return frozenset(name for name in os.listdir(root) if os.path.isdir(os.path.join(root, name)))


def probe(binary: str, root: str = cgroups.CGROUP_ROOT) -> HostSupport:
    version = runc_version(binary)
    linux = runc_features(binary).get("linux") or {}
    namespaces = frozenset(linux.get("namespaces") or NAMESPACE_TYPES)
    actions = (linux.get("seccomp") or {}).get("actions")
    files = frozenset(f for f in _V1_FILES if os.path.exists(os.path.join(root, f)))
    return HostSupport(
        cgroup_v2=cgroups.is_v2(root),
        controllers=_controllers(root),
        cgroup_files=files,
        resctrl=os.path.exists(os.path.join(RESCTRL_ROOT, "schemata")),
        io_priority=version >= IO_PRIORITY_SINCE,
        scheduler=version >= SCHEDULER_SINCE,
        memory_policy=version >= MEMORY_POLICY_SINCE,
        net_devices=version >= NET_DEVICES_SINCE,
        namespaces=namespaces,
        seccomp_actions=frozenset(actions) if actions else None,
        runtime=f"runc {'.'.join(map(str, version))}",
    )
