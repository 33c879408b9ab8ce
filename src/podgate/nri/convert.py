"""podgate's runtime records as NRI messages, and a merged NRI adjustment applied back to a
container's spec. Pure functions: no I/O.

Mounts follow containerd's CRI → OCI mapping: a CRI mount is an OCI bind mount with options
`rbind`, the propagation (`rprivate`, `rslave`, `rshared`) and `ro`/`rw` (plus `rro` for a
recursive read-only one); an NRI mount coming back is read the same way. Env, args, mounts
and annotations go back into the `ContainerSpec`; `oci_adjustment` turns the whole adjustment
into the OCI-shaped data `podgate.oci.adjust` applies to a container's config.json.
`APPLIED_FIELDS` is the one table of what reaches a container; the rest is refused by the
runtime by name rather than dropped (runtime.nri).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from podgate.model import (
    ContainerRecord,
    ContainerSpec,
    ContainerState,
    NamespaceMode,
    PodRecord,
)
from podgate.nri import api_pb2 as api
from podgate.nri.merge import REMOVAL_PREFIX, Field

__all__ = [
    "APPLIED_FIELDS",
    "NAMESPACE_CONTAINER_FIELDS",
    "apply_adjustment",
    "container",
    "is_bind",
    "mount_from_nri",
    "mount_to_nri",
    "nri_resources",
    "oci_adjustment",
    "oci_resources",
    "pod_sandbox",
]

_STATES: dict[ContainerState, api.ContainerState.ValueType] = {
    ContainerState.CREATED: api.CONTAINER_CREATED,
    ContainerState.RUNNING: api.CONTAINER_RUNNING,
    ContainerState.EXITED: api.CONTAINER_STOPPED,
    ContainerState.UNKNOWN: api.CONTAINER_UNKNOWN,
}
# CRI MountPropagation names (as ContainerSpec.mounts stores them) <-> OCI mount options.
_PROPAGATION_OPTIONS = {
    "PROPAGATION_PRIVATE": "rprivate",
    "PROPAGATION_HOST_TO_CONTAINER": "rslave",
    "PROPAGATION_BIDIRECTIONAL": "rshared",
}
_PROPAGATION_FROM_OPTION = {
    "private": "PROPAGATION_PRIVATE",
    "rprivate": "PROPAGATION_PRIVATE",
    "slave": "PROPAGATION_HOST_TO_CONTAINER",
    "rslave": "PROPAGATION_HOST_TO_CONTAINER",
    "shared": "PROPAGATION_BIDIRECTIONAL",
    "rshared": "PROPAGATION_BIDIRECTIONAL",
}
_BIND = "bind"
# NRI mount types that are bind mounts (a CRI mount can hold them); others (tmpfs, proc, …)
# go to the OCI spec as they are.
_BIND_TYPES = frozenset({"", "bind", "rbind"})


def is_bind(mount: api.Mount) -> bool:
    return mount.type in _BIND_TYPES


# The adjustment fields that reach a container with a root of its own: env, args, mounts and
# annotations through its ContainerSpec, the rest through `oci_adjustment` applied to its OCI
# spec (podgate.oci.adjust). A plugin that sets any other field fails CreateContainer with its
# name and the field's; so does one the host cannot honour (podgate.oci.adjust.check). Add a
# field here in the same change that applies it. Left out: MemKernelLimit and MemUseHierarchy
# (the kernel dropped them; runc ignores them without a word).
APPLIED_FIELDS: frozenset[Field] = frozenset(Field) - {
    Field.MEM_KERNEL_LIMIT,
    Field.MEM_USE_HIERARCHY,
}
# What a container without a root (a process in the pod's namespaces, no OCI spec) takes.
NAMESPACE_CONTAINER_FIELDS: frozenset[Field] = frozenset(
    {Field.ANNOTATIONS, Field.MOUNTS, Field.ENV, Field.ARGS}
)


# ----------------------------------------------------------------------------- records → NRI


def pod_sandbox(pod: PodRecord, *, netns_path: str, ips: Sequence[str]) -> api.PodSandbox:
    """The pod as plugins see it. `netns_path` is the network namespace plugins configure
    ("" for host-network pods or when it is gone); `ips` lists the primary IP first."""
    message = api.PodSandbox(
        id=pod.id,
        name=pod.metadata.name,
        uid=pod.metadata.uid,
        namespace=pod.metadata.namespace,
        labels=pod.labels,
        annotations=pod.annotations,
        runtime_handler=pod.runtime_handler,
        pid=pod.ns_process.pid if pod.ns_process is not None else 0,
        ips=[ip for ip in ips if ip],
    )
    namespaces = message.linux.namespaces
    if pod.network_mode is not NamespaceMode.NODE and netns_path:
        namespaces.add(type="network", path=netns_path)
    if pod.ns_process is not None:
        proc = f"/proc/{pod.ns_process.pid}/ns"
        if pod.ipc_mode is NamespaceMode.POD:
            namespaces.add(type="ipc", path=f"{proc}/ipc")
        if pod.pid_mode is NamespaceMode.POD:
            namespaces.add(type="pid", path=f"{proc}/pid")
    # The pod-level resources as recorded (containerd: the sandbox config's); unset when none.
    if pod.overhead:
        message.linux.pod_overhead.CopyFrom(nri_resources(pod.overhead))
    if pod.resources:
        message.linux.pod_resources.CopyFrom(nri_resources(pod.resources))
    return message


def mount_to_nri(mount: dict[str, Any]) -> api.Mount:
    """A ContainerSpec mount (CRI fields) as the OCI bind mount containerd would make of it."""
    options = [
        "rbind",
        _PROPAGATION_OPTIONS.get(str(mount.get("propagation", "")), "rprivate"),
        "ro" if mount.get("readonly") else "rw",
    ]
    if mount.get("recursive_read_only"):
        options.append("rro")
    return api.Mount(
        destination=str(mount.get("container_path", "")),
        type=_BIND,
        source=str(mount.get("host_path", "")),
        options=options,
    )


def container(c: ContainerRecord) -> api.Container:
    """The container as plugins see it: args are command + args, env "KEY=value"."""
    return api.Container(
        id=c.id,
        pod_sandbox_id=c.pod_id,
        name=c.metadata.name,
        state=_STATES[c.state],
        labels=c.labels,
        annotations=c.annotations,
        args=[*c.spec.command, *c.spec.args],
        env=[f"{key}={value}" for key, value in c.spec.envs.items()],
        mounts=[mount_to_nri(mount) for mount in c.spec.mounts],
        pid=c.process.pid if c.process is not None else 0,
        created_at=c.created_at,
        started_at=c.started_at,
        finished_at=c.finished_at,
        exit_code=c.exit_code,
        status_reason=c.reason,
        status_message=c.message,
    )


# ----------------------------------------------------------------------------- NRI → spec


def mount_from_nri(mount: api.Mount) -> dict[str, Any]:
    """An NRI mount as a ContainerSpec mount (the CRI fields `runtime.cri.convert` stores)."""
    options = set(mount.options)
    propagation = "PROPAGATION_PRIVATE"
    for option in mount.options:
        propagation = _PROPAGATION_FROM_OPTION.get(option, propagation)
    return {
        "container_path": mount.destination,
        "host_path": mount.source,
        "readonly": "ro" in options or "rro" in options,
        "selinux_relabel": False,
        "propagation": propagation,
        "recursive_read_only": "rro" in options,
    }


def apply_adjustment(
    spec: ContainerSpec, annotations: MutableMapping[str, str], adjust: api.ContainerAdjustment
) -> None:
    """Apply a (merged) adjustment in place: in each field removals (`-key`) first, then what
    is set, as upstream applies one reply. Args replace command + args as a whole."""
    for kv in adjust.env:
        if kv.key.startswith(REMOVAL_PREFIX):
            spec.envs.pop(kv.key[len(REMOVAL_PREFIX) :], None)
    for kv in adjust.env:
        if not kv.key.startswith(REMOVAL_PREFIX):
            spec.envs[kv.key] = kv.value

    args = list(adjust.args)
    if args and args[0] == "":  # upstream's "replace, do not conflict" marker
        args = args[1:]
    if args:
        spec.command, spec.args = args, []

    removed = {
        m.destination[len(REMOVAL_PREFIX) :]
        for m in adjust.mounts
        if m.destination.startswith(REMOVAL_PREFIX)
    }
    added = [m for m in adjust.mounts if not m.destination.startswith(REMOVAL_PREFIX)]
    replaced = removed | {m.destination for m in added}
    added = [m for m in added if is_bind(m)]  # the others reach the OCI spec only
    spec.mounts = [m for m in spec.mounts if m.get("container_path") not in replaced]
    spec.mounts.extend(mount_from_nri(m) for m in added)

    for key in adjust.annotations:
        if key.startswith(REMOVAL_PREFIX):
            annotations.pop(key[len(REMOVAL_PREFIX) :], None)
    for key, value in adjust.annotations.items():
        if not key.startswith(REMOVAL_PREFIX):
            annotations[key] = value


# ----------------------------------------------------------------------------- NRI → OCI

_OCI_HOOK_KINDS = {
    "prestart": "prestart",
    "create_runtime": "createRuntime",
    "create_container": "createContainer",
    "start_container": "startContainer",
    "poststart": "poststart",
    "poststop": "poststop",
}
# LinuxMemory / LinuxCPU field -> OCI linux.resources key.
_OCI_MEMORY = {
    "limit": "limit",
    "reservation": "reservation",
    "swap": "swap",
    "kernel": "kernel",
    "kernel_tcp": "kernelTCP",
    "swappiness": "swappiness",
    "disable_oom_killer": "disableOOMKiller",
    "use_hierarchy": "useHierarchy",
}
_OCI_CPU = {
    "shares": "shares",
    "quota": "quota",
    "period": "period",
    "realtime_runtime": "realtimeRuntime",
    "realtime_period": "realtimePeriod",
}


def _optional(message: Any, name: str) -> Any:
    return getattr(message, name).value if message.HasField(name) else None


def oci_resources(resources: api.LinuxResources) -> dict[str, Any]:
    """The resources a plugin set, as a partial OCI `linux.resources` (unset left out)."""
    out: dict[str, Any] = {}
    if resources.HasField("memory"):
        memory = {
            oci: _optional(resources.memory, name)
            for name, oci in _OCI_MEMORY.items()
            if resources.memory.HasField(name)  # type: ignore[arg-type]
        }
        if memory:
            out["memory"] = memory
    if resources.HasField("cpu"):
        cpu: dict[str, Any] = {
            oci: _optional(resources.cpu, name)
            for name, oci in _OCI_CPU.items()
            if resources.cpu.HasField(name)  # type: ignore[arg-type]
        }
        if resources.cpu.cpus:
            cpu["cpus"] = resources.cpu.cpus
        if resources.cpu.mems:
            cpu["mems"] = resources.cpu.mems
        if cpu:
            out["cpu"] = cpu
    if resources.HasField("pids"):
        out["pids"] = {"limit": resources.pids.limit}
    if resources.hugepage_limits:
        out["hugepageLimits"] = [
            {"pageSize": h.page_size, "limit": h.limit} for h in resources.hugepage_limits
        ]
    if resources.unified:
        out["unified"] = dict(resources.unified)
    return out


def _device_rule(rule: api.LinuxDeviceCgroup) -> dict[str, Any]:
    out: dict[str, Any] = {"allow": rule.allow, "access": rule.access or "rwm"}
    if rule.type:
        out["type"] = rule.type
    if rule.HasField("major"):
        out["major"] = rule.major.value
    if rule.HasField("minor"):
        out["minor"] = rule.minor.value
    return out


def _seccomp(policy: api.LinuxSeccomp) -> dict[str, Any]:
    out: dict[str, Any] = {"defaultAction": policy.default_action}
    if policy.HasField("default_errno"):
        out["defaultErrnoRet"] = policy.default_errno.value
    for key, value in (
        ("architectures", list(policy.architectures)),
        ("flags", list(policy.flags)),
        ("listenerPath", policy.listener_path),
        ("listenerMetadata", policy.listener_metadata),
    ):
        if value:
            out[key] = value
    syscalls = []
    for syscall in policy.syscalls:
        entry: dict[str, Any] = {"names": list(syscall.names), "action": syscall.action}
        if syscall.HasField("errno_ret"):
            entry["errnoRet"] = syscall.errno_ret.value
        if syscall.args:
            entry["args"] = [
                {"index": a.index, "value": a.value, "valueTwo": a.value_two, "op": a.op}
                for a in syscall.args
            ]
        syscalls.append(entry)
    if syscalls:
        out["syscalls"] = syscalls
    return out


def _scheduler(sched: api.LinuxScheduler) -> dict[str, Any]:
    out: dict[str, Any] = {
        "policy": api.LinuxSchedulerPolicy.Name(sched.policy),
        "nice": sched.nice,
        "priority": sched.priority,
    }
    if sched.flags:
        out["flags"] = [api.LinuxSchedulerFlag.Name(f) for f in sched.flags]
    for key in ("runtime", "deadline", "period"):
        if getattr(sched, key):
            out[key] = getattr(sched, key)
    return out


def _memory_policy(policy: api.LinuxMemoryPolicy) -> dict[str, Any]:
    out: dict[str, Any] = {"mode": api.MpolMode.Name(policy.mode), "nodes": policy.nodes}
    if policy.flags:
        out["flags"] = [api.MpolFlag.Name(f) for f in policy.flags]
    return out


def oci_adjustment(adjust: api.ContainerAdjustment) -> dict[str, Any]:
    """A merged adjustment as the OCI-shaped data `podgate.oci.adjust.apply` takes."""
    out: dict[str, Any] = {}
    if adjust.env:
        out["env"] = [[kv.key, kv.value] for kv in adjust.env]
    args = list(adjust.args)
    if args and args[0] == "":
        args = args[1:]
    if args:
        out["args"] = args
    hooks: dict[str, list[dict[str, Any]]] = {}
    for name, kind in _OCI_HOOK_KINDS.items():
        for hook in getattr(adjust.hooks, name):
            entry: dict[str, Any] = {"path": hook.path}
            if hook.args:
                entry["args"] = list(hook.args)
            if hook.env:
                entry["env"] = list(hook.env)
            if hook.HasField("timeout"):
                entry["timeout"] = hook.timeout.value
            hooks.setdefault(kind, []).append(entry)
    if hooks:
        out["hooks"] = hooks
    other = [m for m in adjust.mounts if not is_bind(m)]
    if other:
        out["mounts"] = [
            {
                "destination": m.destination,
                "type": m.type,
                "source": m.source,
                "options": list(m.options),
            }
            for m in other
        ]
    if adjust.rlimits:
        out["rlimits"] = [{"type": r.type, "hard": r.hard, "soft": r.soft} for r in adjust.rlimits]
    if adjust.CDI_devices:
        out["cdiDevices"] = [d.name for d in adjust.CDI_devices]
    if adjust.HasField("linux"):
        out.update(_oci_linux(adjust.linux))
    return out


def _oci_linux(linux: api.LinuxContainerAdjustment) -> dict[str, Any]:
    out: dict[str, Any] = {}
    devices, removed = [], []
    for d in linux.devices:
        if d.path.startswith(REMOVAL_PREFIX):
            removed.append(d.path[len(REMOVAL_PREFIX) :])
            continue
        device: dict[str, Any] = {
            "path": d.path,
            "type": d.type,
            "major": d.major,
            "minor": d.minor,
        }
        for name, key in (("file_mode", "fileMode"), ("uid", "uid"), ("gid", "gid")):
            if d.HasField(name):  # type: ignore[arg-type]
                device[key] = getattr(d, name).value
        devices.append(device)
    if devices:
        out["devices"] = devices
    if removed:
        out["removedDevices"] = removed
    if linux.HasField("resources"):
        resources = linux.resources
        partial = oci_resources(resources)
        if partial:
            out["resources"] = partial
        if resources.devices:
            out["deviceRules"] = [_device_rule(rule) for rule in resources.devices]
        if resources.HasField("blockio_class"):
            out["blockioClass"] = resources.blockio_class.value
        if resources.HasField("rdt_class"):
            out["rdtClass"] = resources.rdt_class.value
    if linux.cgroups_path:
        out["cgroupsPath"] = linux.cgroups_path
    if linux.HasField("oom_score_adj"):
        out["oomScoreAdj"] = linux.oom_score_adj.value
    if linux.HasField("io_priority"):
        out["ioPriority"] = {
            "class": api.IOPrioClass.Name(getattr(linux.io_priority, "class")),
            "priority": linux.io_priority.priority,
        }
    if linux.HasField("seccomp_policy"):
        out["seccomp"] = _seccomp(linux.seccomp_policy)
    if linux.namespaces:
        out["namespaces"] = [{"type": n.type, "path": n.path} for n in linux.namespaces]
    if linux.sysctl:
        out["sysctl"] = {
            key.removeprefix(REMOVAL_PREFIX): None if key.startswith(REMOVAL_PREFIX) else value
            for key, value in linux.sysctl.items()
        }
    if linux.net_devices:
        out["netDevices"] = {
            key: {"name": device.name} for key, device in linux.net_devices.items()
        }
    if linux.HasField("scheduler"):
        out["scheduler"] = _scheduler(linux.scheduler)
    if linux.HasField("memory_policy"):
        out["memoryPolicy"] = _memory_policy(linux.memory_policy)
    if linux.HasField("rdt"):
        rdt: dict[str, Any] = {}
        if linux.rdt.HasField("clos_id"):
            rdt["closID"] = linux.rdt.clos_id.value
        if linux.rdt.HasField("schemata"):
            rdt["schemata"] = list(linux.rdt.schemata.value)
        if linux.rdt.HasField("enable_monitoring"):
            rdt["enableMonitoring"] = linux.rdt.enable_monitoring.value
        if rdt or linux.rdt.remove:
            out["rdt"] = rdt or {"remove": True}
    return out


def nri_resources(resources: Mapping[str, Any]) -> api.LinuxResources:
    """CRI container resources (as ContainerSpec.resources stores them) as NRI's."""
    out = api.LinuxResources()
    if resources.get("memory_limit_in_bytes"):
        out.memory.limit.value = int(resources["memory_limit_in_bytes"])
    if resources.get("memory_swap_limit_in_bytes"):
        out.memory.swap.value = int(resources["memory_swap_limit_in_bytes"])
    if resources.get("cpu_shares"):
        out.cpu.shares.value = int(resources["cpu_shares"])
    if resources.get("cpu_quota"):
        out.cpu.quota.value = int(resources["cpu_quota"])
    if resources.get("cpu_period"):
        out.cpu.period.value = int(resources["cpu_period"])
    if resources.get("cpuset_cpus"):
        out.cpu.cpus = str(resources["cpuset_cpus"])
    if resources.get("cpuset_mems"):
        out.cpu.mems = str(resources["cpuset_mems"])
    return out
