"""The OCI runtime spec (`config.json`) of a CRI container, built the way containerd does.

Pure functions: everything that needs the filesystem (the user's ids from the image's
`/etc/passwd`, a Localhost seccomp profile, the host's capabilities and devices) is resolved
by the caller (bundle.py) and passed in. The facts (argument, environment, mount, capability
and namespace rules) are containerd v2.0's CRI plugin's, as restated in the shared docs
(reference/images-and-oci.md §5-§8).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from podgate.model import ContainerSpec, NamespaceMode
from podgate.oci import seccomp as seccomp_mod
from podgate.oci.users import Identity

__all__ = [
    "DEFAULT_CAPABILITIES",
    "DEFAULT_PATH",
    "OCI_VERSION",
    "HostInfo",
    "ImageConfig",
    "PodEnv",
    "SpecError",
    "apply_capabilities",
    "build_env",
    "build_spec",
    "cgroups_path",
    "exec_process",
    "linux_resources",
    "pod_sysctls",
    "process_args",
]

OCI_VERSION: Final = "1.0.2-dev"
DEFAULT_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# containerd's default capability set, in its order.
DEFAULT_CAPABILITIES: Final = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
)
# The cgroup parent of containers whose pod names none (containerd uses /k8s.io).
DEFAULT_CGROUP_PARENT: Final = "/podgate"
_PROPAGATION: Final = {
    "PROPAGATION_PRIVATE": "rprivate",
    "PROPAGATION_HOST_TO_CONTAINER": "rslave",
    "PROPAGATION_BIDIRECTIONAL": "rshared",
}
# The OCI default spec's mounts that CRI containers keep (containerd drops /run).
_DEFAULT_MOUNTS: Final[tuple[tuple[str, str, str, tuple[str, ...]], ...]] = (
    ("/proc", "proc", "proc", ("nosuid", "noexec", "nodev")),
    ("/dev", "tmpfs", "tmpfs", ("nosuid", "strictatime", "mode=755", "size=65536k")),
    (
        "/dev/pts",
        "devpts",
        "devpts",
        ("nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"),
    ),
    ("/dev/shm", "tmpfs", "shm", ("nosuid", "noexec", "nodev", "mode=1777", "size=65536k")),
    ("/dev/mqueue", "mqueue", "mqueue", ("nosuid", "noexec", "nodev")),
    ("/sys", "sysfs", "sysfs", ("nosuid", "noexec", "nodev", "ro")),
    ("/sys/fs/cgroup", "cgroup", "cgroup", ("nosuid", "noexec", "nodev", "relatime", "ro")),
)


class SpecError(ValueError):
    """The container cannot be specified; the message is containerd's wording where it has one."""


@dataclass(frozen=True, slots=True)
class ImageConfig:
    """What a runtime uses of an image config (OCI image-spec `config`)."""

    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    working_dir: str = ""
    user: str = ""
    stop_signal: str = ""

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ImageConfig:
        """From the image config's `config` object (Entrypoint, Cmd, Env, ...); null = none."""
        return cls(
            entrypoint=tuple(data.get("Entrypoint") or ()),
            cmd=tuple(data.get("Cmd") or ()),
            env=tuple(data.get("Env") or ()),
            working_dir=str(data.get("WorkingDir") or ""),
            user=str(data.get("User") or ""),
            stop_signal=str(data.get("StopSignal") or ""),
        )


@dataclass(frozen=True, slots=True)
class PodEnv:
    """What a container takes from its pod."""

    id: str
    name: str
    namespace: str
    uid: str
    hostname: str
    ns_pid: int | None  # the process holding the pod's namespaces (None: the host's)
    # The pod's namespace files by /proc name ("net", "ipc", "uts", "pid"); before ns_pid.
    ns_paths: Mapping[str, str] = field(default_factory=dict)
    pid_mode: NamespaceMode = NamespaceMode.POD
    host_network: bool = False
    host_ipc: bool = False
    privileged: bool = False
    cgroup_parent: str = ""
    hostname_file: str = ""
    hosts_file: str = ""
    resolv_file: str = ""
    shm_dir: str = ""  # the pod's /dev/shm tmpfs ("" = the container's own)


@dataclass(frozen=True, slots=True)
class HostInfo:
    """What the node offers: the runtime's own capabilities (for ALL and privileged), the
    architecture and kernel (for seccomp), cgroup version and feature flags, and its devices
    (for privileged containers)."""

    capabilities: tuple[str, ...]
    arch: str = "amd64"
    kernel: str = "6.0"
    cgroup_v2: bool = False
    swap_controller: bool = False
    apparmor: bool = False
    rro_mounts: bool = False
    devices: tuple[dict[str, Any], ...] = ()


