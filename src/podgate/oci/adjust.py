"""An NRI adjustment applied to a container's OCI spec, the way containerd applies it
(containerd/nri `pkg/runtime-tools/generate`, `Generator.Adjust`): after the spec is built
from the CRI and image configs, before the bundle is written.

Pure: the adjustment comes as OCI-shaped plain data (`podgate.nri.convert.oci_adjustment`
builds it; this package sits below NRI), what the host can honour as a `HostSupport` probed
by the caller (`podgate.oci.features`), CDI devices already resolved to their edits
(`podgate.oci.cdi`). `check` lists what the host cannot honour — each as the NRI field's
upstream name, the entry and the reason — so the runtime fails the request by plugin and field
instead of writing a spec runc would silently ignore; `apply` changes the spec.

The adjustment's keys (all optional): `env` [[name, value | None]], `args` [str], `hooks`
{OCI hook kind: [hook]}, `devices` [OCI device], `removedDevices` [path], `deviceRules`
[cgroup rule], `resources` (partial OCI `linux.resources`: cpu, memory, pids, hugepageLimits,
unified), `blockioClass`, `rdtClass`, `rdt`, `cgroupsPath`, `oomScoreAdj`, `ioPriority`,
`seccomp`, `mounts` [OCI mount: the non-bind ones; bind mounts reach the spec through the
CRI mounts], `namespaces` [{type, path}] (`-type` removes), `sysctl` {key: value | None},
`netDevices`, `scheduler`, `memoryPolicy`, `rlimits`, `cdiDevices` [name] and `cdiEdits`
[CDI containerEdits, in order].
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = [
    "HOOK_KINDS",
    "NAMESPACE_TYPES",
    "AdjustError",
    "HostSupport",
    "Refusal",
    "apply",
    "check",
    "device_access",
    "merge_resources",
]

# OCI hook kinds in the order the spec lists them.
HOOK_KINDS: Final = (
    "prestart",
    "createRuntime",
    "createContainer",
    "startContainer",
    "poststart",
    "poststop",
)
REMOVAL_PREFIX: Final = "-"
# The cgroup v1 file each v1-only memory/cpu knob needs (relative to its controller's root).
_V1_MEMORY_FILES: Final = {
    "swap": "memory.memsw.limit_in_bytes",
    "kernelTCP": "memory.kmem.tcp.limit_in_bytes",
    "swappiness": "memory.swappiness",
    "disableOOMKiller": "memory.oom_control",
}
_CPU_RT_FILES: Final = {
    "realtimeRuntime": "cpu.rt_runtime_us",
    "realtimePeriod": "cpu.rt_period_us",
}
# NRI field names (upstream `api.Field`) of the resource knobs, for refusals.
_MEMORY_FIELDS: Final = {
    "limit": "MemLimit",
    "reservation": "MemReservation",
    "swap": "MemSwapLimit",
    "kernel": "MemKernelLimit",
    "kernelTCP": "MemTCPLimit",
    "swappiness": "MemSwappiness",
    "disableOOMKiller": "MemDisableOomKiller",
    "useHierarchy": "MemUseHierarchy",
}
_CPU_FIELDS: Final = {
    "shares": "CPUShares",
    "quota": "CPUQuota",
    "period": "CPUPeriod",
    "realtimeRuntime": "CPURealtimeRuntime",
    "realtimePeriod": "CPURealtimePeriod",
    "cpus": "CPUSetCPUs",
    "mems": "CPUSetMems",
}
# Namespaces the OCI spec names (a runtime's `features` may list fewer).
NAMESPACE_TYPES: Final = frozenset(
    {"pid", "network", "mount", "ipc", "uts", "user", "cgroup", "time"}
)
# Sysctls a container's own namespaces hold (runc's rules): IPC ones, fs.mqueue.*, net.*, and
# the UTS names; any other key would change the node.
_IPC_SYSCTLS: Final = frozenset(
    {
        "kernel.msgmax",
        "kernel.msgmnb",
        "kernel.msgmni",
        "kernel.sem",
        "kernel.shmall",
        "kernel.shmmax",
        "kernel.shmmni",
        "kernel.shm_rmid_forced",
    }
)
_UTS_SYSCTLS: Final = frozenset({"kernel.domainname", "kernel.hostname"})


def _namespaced_sysctl(key: str) -> bool:
    name = key.replace("/", ".")
    return name in _IPC_SYSCTLS or name in _UTS_SYSCTLS or name.startswith(("fs.mqueue.", "net."))


@dataclass(frozen=True, slots=True)
class Refusal:
    """Something the host cannot honour: the NRI field (upstream name), entry and why."""

    field: str
    key: str
    reason: str


class AdjustError(ValueError):
    """The adjustment cannot be applied to this spec (the first refusal)."""

    def __init__(self, refusal: Refusal) -> None:
        what = f"{refusal.field} {refusal.key}".rstrip()
        super().__init__(f"{what}: {refusal.reason}")
        self.refusal = refusal


@dataclass(frozen=True, slots=True)
class HostSupport:
    """What the node's kernel, cgroups and OCI runtime can honour (see podgate.oci.features).
    `cgroup_files` are v1 files relative to the hierarchy root ("memory/memory.swappiness")."""

    cgroup_v2: bool = False
    controllers: frozenset[str] = frozenset()  # v1 hierarchies mounted, or v2 controllers
    cgroup_files: frozenset[str] = frozenset()
    resctrl: bool = False
    io_priority: bool = False  # process.ioPriority
    scheduler: bool = False  # process.scheduler
    memory_policy: bool = False  # linux.memoryPolicy
    net_devices: bool = False  # linux.netDevices
    namespaces: frozenset[str] = NAMESPACE_TYPES  # what the runtime can create or join
    seccomp_actions: frozenset[str] | None = None  # None: not known (not checked)
    runtime: str = "runc"  # named in refusals
    blockio_classes: Mapping[str, Any] = field(default_factory=dict)
    rdt_classes: Mapping[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------- check


def check(adjust: Mapping[str, Any], host: HostSupport) -> list[Refusal]:
    """Everything in `adjust` this host cannot honour (empty: `apply` writes all of it)."""
    out: list[Refusal] = []
    runtime = host.runtime
    resources = adjust.get("resources") or {}
    memory = resources.get("memory") or {}
    for key in memory:
        name = _MEMORY_FIELDS.get(key, key)
        if key in ("kernel", "useHierarchy"):
            out.append(Refusal(name, "", f"{runtime} ignores it (deprecated by the kernel)"))
        elif host.cgroup_v2:
            if key in ("kernelTCP", "disableOOMKiller"):
                out.append(Refusal(name, "", "cgroup v2 has no such knob"))
        elif key in _V1_MEMORY_FILES and f"memory/{_V1_MEMORY_FILES[key]}" not in host.cgroup_files:
            out.append(
                Refusal(name, "", f"the kernel offers no cgroup {_V1_MEMORY_FILES[key]} here")
            )
        if "memory" not in host.controllers:
            out.append(Refusal(name, "", "no memory cgroup controller on this host"))
    cpu = resources.get("cpu") or {}
    for key in cpu:
        name = _CPU_FIELDS.get(key, key)
        controller = "cpuset" if key in ("cpus", "mems") else "cpu"
        if controller not in host.controllers:
            out.append(Refusal(name, "", f"no {controller} cgroup controller on this host"))
        elif key in _CPU_RT_FILES:
            if host.cgroup_v2:
                out.append(Refusal(name, "", "cgroup v2 has no real-time CPU bandwidth"))
            elif f"cpu/{_CPU_RT_FILES[key]}" not in host.cgroup_files:
                out.append(Refusal(name, "", "the kernel has no real-time group scheduling"))
    if "pids" in resources and "pids" not in host.controllers:
        out.append(Refusal("PidsLimit", "", "no pids cgroup controller on this host"))
    for limit in resources.get("hugepageLimits") or ():
        if "hugetlb" not in host.controllers:
            out.append(
                Refusal("HugepageLimits", limit["pageSize"], "no hugetlb cgroup controller here")
            )
    for key in resources.get("unified") or {}:
        if not host.cgroup_v2:
            out.append(Refusal("CgroupsUnified", key, "the host runs cgroup v1 (unified needs v2)"))
    if adjust.get("blockioClass") and adjust["blockioClass"] not in host.blockio_classes:
        out.append(
            Refusal(
                "BlockioClass",
                adjust["blockioClass"],
                "no block I/O class of that name is configured on this node",
            )
        )
    if adjust.get("rdtClass"):
        reason = (
            "no RDT class of that name is configured on this node"
            if host.resctrl
            else "the host has no resctrl filesystem (Intel RDT)"
        )
        if not host.resctrl or adjust["rdtClass"] not in host.rdt_classes:
            out.append(Refusal("RdtClass", adjust["rdtClass"], reason))
    rdt = adjust.get("rdt") or {}
    if rdt and not host.resctrl:
        for key, name in (
            ("closID", "RdtClosID"),
            ("schemata", "RdtSchemata"),
            ("enableMonitoring", "RdtEnableMonitoring"),
        ):
            if key in rdt:
                out.append(Refusal(name, "", "the host has no resctrl filesystem (Intel RDT)"))
    if adjust.get("ioPriority") is not None and not host.io_priority:
        out.append(Refusal("IoPriority", "", f"{runtime} does not support process.ioPriority"))
    if adjust.get("scheduler") is not None and not host.scheduler:
        out.append(Refusal("LinuxSched", "", f"{runtime} does not support process.scheduler"))
    if adjust.get("memoryPolicy") is not None and not host.memory_policy:
        out.append(Refusal("MemoryPolicy", "", f"{runtime} does not support linux.memoryPolicy"))
    for name in adjust.get("netDevices") or {}:
        if not host.net_devices:
            out.append(
                Refusal("LinuxNetDevices", name, f"{runtime} does not support linux.netDevices")
            )
    for namespace in adjust.get("namespaces") or ():
        kind = str(namespace["type"]).removeprefix(REMOVAL_PREFIX)
        if kind not in NAMESPACE_TYPES:
            out.append(Refusal("Namespace", kind, "not a Linux namespace type"))
        elif kind not in host.namespaces:
            out.append(Refusal("Namespace", kind, f"{runtime} does not support it"))
    for key, value in (adjust.get("sysctl") or {}).items():
        if value is None:
            continue
        if "\n" in value or ".." in key.replace("/", ".").split("."):
            out.append(Refusal("Sysctl", key, "invalid sysctl"))
        elif not _namespaced_sysctl(key):
            out.append(Refusal("Sysctl", key, "not in a separate kernel namespace"))
    seccomp = adjust.get("seccomp")
    if seccomp is not None and host.seccomp_actions is not None:
        actions = [seccomp.get("defaultAction", "")]
        actions += [s.get("action", "") for s in seccomp.get("syscalls") or ()]
        for action in actions:
            if action not in host.seccomp_actions:
                out.append(Refusal("SeccompPolicy", action, f"{runtime} does not know it"))
    return out


# ----------------------------------------------------------------------------- apply


def apply(config: dict[str, Any], adjust: Mapping[str, Any], *, swap: bool = True) -> None:
    """Apply `adjust` to `config` (a config.json) in containerd's order; AdjustError for what
    cannot be expressed (callers run `check` first for what the host cannot honour). `swap`:
    the host limits memory+swap (a memory limit then caps swap too)."""
    process = config.setdefault("process", {})
    linux = config.setdefault("linux", {})
    _apply_env(process, adjust.get("env") or ())
    if adjust.get("args"):
        process["args"] = list(adjust["args"])
    _apply_hooks(config, adjust.get("hooks") or {})
    for edits in adjust.get("cdiEdits") or ():
        _apply_cdi(config, edits)
    _apply_devices(linux, adjust.get("removedDevices") or (), adjust.get("devices") or ())
    if adjust.get("cgroupsPath"):
        linux["cgroupsPath"] = adjust["cgroupsPath"]
    if adjust.get("oomScoreAdj") is not None:
        process["oomScoreAdj"] = int(adjust["oomScoreAdj"])
    if adjust.get("ioPriority") is not None:
        process["ioPriority"] = dict(adjust["ioPriority"])
    if adjust.get("seccomp") is not None:
        linux["seccomp"] = copy.deepcopy(adjust["seccomp"])
    _apply_namespaces(linux, adjust.get("namespaces") or ())
    if adjust.get("memoryPolicy") is not None:
        linux["memoryPolicy"] = dict(adjust["memoryPolicy"])
    if adjust.get("scheduler") is not None:
        process["scheduler"] = dict(adjust["scheduler"])
    for key, value in (adjust.get("sysctl") or {}).items():
        sysctl = linux.setdefault("sysctl", {})
        if value is None:
            sysctl.pop(key, None)
        else:
            sysctl[key] = value
    if adjust.get("netDevices"):
        linux.setdefault("netDevices", {}).update(copy.deepcopy(adjust["netDevices"]))
    resources = linux.setdefault("resources", {})
    merge_resources(resources, adjust.get("resources") or {}, swap=swap)
    resources.setdefault("devices", []).extend(dict(r) for r in adjust.get("deviceRules") or ())
    if adjust.get("blockioClass") is not None:
        resources.pop("blockIO", None)
    if adjust.get("rdtClass") is not None or adjust.get("rdt"):
        linux.pop("intelRdt", None)
    _apply_mounts(config, adjust.get("mounts") or ())
    _apply_rlimits(process, adjust.get("rlimits") or ())


def _apply_mounts(config: dict[str, Any], mounts: Any) -> None:
    """Each mount replaces one at its destination; then sorted by depth (stable), so a mount
    never lands under one made after it, as upstream sorts."""
    if not mounts:
        return
    destinations = {m["destination"] for m in mounts}
    kept = [m for m in config.get("mounts", []) if m["destination"] not in destinations]
    merged = [*kept, *(dict(m) for m in mounts)]
    merged.sort(key=lambda m: len([p for p in m["destination"].split("/") if p]))
    config["mounts"] = merged


def merge_resources(
    resources: dict[str, Any], partial: Mapping[str, Any], *, swap: bool = True
) -> None:
    """A partial `linux.resources` over `resources`: knobs replace, hugepage limits replace
    by page size, unified keys by name. A memory limit sets the swap limit to the same value
    unless swap is given too (containerd's generator: no swap beyond the limit)."""
    for group in ("cpu", "memory", "pids"):
        if partial.get(group):
            resources.setdefault(group, {}).update(partial[group])
    memory = partial.get("memory") or {}
    if swap and "limit" in memory and "swap" not in memory and memory["limit"]:
        resources["memory"]["swap"] = memory["limit"]
    for limit in partial.get("hugepageLimits") or ():
        limits = [
            entry
            for entry in resources.get("hugepageLimits", [])
            if entry["pageSize"] != limit["pageSize"]
        ]
        resources["hugepageLimits"] = [*limits, dict(limit)]
    if partial.get("unified"):
        resources.setdefault("unified", {}).update(partial["unified"])


def _apply_env(process: dict[str, Any], env: Any) -> None:
    """Existing names are changed in place (or dropped); new ones appended, as upstream."""
    changes = {str(name).removeprefix(REMOVAL_PREFIX): (name, value) for name, value in env}
    out: list[str] = []
    for entry in process.get("env", []):
        key, sep, _ = entry.partition("=")
        if not sep:
            continue
        change = changes.pop(key, None)
        if change is None:
            out.append(entry)
        elif not str(change[0]).startswith(REMOVAL_PREFIX) and change[1] is not None:
            out.append(f"{key}={change[1]}")
    for key, (name, value) in changes.items():
        if not str(name).startswith(REMOVAL_PREFIX) and value is not None:
            out.append(f"{key}={value}")
    process["env"] = out


def _apply_hooks(config: dict[str, Any], hooks: Mapping[str, Any]) -> None:
    for kind in HOOK_KINDS:
        for hook in hooks.get(kind) or ():
            config.setdefault("hooks", {}).setdefault(kind, []).append(dict(hook))


def _device_rule(device: Mapping[str, Any], access: str) -> dict[str, Any]:
    return {
        "allow": True,
        "type": device["type"],
        "major": device["major"],
        "minor": device["minor"],
        "access": access,
    }


def device_access(device: Mapping[str, Any]) -> str:
    """The cgroup access string upstream gives an NRI device: read and write, plus mknod for
    block devices (`LinuxDevice.AccessString`)."""
    return "rwm" if device.get("type") == "b" else "rw"


def _apply_devices(linux: dict[str, Any], removed: Any, devices: Any) -> None:
    gone = set(removed) | {d["path"] for d in devices}
    linux["devices"] = [d for d in linux.get("devices", []) if d["path"] not in gone]
    rules = linux.setdefault("resources", {}).setdefault("devices", [])
    for device in devices:
        linux["devices"].append(dict(device))
        rules.append(_device_rule(device, device_access(device)))


def _apply_namespaces(linux: dict[str, Any], namespaces: Any) -> None:
    for namespace in namespaces:
        kind = str(namespace["type"])
        current = [n for n in linux.get("namespaces", []) if n["type"] != kind.lstrip("-")]
        if not kind.startswith(REMOVAL_PREFIX):
            entry = {"type": kind}
            if namespace.get("path"):
                entry["path"] = namespace["path"]
            current.append(entry)
        linux["namespaces"] = current


def _apply_rlimits(process: dict[str, Any], rlimits: Any) -> None:
    """Upstream appends; runc applies them in order, so a later entry of a type wins. Kept
    as one entry per type (the last), which is what the process ends up with."""
    if not rlimits:
        return
    merged: dict[str, dict[str, Any]] = {r["type"]: r for r in process.get("rlimits", [])}
    for rlimit in rlimits:
        merged.pop(rlimit["type"], None)
        merged[rlimit["type"]] = dict(rlimit)
    process["rlimits"] = list(merged.values())


def _apply_cdi(config: dict[str, Any], edits: Mapping[str, Any]) -> None:
    """One CDI containerEdits (CDI spec v0.x): env, device nodes (+ cgroup rules), mounts,
    hooks (by hookName) and additional GIDs."""
    process = config.setdefault("process", {})
    linux = config.setdefault("linux", {})
    env = [entry.partition("=") for entry in edits.get("env") or ()]
    _apply_env(process, [(key, value) for key, _, value in env])
    nodes = []
    for node in edits.get("deviceNodes") or ():
        device = {
            k: node[k]
            for k in ("path", "type", "major", "minor", "fileMode", "uid", "gid")
            if k in node
        }
        nodes.append((device, node.get("permissions") or "rwm"))
    rules = linux.setdefault("resources", {}).setdefault("devices", [])
    for device, access in nodes:
        linux["devices"] = [d for d in linux.get("devices", []) if d["path"] != device["path"]]
        linux["devices"].append(device)
        rules.append(_device_rule(device, access))
    for mount in edits.get("mounts") or ():
        entry = {
            "destination": mount["containerPath"],
            "type": mount.get("type") or "bind",
            "source": mount["hostPath"],
            "options": list(mount.get("options") or ("rbind", "rprivate")),
        }
        config["mounts"] = [
            m for m in config.get("mounts", []) if m["destination"] != entry["destination"]
        ]
        config["mounts"].append(entry)
    for hook in edits.get("hooks") or ():
        kind = hook.get("hookName", "")
        if kind not in HOOK_KINDS:
            raise AdjustError(Refusal("CdiDevices", kind, "unknown CDI hook name"))
        entry = {k: hook[k] for k in ("path", "args", "env", "timeout") if k in hook}
        config.setdefault("hooks", {}).setdefault(kind, []).append(entry)
    gids = process.setdefault("user", {}).setdefault("additionalGids", [])
    for gid in edits.get("additionalGids") or ():
        if gid not in gids:
            gids.append(int(gid))
