"""Containers as OCI bundles run by runc: the runtime's side of podgate.oci.

A container whose spec carries a root (`rootfs`: lower directories) gets a bundle in its run
directory: `rootfs/` (an overlay of the lowers and the bundle's own `upper/` and `work/`) and
`config.json` built from the CRI config, the image config and the pod. The shim runs
`runc create/start` on it; exec goes through `runc exec --process FILE`, so an exec'd process
keeps the container's root, user, capabilities, cgroup and seccomp, and environment values
stay out of every argv.

Pods get their files here too: `/etc/hostname`, `/etc/hosts`, `/etc/resolv.conf` and a
`/dev/shm` tmpfs shared by the pod's containers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import shutil
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from podgate.files import atomic_write
from podgate.linux import ns
from podgate.model import ContainerRecord, NamespaceMode, PodRecord
from podgate.oci import adjust as adjust_mod
from podgate.oci import bundle as bundle_mod
from podgate.oci import cgroups, overlay, seccomp, spec, users
from podgate.oci.runc import DEFAULT_RUNTIME, Runc, RuncError
from podgate.runtime.sandbox import lifecycle as sandbox

log = logging.getLogger(__name__)

__all__ = ["OciContainers", "OciError", "discard", "node_hostname", "resolv_conf"]

# The pod's /dev/shm: containerd's size and mode.
SHM_OPTIONS: Final = "mode=1777,size=67108864"
HOST_HOSTS: Final = "/etc/hosts"
HOST_RESOLV: Final = "/etc/resolv.conf"
# Pod files are world-readable (containers run as any user).
POD_FILE_MODE: Final = 0o644


def pod_limits(overhead: Mapping[str, Any], resources: Mapping[str, Any]) -> cgroups.Limits:
    """A pod cgroup's limits from its CRI resources and overhead (absent = 0): memory and CPU
    quota add up (unlimited when the containers' is), the quota over the containers' period."""
    memory = int(resources.get("memory_limit_in_bytes") or 0)
    quota = int(resources.get("cpu_quota") or 0)
    period = int(resources.get("cpu_period") or cgroups.DEFAULT_CPU_PERIOD_US)
    shares = int(resources.get("cpu_shares") or 0) + int(overhead.get("cpu_shares") or 0)
    return cgroups.Limits(
        memory=memory + int(overhead.get("memory_limit_in_bytes") or 0) if memory else 0,
        cpu_quota=quota + int(overhead.get("cpu_quota") or 0) if quota > 0 else 0,
        cpu_period=period,
        cpu_shares=shares,
    )


class OciError(Exception):
    """A container could not be set up; the message says why (containerd's words)."""


def node_hostname() -> str:
    return socket.gethostname()


def resolv_conf(dns: dict[str, list[str]] | None, host_text: str) -> str:
    """The pod's resolv.conf: from its DNS config, else the node's file."""
    if dns is None:
        return host_text
    lines = []
    if dns.get("searches"):
        lines.append("search " + " ".join(dns["searches"]))
    lines += [f"nameserver {server}" for server in dns.get("servers", [])]
    if dns.get("options"):
        lines.append("options " + " ".join(dns["options"]))
    return "".join(f"{line}\n" for line in lines)


def _read_or_empty(path: str) -> str:
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        return ""


def _write_file(path: Path, text: str) -> None:
    atomic_write(path, text.encode(), mode=POD_FILE_MODE)


class OciContainers:
    def __init__(self, state_dir: Path, binary: str = DEFAULT_RUNTIME) -> None:
        self.binary = shutil.which(binary) or binary
        self.root = state_dir / "runc"
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._host: spec.HostInfo | None = None

    @property
    def host(self) -> spec.HostInfo:
        if self._host is None:
            self._host = bundle_mod.host_info()
        return self._host

    # ------------------------------------------------------------------ pods

    @staticmethod
    def pod_files(pod: PodRecord, run: Path) -> None:
        """Write the pod's hostname, hosts and resolv.conf; mount its /dev/shm."""
        _write_file(run / "hostname", f"{pod.hostname}\n")
        _write_file(
            run / "hosts", Path(HOST_HOSTS).read_text() if Path(HOST_HOSTS).exists() else ""
        )
        host_resolv = Path(HOST_RESOLV).read_text() if Path(HOST_RESOLV).exists() else ""
        _write_file(run / "resolv.conf", resolv_conf(pod.dns, host_resolv))
        if pod.ipc_mode is not NamespaceMode.NODE:
            shm = run / "shm"
            shm.mkdir(exist_ok=True)
            if not overlay.is_mounted(str(shm)):
                ns.mount(
                    "shm",
                    str(shm),
                    "tmpfs",
                    ns.MS_NOSUID | ns.MS_NODEV | ns.MS_NOEXEC,
                    SHM_OPTIONS,
                )

    @staticmethod
    def release_pod(pod: PodRecord, run: Path) -> None:
        """Unmount the pod's /dev/shm (at stop, as containerd)."""
        overlay.unmount(str(run / "shm"))

    @staticmethod
    def cgroup_parent(pod: PodRecord) -> str:
        """The pod's cgroup: CRI's cgroup_parent, else one of podgate's own per pod."""
        return pod.cgroup_parent or f"{spec.DEFAULT_CGROUP_PARENT}/{pod.id}"

    def remove_pod_cgroup(self, pod: PodRecord) -> None:
        if not pod.cgroup_parent:  # a parent the caller named is the caller's to remove
            cgroups.remove(self.cgroup_parent(pod))

    def limit_pod_cgroup(
        self, pod: PodRecord, overhead: Mapping[str, Any], resources: Mapping[str, Any]
    ) -> bool:
        """Pod-level resources onto the pod's cgroup when podgate owns it (no cgroup_parent):
        the containers' sum plus the overhead, as the kubelet sizes the pod cgroups it owns. A
        parent the caller named is the caller's to size (the kubelet has done so before
        UpdatePodSandboxResources). Returns whether a cgroup was changed; OSError when the
        kernel refuses a value."""
        if pod.cgroup_parent:
            return False
        cgroups.set_limits(self.cgroup_parent(pod), pod_limits(overhead, resources))
        return True

    # ------------------------------------------------------------------ containers

    def runc(self, container_id: str, run: Path) -> Runc:
        return Runc(self.binary, str(self.root), str(run / "runc.log"))

    @staticmethod
    def bundle_dir(run: Path) -> Path:
        return run / "bundle"

    def create(
        self,
        pod: PodRecord,
        container: ContainerRecord,
        pod_run: Path,
        run: Path,
        adjustment: dict[str, Any] | None = None,
    ) -> None:
        """Mount the root, resolve the user and write config.json; OciError on bad input.
        `adjustment` (NRI's, podgate.oci.adjust) is applied to the spec before it is written."""
        cspec = container.spec
        bundle = self.bundle_dir(run)
        rootfs = bundle / "rootfs"
        bundle.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            overlay.mount_overlay(
                cspec.rootfs, str(bundle / "upper"), str(bundle / "work"), str(rootfs)
            )
        except OSError as exc:
            raise OciError(f"failed to mount the container's root: {exc}") from exc
        try:
            self._write_config(pod, container, pod_run, bundle, rootfs, adjustment or {})
        except BaseException:
            self.remove(container, run)
            raise

    def _write_config(
        self,
        pod: PodRecord,
        container: ContainerRecord,
        pod_run: Path,
        bundle: Path,
        rootfs: Path,
        adjustment: dict[str, Any],
    ) -> None:
        cspec = container.spec
        image = spec.ImageConfig.from_json(cspec.image_config)
        try:
            user = users.user_string(
                cspec.run_as_username, cspec.run_as_user, cspec.run_as_group, image.user
            )
            identity = bundle_mod.resolve_identity(
                str(rootfs), user, cspec.supplemental_groups, cspec.supplemental_groups_strict
            )
            kind, ref = seccomp.select_profile(cspec.seccomp, cspec.seccomp_ref)
            localhost = (
                bundle_mod.load_localhost_seccomp(ref)
                if kind == seccomp.LOCALHOST and not cspec.privileged
                else None
            )
            host = self.host
            if cspec.privileged:
                host = bundle_mod.host_info(privileged_devices=True)
            mounts = bundle_mod.prepare_mount_sources(cspec.mounts)
            devices = bundle_mod.resolve_devices(cspec.devices)
        except (users.UserError, seccomp.SeccompError, OSError) as exc:
            raise OciError(str(exc)) from exc
        shared_pid = pod.pid_mode is NamespaceMode.POD
        env = spec.PodEnv(
            id=pod.id,
            name=pod.metadata.name,
            namespace=pod.metadata.namespace,
            uid=pod.metadata.uid,
            hostname=pod.hostname,
            # A sandboxed pod's containers join the guest's namespaces (the pod holder's
            # are the host side of the sandbox).
            ns_pid=sandbox.container_ns_pid(pod) if pod.ns_process else None,
            pid_mode=pod.pid_mode
            if pod.pid_mode is NamespaceMode.NODE
            else (NamespaceMode.POD if shared_pid else NamespaceMode.CONTAINER),
            host_network=pod.network_mode is NamespaceMode.NODE,
            host_ipc=pod.ipc_mode is NamespaceMode.NODE,
            privileged=pod.privileged,
            cgroup_parent=self.cgroup_parent(pod),
            hostname_file=str(pod_run / "hostname"),
            hosts_file=str(pod_run / "hosts"),
            resolv_file=str(pod_run / "resolv.conf"),
            shm_dir=str(pod_run / "shm") if pod.ipc_mode is not NamespaceMode.NODE else "",
        )
        with_mounts = dataclasses.replace(cspec, mounts=mounts)
        try:
            config = spec.build_spec(
                container.id,
                with_mounts,
                image,
                env,
                identity,
                host,
                localhost_seccomp=localhost,
                devices=devices,
                annotations={"io.kubernetes.cri.container-name": container.metadata.name},
            )
        except spec.SpecError as exc:
            raise OciError(str(exc)) from exc
        try:  # where containerd applies NRI's adjustment: spec built, bundle not yet written
            adjust_mod.apply(config, adjustment, swap=host.swap_controller)
        except adjust_mod.AdjustError as exc:
            raise OciError(f"NRI adjustment: {exc}") from exc
        bundle_mod.write_json(str(bundle / "config.json"), config)

    def shim_config(self, container: ContainerRecord, run: Path) -> dict[str, str]:
        """What the shim needs to run the bundle."""
        config = _read_config(self.bundle_dir(run))
        return {
            "binary": self.binary,
            "root": str(self.root),
            "log": str(run / "runc.log"),
            "bundle": str(self.bundle_dir(run)),
            "cgroup": str(config["linux"]["cgroupsPath"]),
        }

    def cgroup(self, run: Path) -> str:
        try:
            return str(_read_config(self.bundle_dir(run))["linux"]["cgroupsPath"])
        except (OSError, KeyError, ValueError):
            return ""

    def user(self, run: Path) -> dict[str, Any] | None:
        """The identity config.json gives the container's process."""
        try:
            user: dict[str, Any] = _read_config(self.bundle_dir(run))["process"]["user"]
        except (OSError, KeyError, ValueError):
            return None
        return user

    async def update(
        self, container: ContainerRecord, run: Path, resources: dict[str, Any], running: bool
    ) -> None:
        """New limits into config.json, and into the live cgroup (`runc update`) if running."""
        bundle = self.bundle_dir(run)
        config = _read_config(bundle)
        updated = dataclasses.replace(container.spec, resources=resources)
        new = spec.linux_resources(updated, self.host)
        new["devices"] = config["linux"]["resources"].get("devices", [])
        config["linux"]["resources"] = new
        config["process"]["oomScoreAdj"] = int(resources.get("oom_score_adj") or 0)
        bundle_mod.write_json(str(bundle / "config.json"), config)
        if running:
            path = run / "resources.json"
            bundle_mod.write_json(str(path), {k: v for k, v in new.items() if k != "devices"})
            try:
                await self.runc(container.id, run).update(container.id, str(path))
            except RuncError as exc:
                raise OciError(f"failed to update resources: {exc}") from exc

    async def update_resources(
        self,
        container: ContainerRecord,
        run: Path,
        resources: dict[str, Any],
        running: bool,
        oom_score_adj: int | None = None,
    ) -> None:
        """A partial OCI `linux.resources` (an NRI update) merged into config.json, and the
        result into the live cgroup (`runc update`) if running. `oom_score_adj` (the CRI's)
        goes to config.json only, as in `update`."""
        bundle = self.bundle_dir(run)
        config = _read_config(bundle)
        current = config["linux"].setdefault("resources", {})
        adjust_mod.merge_resources(current, resources, swap=self.host.swap_controller)
        if oom_score_adj is not None:
            config["process"]["oomScoreAdj"] = oom_score_adj
        bundle_mod.write_json(str(bundle / "config.json"), config)
        if running:
            path = run / "resources.json"
            bundle_mod.write_json(
                str(path),
                {k: v for k, v in current.items() if k not in ("devices", "hugepageLimits")},
            )
            try:
                await self.runc(container.id, run).update(container.id, str(path))
            except RuncError as exc:
                raise OciError(f"failed to update resources: {exc}") from exc

    def remove(self, container: ContainerRecord, run: Path) -> None:
        """Kill what is left (runc delete --force), unmount the root, drop the bundle."""
        runc = self.runc(container.id, run)
        try:
            runc.run_sync(["delete", "--force", container.id])
        except RuncError as exc:
            if "does not exist" not in str(exc) and "not exist" not in str(exc):
                log.warning("container %s: runc delete: %s", container.id[:12], exc)
        bundle = self.bundle_dir(run)
        overlay.unmount(str(bundle / "rootfs"))
        shutil.rmtree(bundle, ignore_errors=True)

    def exec_process_file(
        self, container: ContainerRecord, run: Path, command: Sequence[str], tty: bool
    ) -> str:
        """A process file for `runc exec --process` (owner-only, in the container's run dir)."""
        base = _read_config(self.bundle_dir(run))["process"]
        path = run / f"exec-{secrets.token_hex(8)}.json"
        bundle_mod.write_json(str(path), spec.exec_process(base, command, tty))
        return str(path)

    def exec_argv(
        self, container: ContainerRecord, run: Path, command: Sequence[str], tty: bool
    ) -> tuple[list[str], str]:
        """(argv, process file to remove afterwards). Without a tty runc runs detached under
        podgate.linux.execwait, which reaps the process: the answer never waits for children
        that keep the output pipes open."""
        process_file = self.exec_process_file(container, run, command, tty)
        runc = self.runc(container.id, run)
        if tty:
            return runc.exec_argv(container.id, process_file), process_file
        pid_file = f"{process_file}.pid"
        argv = runc.exec_argv(container.id, process_file, detach_pid_file=pid_file)
        helper = [sys.executable, "-m", "podgate.linux.execwait", pid_file, f"{process_file}.error"]
        return [*helper, "--", *argv], process_file


def _read_config(bundle: Path) -> dict[str, Any]:
    with open(bundle / "config.json", encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def discard(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