# ---------------------------------------------------------------------------- process


def process_args(
    command: Sequence[str], args: Sequence[str], entrypoint: Sequence[str], cmd: Sequence[str]
) -> list[str]:
    """CRI command/args over the image's Entrypoint/Cmd (containerd's WithProcessArgs)."""
    if command:
        return [*command, *args]
    entry = [] if list(entrypoint) == [""] else list(entrypoint)
    result = [*entry, *(args or cmd)]
    if not result:
        raise SpecError("no command specified")
    return result


def _set_env(env: dict[str, str], entry: str) -> None:
    key, sep, value = entry.partition("=")
    if not sep:
        env.pop(key, None)
    else:
        env[key] = value


def build_env(
    image_env: Sequence[str], cri_envs: Mapping[str, str], hostname: str, tty: bool
) -> list[str]:
    """PATH, TERM (tty), HOSTNAME, the image's Env, then CRI envs; later keys replace earlier
    ones in place, an image entry without `=` removes its key."""
    env: dict[str, str] = {"PATH": DEFAULT_PATH}
    if tty:
        env["TERM"] = "xterm"
    env["HOSTNAME"] = hostname
    for entry in image_env:
        _set_env(env, entry)
    for key, value in cri_envs.items():
        env[key] = value
    return [f"{key}={value}" for key, value in env.items()]


def _cap_name(name: str) -> str:
    upper = name.upper()
    return upper if upper.startswith("CAP_") else f"CAP_{upper}"


def apply_capabilities(
    add: Sequence[str], drop: Sequence[str], host_caps: Sequence[str]
) -> list[str]:
    """The default set with CRI add/drop: add ALL, drop ALL, named adds, named drops."""
    caps = list(DEFAULT_CAPABILITIES)
    adds = [_cap_name(c) for c in add]
    drops = [_cap_name(c) for c in drop]
    if "CAP_ALL" in adds:
        caps = list(host_caps)
    if "CAP_ALL" in drops:
        caps = []
    for cap in adds:
        if cap != "CAP_ALL" and cap not in caps:
            caps.append(cap)
    return [cap for cap in caps if cap not in drops]


# ---------------------------------------------------------------------------- mounts


def _components(path: str) -> int:
    return len([p for p in path.split("/") if p])


def _bind_options(mount: Mapping[str, Any], host: HostInfo) -> list[str]:
    propagation = str(mount.get("propagation") or "PROPAGATION_PRIVATE")
    if propagation not in _PROPAGATION:
        raise SpecError(f"unknown propagation mode {propagation!r}")
    options = ["rbind", _PROPAGATION[propagation]]
    if mount.get("recursive_read_only"):
        if not mount.get("readonly"):
            raise SpecError("recursive read-only mount conflicts with RW mount")
        if propagation != "PROPAGATION_PRIVATE":
            raise SpecError("recursive read-only mount needs private propagation")
        if not host.rro_mounts:
            raise SpecError(
                "recursive read-only mount is not supported by the OCI runtime (RROUnsupported)"
            )
        options.append("rro")
    else:
        options.append("ro" if mount.get("readonly") else "rw")
    return options


