"""The filesystem side of a container's OCI bundle: what the node offers (capabilities,
devices, cgroup and AppArmor support), host paths of CRI mounts and devices, Localhost
seccomp files, the user's ids read from the rootfs, and writing `config.json`.

spec.py stays pure; this module gathers its inputs and writes its output.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from podgate.files import atomic_write
from podgate.oci import cgroups, seccomp, spec, users
from podgate.oci.securejoin import secure_join

__all__ = [
    "CONFIG_MODE",
    "MAX_SECCOMP_PROFILE_BYTES",
    "host_devices",
    "host_info",
    "load_localhost_seccomp",
    "prepare_mount_sources",
    "resolve_devices",
    "resolve_identity",
    "write_json",
]

# config.json and process files hold the container's environment: owner-only.
CONFIG_MODE: Final = 0o600
# A Localhost seccomp profile larger than this is refused, bytes.
MAX_SECCOMP_PROFILE_BYTES: Final = 1024 * 1024
# Directories under /dev a privileged container does not get (containerd's skip list).
_SKIPPED_DEV: Final = frozenset({"pts", "shm", "fd", "mqueue", ".lxc", ".lxd-mounts", ".udev"})
_APPARMOR_ENABLED: Final = "/sys/module/apparmor/parameters/enabled"


def _own_capabilities() -> tuple[str, ...]:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("CapBnd:"):
                return tuple(spec.caps_from_mask(int(line.split()[1], 16)))
    return ()


def _apparmor() -> bool:
    try:
        with open(_APPARMOR_ENABLED, encoding="ascii") as f:
            enabled = f.read().startswith("Y")
    except OSError:
        return False
    return (
        enabled
        and os.path.isdir("/sys/kernel/security/apparmor")
        and os.path.exists("/sbin/apparmor_parser")
        and "container" not in os.environ
    )


def host_info(*, privileged_devices: bool = False) -> spec.HostInfo:
    """The node as containers see it; `privileged_devices` also lists /dev (for privileged
    containers only, as walking /dev costs)."""
    v2 = cgroups.is_v2()
    swap = (
        os.path.exists(os.path.join(cgroups.CGROUP_ROOT, "memory", "memory.memsw.limit_in_bytes"))
        if not v2
        else True
    )
    return spec.HostInfo(
        capabilities=_own_capabilities(),
        arch=seccomp.host_arch(),
        kernel=os.uname().release,
        cgroup_v2=v2,
        swap_controller=swap,
        apparmor=_apparmor(),
        rro_mounts=False,  # runc 1.1 has no `rro`
        devices=tuple(host_devices()) if privileged_devices else (),
    )


def _device(path: str, container_path: str) -> dict[str, Any] | None:
    st = os.stat(path)
    if stat.S_ISCHR(st.st_mode):
        kind = "c"
    elif stat.S_ISBLK(st.st_mode):
        kind = "b"
    else:
        return None
    return {
        "path": container_path,
        "type": kind,
        "major": os.major(st.st_rdev),
        "minor": os.minor(st.st_rdev),
        "fileMode": stat.S_IMODE(st.st_mode),
        "uid": st.st_uid,
        "gid": st.st_gid,
    }


def host_devices(root: str = "/dev") -> list[dict[str, Any]]:
    """Every char/block device under /dev (skipping pts, shm, fd, mqueue, console, hidden
    helper directories), for privileged containers."""
    found = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIPPED_DEV]
        for name in sorted(files):
            path = os.path.join(directory, name)
            if name == "console" or os.path.islink(path):
                continue
            try:
                device = _device(path, path)
            except OSError:
                continue
            if device is not None:
                found.append(device)
    return found


def resolve_devices(devices: Iterable[Mapping[str, str]]) -> list[dict[str, Any]]:
    """CRI devices: host symlinks resolved; a directory adds every device below it."""
    resolved = []
    for device in devices:
        host = os.path.realpath(device["host_path"])
        container_path = device.get("container_path") or device["host_path"]
        permissions = device.get("permissions") or "rwm"
        if os.path.isdir(host):
            for found in host_devices(host):
                relative = os.path.relpath(found["path"], host)
                found["path"] = os.path.join(container_path, relative)
                resolved.append({**found, "permissions": permissions})
            continue
        entry = _device(host, container_path)
        if entry is None:
            raise OSError(f"{device['host_path']} is not a device")
        resolved.append({**entry, "permissions": permissions})
    return resolved


def prepare_mount_sources(mounts: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """CRI mounts with host paths resolved (symlinks followed); a missing host path is created
    as a 0755 directory, as containerd does."""
    prepared = []
    for mount in mounts:
        source = str(mount.get("host_path") or "")
        if not source or not mount.get("container_path"):
            continue
        if not os.path.lexists(source):
            os.makedirs(source, mode=0o755, exist_ok=True)
        prepared.append({**mount, "host_path": os.path.realpath(source)})
    return prepared


def load_localhost_seccomp(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_SECCOMP_PROFILE_BYTES + 1)
    except OSError as exc:
        raise seccomp.SeccompError(f'cannot load seccomp profile "{path}": {exc}') from exc
    if len(text) > MAX_SECCOMP_PROFILE_BYTES:
        raise seccomp.SeccompError(f'cannot load seccomp profile "{path}": too large')
    return seccomp.load_localhost(text.decode("utf-8", "replace"), path)


def resolve_identity(
    rootfs: str, user: str, supplemental: Sequence[int], strict: bool
) -> users.Identity:
    passwd, group = users.read_user_files(rootfs)
    return users.resolve(user, passwd, group, supplemental, strict=strict)


def write_json(path: str, data: Any) -> None:
    """Write `data` to `path` (owner-only), replacing it atomically."""
    atomic_write(path, json.dumps(data).encode(), mode=CONFIG_MODE)


def join_in_root(root: str, path: str) -> str:
    """A CRI path (log path, file in a rootfs) joined under `root`, never escaping it."""
    return secure_join(root, path)