def _mounts(
    spec: ContainerSpec, pod: PodEnv, host: HostInfo, privileged: bool
) -> tuple[list[dict[str, Any]], str]:
    """The spec's mounts and the rootfs propagation they need ("" = runc's default)."""
    cri = [m for m in spec.mounts if m.get("container_path")]
    cri_dests = {str(m["container_path"]).rstrip("/") or "/" for m in cri}
    extra: list[dict[str, Any]] = []
    propagation = ""
    for mount in cri:
        options = _bind_options(mount, host)
        if "rshared" in options:
            propagation = "rshared"
        elif "rslave" in options and propagation != "rshared":
            propagation = "rslave"
        extra.append(
            {
                "destination": str(mount["container_path"]),
                "type": "bind",
                "source": str(mount["host_path"]),
                "options": options,
            }
        )
    etc_options = ["rbind", "rprivate", "ro" if spec.readonly_rootfs else "rw"]
    for dest, source in (
        ("/etc/hostname", pod.hostname_file),
        ("/etc/hosts", pod.hosts_file),
        ("/etc/resolv.conf", pod.resolv_file),
    ):
        if source and dest not in cri_dests:
            extra.append(
                {"destination": dest, "type": "bind", "source": source, "options": etc_options}
            )
    if pod.shm_dir and "/dev/shm" not in cri_dests:
        extra.append(
            {
                "destination": "/dev/shm",
                "type": "bind",
                "source": pod.shm_dir,
                "options": ["rbind", "rprivate", "rw"],
            }
        )
    extra.sort(key=lambda m: _components(m["destination"]))  # stable: order kept per depth
    taken = {m["destination"].rstrip("/") or "/" for m in extra}
    defaults = []
    for dest, kind, source, default_options in _DEFAULT_MOUNTS:
        if dest in taken or ("/dev" in taken and dest.startswith("/dev/")):
            continue
        opts = list(default_options)
        if privileged and dest in ("/sys", "/sys/fs/cgroup"):
            opts = [o for o in opts if o != "ro"] + ["rw"]
        defaults.append({"destination": dest, "type": kind, "source": source, "options": opts})
    return defaults + extra, propagation


# ---------------------------------------------------------------------------- linux


def cgroups_path(cgroup_parent: str, container_id: str) -> str:
    """cgroupfs driver: `<parent>/<id>` (podgate's parent when the pod names none)."""
    parent = cgroup_parent.rstrip("/") or DEFAULT_CGROUP_PARENT
    if not parent.startswith("/"):
        parent = "/" + parent
    return f"{parent}/{container_id}"


def _namespaces(spec: ContainerSpec, pod: PodEnv, host: HostInfo, privileged: bool) -> list[Any]:
    def joined(kind: str) -> dict[str, str]:
        proc_name = "net" if kind == "network" else kind  # /proc/<pid>/ns names it "net"
        path = pod.ns_paths.get(proc_name)
        if path:
            return {"type": kind, "path": path}
        if pod.ns_pid is None:
            return {"type": kind}
        return {"type": kind, "path": f"/proc/{pod.ns_pid}/ns/{proc_name}"}

    namespaces: list[dict[str, str]] = [{"type": "mount"}]
    if not pod.host_network:
        namespaces.append(joined("network"))
        namespaces.append(joined("uts"))
    if not pod.host_ipc:
        namespaces.append(joined("ipc"))
    if pod.pid_mode is not NamespaceMode.NODE and spec.pid_mode is not NamespaceMode.NODE:
        if spec.pid_mode is NamespaceMode.CONTAINER or pod.pid_mode is not NamespaceMode.POD:
            namespaces.append({"type": "pid"})
        else:
            namespaces.append(joined("pid"))
    if host.cgroup_v2 and not privileged:
        namespaces.append({"type": "cgroup"})
    return namespaces


def linux_resources(spec: ContainerSpec, host: HostInfo) -> dict[str, Any]:
    """linux.resources (cpu, memory) of a container's CRI resources; zero values left out."""
    out: dict[str, Any] = _resources(spec, host, ())
    out.pop("devices")
    return out


def _resources(spec: ContainerSpec, host: HostInfo, devices: Sequence[dict[str, Any]]) -> Any:
    res = spec.resources
    out: dict[str, Any] = {}
    cpu: dict[str, Any] = {}
    for key, name in (("cpu_shares", "shares"), ("cpu_quota", "quota"), ("cpu_period", "period")):
        if int(res.get(key) or 0):
            cpu[name] = int(res[key])
    for key, name in (("cpuset_cpus", "cpus"), ("cpuset_mems", "mems")):
        if res.get(key):
            cpu[name] = str(res[key])
    if cpu:
        out["cpu"] = cpu
    limit = int(res.get("memory_limit_in_bytes") or 0)
    swap = int(res.get("memory_swap_limit_in_bytes") or 0)
    if limit:
        memory: dict[str, Any] = {"limit": limit}
        if swap:
            memory["swap"] = swap
        elif host.swap_controller:
            memory["swap"] = limit
        out["memory"] = memory
    out["devices"] = list(devices)
    return out


def build_spec(
    container_id: str,
    spec: ContainerSpec,
    image: ImageConfig,
    pod: PodEnv,
    identity: Identity,
    host: HostInfo,
    *,
    localhost_seccomp: Mapping[str, Any] | None = None,
    devices: Sequence[dict[str, Any]] = (),
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """config.json for one container. `devices` are the CRI devices resolved on the host
    ({path, type, major, minor, fileMode, uid, gid, permissions})."""
    privileged = spec.privileged
    if privileged and not pod.privileged:
        raise SpecError("no privileged container allowed in sandbox")
    caps = (
        list(host.capabilities)
        if privileged
        else apply_capabilities(spec.cap_add, spec.cap_drop, host.capabilities)
    )
    process: dict[str, Any] = {
        "terminal": spec.tty,
        "user": {
            "uid": identity.uid,
            "gid": identity.gid,
            "additionalGids": list(identity.additional_gids),
        },
        "args": process_args(spec.command, spec.args, image.entrypoint, image.cmd),
        "env": build_env(image.env, spec.envs, pod.hostname, spec.tty),
        "cwd": spec.working_dir or image.working_dir or "/",
        "capabilities": {
            "bounding": caps,
            "effective": caps,
            "permitted": caps,
        },
        "noNewPrivileges": spec.no_new_privs,
        "oomScoreAdj": int(spec.resources.get("oom_score_adj") or 0),
    }
    profile = _apparmor(spec, host, privileged)
    if profile:
        process["apparmorProfile"] = profile
    mounts, propagation = _mounts(spec, pod, host, privileged)
    cri_devices: list[dict[str, Any]] = [
        {k: d[k] for k in ("path", "type", "major", "minor", "fileMode", "uid", "gid") if k in d}
        for d in devices
    ]
    device_rules: list[dict[str, Any]] = [{"allow": False, "access": "rwm"}] + [
        {
            "allow": True,
            "type": d["type"],
            "major": d["major"],
            "minor": d["minor"],
            "access": d.get("permissions") or "rwm",
        }
        for d in devices
    ]
    if privileged:
        cri_devices = [*(dict(d) for d in host.devices), *cri_devices]
        device_rules = [{"allow": True, "access": "rwm"}]
    linux: dict[str, Any] = {
        "resources": _resources(spec, host, device_rules),
        "cgroupsPath": cgroups_path(pod.cgroup_parent, container_id),
        "namespaces": _namespaces(spec, pod, host, privileged),
        "devices": cri_devices,
        "maskedPaths": [] if privileged else list(spec.masked_paths),
        "readonlyPaths": [] if privileged else list(spec.readonly_paths),
    }
    if propagation:
        linux["rootfsPropagation"] = propagation
    seccomp = _seccomp(spec, host, caps, privileged, localhost_seccomp)
    if seccomp is not None:
        linux["seccomp"] = seccomp
    result: dict[str, Any] = {
        "ociVersion": OCI_VERSION,
        "process": process,
        "root": {"path": "rootfs", "readonly": spec.readonly_rootfs},
        "mounts": mounts,
        "hooks": {},
        "annotations": {
            "io.kubernetes.cri.container-type": "container",
            "io.kubernetes.cri.sandbox-id": pod.id,
            "io.kubernetes.cri.sandbox-name": pod.name,
            "io.kubernetes.cri.sandbox-namespace": pod.namespace,
            "io.kubernetes.cri.sandbox-uid": pod.uid,
            "io.kubernetes.cri.image-name": spec.image,
            **(annotations or {}),
        },
        "linux": linux,
    }
    return result


def _apparmor(spec: ContainerSpec, host: HostInfo, privileged: bool) -> str:
    kind = spec.apparmor
    if kind in ("", "Unconfined", "unconfined"):
        return ""
    if not host.apparmor:
        raise SpecError("apparmor is not supported")
    if privileged:
        return ""
    if kind in ("RuntimeDefault", "runtime/default"):
        return "cri-containerd.apparmor.d"
    return (spec.apparmor_ref or kind).removeprefix("localhost/")


def _seccomp(
    spec: ContainerSpec,
    host: HostInfo,
    caps: Sequence[str],
    privileged: bool,
    localhost: Mapping[str, Any] | None,
) -> dict[str, Any] | None:
    try:
        kind, _ = seccomp_mod.select_profile(spec.seccomp, spec.seccomp_ref)
    except seccomp_mod.SeccompError as exc:
        raise SpecError(str(exc)) from exc
    if privileged or kind in ("", seccomp_mod.UNCONFINED):
        return None
    if kind == seccomp_mod.RUNTIME_DEFAULT:
        return seccomp_mod.runtime_default(caps, host.arch, host.kernel)
    if localhost is None:
        raise SpecError(f"seccomp profile {spec.seccomp_ref!r} was not loaded")
    return dict(localhost)


def exec_process(
    base: Mapping[str, Any], command: Sequence[str], tty: bool, env: Sequence[str] = ()
) -> dict[str, Any]:
    """An exec'd process: the container's process (user, env, cwd, capabilities, no_new_privs,
    AppArmor) with `command` as args, as containerd's exec does."""
    process = {k: v for k, v in base.items() if k not in ("oomScoreAdj", "rlimits")}
    process["args"] = list(command)
    process["terminal"] = tty
    if env:
        merged = {e.partition("=")[0]: e for e in base.get("env", [])}
        merged.update({e.partition("=")[0]: e for e in env})
        process["env"] = list(merged.values())
    process.pop("consoleSize", None)
    return process


# Linux capability numbers (<linux/capability.h>), for CapEff/CapBnd masks.
CAPABILITY_NUMBERS: Final = {
    name: number
    for number, name in enumerate(
        (
            "CAP_CHOWN",
            "CAP_DAC_OVERRIDE",
            "CAP_DAC_READ_SEARCH",
            "CAP_FOWNER",
            "CAP_FSETID",
            "CAP_KILL",
            "CAP_SETGID",
            "CAP_SETUID",
            "CAP_SETPCAP",
            "CAP_LINUX_IMMUTABLE",
            "CAP_NET_BIND_SERVICE",
            "CAP_NET_BROADCAST",
            "CAP_NET_ADMIN",
            "CAP_NET_RAW",
            "CAP_IPC_LOCK",
            "CAP_IPC_OWNER",
            "CAP_SYS_MODULE",
            "CAP_SYS_RAWIO",
            "CAP_SYS_CHROOT",
            "CAP_SYS_PTRACE",
            "CAP_SYS_PACCT",
            "CAP_SYS_ADMIN",
            "CAP_SYS_BOOT",
            "CAP_SYS_NICE",
            "CAP_SYS_RESOURCE",
            "CAP_SYS_TIME",
            "CAP_SYS_TTY_CONFIG",
            "CAP_MKNOD",
            "CAP_LEASE",
            "CAP_AUDIT_WRITE",
            "CAP_AUDIT_CONTROL",
            "CAP_SETFCAP",
            "CAP_MAC_OVERRIDE",
            "CAP_MAC_ADMIN",
            "CAP_SYSLOG",
            "CAP_WAKE_ALARM",
            "CAP_BLOCK_SUSPEND",
            "CAP_AUDIT_READ",
            "CAP_PERFMON",
            "CAP_BPF",
            "CAP_CHECKPOINT_RESTORE",
        )
    )
}


def caps_from_mask(mask: int) -> list[str]:
    """Capability names of a /proc/<pid>/status Cap* mask, in number order."""
    return [name for name, number in CAPABILITY_NUMBERS.items() if mask >> number & 1]


def caps_mask(names: Sequence[str]) -> int:
    mask = 0
    for name in names:
        mask |= 1 << CAPABILITY_NUMBERS[_cap_name(name)]
    return mask


# IPC-namespaced sysctls (runc's list), and the prefixes of namespaced families.
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
# containerd 2.0 sets these for pods with their own network unless the pod does.
DEFAULT_POD_SYSCTLS: Final = (
    ("net.ipv4.ip_unprivileged_port_start", "0"),
    ("net.ipv4.ping_group_range", "0 2147483647"),
)


def pod_sysctls(
    requested: Mapping[str, str], *, host_network: bool, host_ipc: bool
) -> dict[str, str]:
    """The sysctls a pod's namespaces get: containerd's defaults, then the requested ones.
    Only namespaced keys are allowed (runc's rules), and not for a namespace shared with the
    node; anything else is a SpecError."""
    result: dict[str, str] = {}
    if not host_network:
        result.update(DEFAULT_POD_SYSCTLS)
    for key, value in requested.items():
        name = key.replace("/", ".")
        if name in _IPC_SYSCTLS or name.startswith("fs.mqueue."):
            if host_ipc:
                raise SpecError(
                    f"sysctl {key!r} is not allowed as it conflicts with the host's IPC namespace"
                )
        elif name.startswith("net."):
            if host_network:
                raise SpecError(f"sysctl {key!r} not allowed in host network namespace")
        else:
            raise SpecError(f"sysctl {key!r} is not in a separate kernel namespace")
        if "\n" in value or ".." in name.split("."):
            raise SpecError(f"sysctl {key!r}: invalid value")
        result[name] = value
    return result
