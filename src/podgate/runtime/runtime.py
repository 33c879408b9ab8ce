"""Pods and containers in Linux namespaces: the runtime behind the CRI service.

A pod's network, UTS and IPC namespaces are pinned by bind mounts in its run directory
(podgate.linux.nspin), with no process; a pod that shares a PID namespace needs a PID 1 for
it, a small holder process that owns all of them. Each container runs under its own shim, which
keeps its stdio, writes its CRI log and records its exit code; shims are forked from a warm
interpreter (podgate.linux.forker). Neither is a child that dies with the daemon: a restarted
daemon reads its records and finds them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from podgate import __version__
from podgate.images.store import ImageStore
from podgate.linux import holder as holder_mod
from podgate.linux import nspin
from podgate.linux import shim as shim_mod
from podgate.linux.forker import Forker
from podgate.linux.netdev import read_net_dev_at
from podgate.linux.proc import is_alive, read_json, signal_process
from podgate.model import (
    ContainerMetadata,
    ContainerRecord,
    ContainerSpec,
    ContainerState,
    NamespaceMode,
    PodRecord,
    PodState,
)
from podgate.nri.convert import nri_resources
from podgate.oci import cgroups, overlay
from podgate.oci.bundle import write_json as write_private_json
from podgate.oci.securejoin import secure_join
from podgate.oci.spec import SpecError, pod_sysctls
from podgate.proto import remotecommand as rc
from podgate.proto.upgrade import StreamKind
from podgate.runtime.api import (
    ContainerUsage,
    DeadlineExceededError,
    ExecSyncResult,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PodConfig,
    PodUsage,
    ResourceExhaustedError,
    RuntimeCondition,
)
from podgate.runtime.events import ContainerEvent, ContainerEvents, ContainerEventType
from podgate.runtime.nri import RuntimeNri
from podgate.runtime.oci import OciContainers, OciError, discard, node_hostname
from podgate.runtime.sandbox import lifecycle as sandbox
from podgate.runtime.store import Store
from podgate.runtime.streaming import PendingStream, StreamingServer
from podgate.streaming.pipeout import PipeOutput, spawn_with_outputs
from podgate.streaming.target import PodRef
from podgate.streaming.tokens import TooManyRequestsError

log = logging.getLogger(__name__)

# ExecSync output kept per stream; more is dropped (as the kubelet's exec probes expect).
EXEC_SYNC_MAX_OUTPUT = 16 * 1024 * 1024
# How long ExecSync keeps reading output after the command exited (a background child may hold
# the pipes open forever), seconds.
EXEC_SYNC_DRAIN_SECONDS = 0.5
# How long an exec helper gets to kill its process after SIGTERM, seconds.
EXEC_KILL_GRACE_SECONDS = 2.0
# How long a shim may take to reopen a container's log file, seconds.
REOPEN_LOG_SECONDS = 5.0
# Grace given to containers still running when their pod is stopped.
POD_STOP_GRACE_SECONDS = 2.0
# How long a stopped process may take to disappear after SIGKILL.
KILL_WAIT_SECONDS = 10.0
# The interface a pod's network stats name as its default (containerd's and the CNI's eth0).
DEFAULT_INTERFACE = "eth0"
NSENTER = "/usr/bin/nsenter"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ExecStartError(Exception):
    """An exec'd command never ran (the OCI runtime or nsenter failed); INTERNAL for CRI."""


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _shim_pid_mode(pod_mode: NamespaceMode, container_mode: NamespaceMode) -> NamespaceMode:
    """A pod's shared PID namespace wins; without one, POD means the container's own (as in
    the OCI spec's namespaces), since no pod PID namespace exists to join."""
    if pod_mode is NamespaceMode.POD:
        return NamespaceMode.POD
    return NamespaceMode.CONTAINER if container_mode is NamespaceMode.POD else container_mode


def now_ns() -> int:
    return time.time_ns()


class Runtime:
    """Implements podgate.runtime.api.RuntimeApi."""

    name = "podgate"
    version = __version__

    def __init__(self, state_dir: str | Path, oci_runtime: str = "runc") -> None:
        self.store = Store(state_dir)
        self.oci = OciContainers(self.store.root, oci_runtime)
        self.pods: dict[str, PodRecord] = {}
        self.containers: dict[str, ContainerRecord] = {}
        self.streaming: StreamingServer | None = None
        self.pod_cidr = ""
        self.nri: RuntimeNri | None = None  # NRI events (and pod networking) when enabled
        # Where containers' images come from (`image.image` by name, digest or ID); None:
        # only absolute paths (a root directory on the node) and image-less containers.
        self.images: ImageStore | None = None
        self._locks: dict[str, asyncio.Lock] = {}
        # The last CPU reading per container and pod: (ns since the epoch, CPU ns), for
        # nano-cores.
        self._cpu_samples: dict[str, tuple[int, int]] = {}
        # Lifecycle events for GetContainerEvents; its poll turns unseen exits into events.
        self.events = ContainerEvents(poll=self._refresh_all)
        # Shims and holders are forked from a warm interpreter living as long as this daemon.
        # Sandbox shims (asyncio, ttrpc, the agent) from its second stage, started with the
        # first sandboxed pod: their imports stay out of the pages every container shim maps.
        self.forker = Forker(str(self.store.run_dir / "forker.log"), sandbox.FORKER_MODULES)

    def close(self) -> None:
        """Stop the daemon's helpers (pods and their shims keep running)."""
        self.forker.close()

    # ------------------------------------------------------------------ startup
    def load(self) -> None:
        """Read records and bring states up to date with what really runs."""
        pods, containers = self.store.load()
        self.pods = {p.id: p for p in pods}
        self.containers = {c.id: c for c in containers}
        for pod in self.pods.values():
            self._refresh_pod(pod)
        for container in self.containers.values():
            self._refresh_container(container)
        log.info("loaded %d pods and %d containers", len(self.pods), len(self.containers))

    def _lock(self, object_id: str) -> asyncio.Lock:
        lock = self._locks.get(object_id)
        if lock is None:
            lock = self._locks[object_id] = asyncio.Lock()
        return lock

    # ------------------------------------------------------------------ lookups
    def _find(self, table: Mapping[str, object], object_id: str, kind: str) -> str:
        if not object_id:
            raise InvalidArgumentError(f"{kind} id is empty")
        if object_id in table:
            return object_id
        matches = [k for k in table if k.startswith(object_id)]
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise InvalidArgumentError(f"{kind} id prefix {object_id!r} is ambiguous")
        raise NotFoundError(f"{kind} {object_id!r} not found")

    def get_pod(self, pod_id: str) -> PodRecord:
        pod = self.pods[self._find(self.pods, pod_id, "pod sandbox")]
        self._refresh_pod(pod)
        return pod

    def list_pods(self) -> list[PodRecord]:
        for pod in self.pods.values():
            self._refresh_pod(pod)
        return sorted(self.pods.values(), key=lambda p: p.created_at)

    def get_container(self, container_id: str) -> ContainerRecord:
        container = self.containers[self._find(self.containers, container_id, "container")]
        self._refresh_container(container)
        return container

    def list_containers(self) -> list[ContainerRecord]:
        for container in self.containers.values():
            self._refresh_container(container)
        return sorted(self.containers.values(), key=lambda c: c.created_at)

    def pod_containers(self, pod_id: str) -> list[ContainerRecord]:
        return [c for c in self.list_containers() if c.pod_id == pod_id]

    # ------------------------------------------------------------------ state refresh
    def _refresh_pod(self, pod: PodRecord) -> None:
        if pod.state is PodState.READY and not self._namespaces_alive(pod):
            log.info(
                "pod %s: its namespaces are gone; marking it not ready",
                pod.id[:12],
                extra={"pod_id": pod.id},
            )
            pod.state = PodState.NOTREADY
            self.store.save_pod(pod)
            self._emit(pod.id, ContainerEventType.STOPPED, pod.id)

    def _refresh_all(self) -> None:
        self.list_pods()
        self.list_containers()

    def _emit(self, container_id: str, kind: ContainerEventType, pod_id: str) -> None:
        """Publish an event with the pod's and its containers' state as of now."""
        if not len(self.events):
            return
        pod = self.pods.get(pod_id)
        containers = tuple(
            copy.copy(c)
            for c in sorted(self.containers.values(), key=lambda c: c.created_at)
            if c.pod_id == pod_id
        )
        self.events.publish(
            ContainerEvent(
                container_id=container_id,
                type=kind,
                created_at=now_ns(),
                pod=copy.copy(pod) if pod is not None else None,
                containers=containers,
            )
        )

    @staticmethod
    def _namespaces_alive(pod: PodRecord) -> bool:
        if pod.ns_files:
            return all(nspin.is_pinned(path) for path in pod.ns_files.values())
        return (
            pod.holder is not None
            and is_alive(pod.holder)
            and (pod.ns_process is None or is_alive(pod.ns_process))
        )

    def _refresh_container(self, container: ContainerRecord) -> None:
        if container.state is not ContainerState.RUNNING:
            return
        exit_file = self.store.run_path(container.id) / "exit.json"
        if exit_file.exists():
            data = read_json(str(exit_file))
            container.state = ContainerState.EXITED
            container.exit_code = int(data["exit_code"])
            container.finished_at = int(data.get("finished_at") or now_ns())
            container.reason = str(
                data.get("reason") or ("Completed" if container.exit_code == 0 else "Error")
            )
            self.store.save_container(container)
            self._emit(container.id, ContainerEventType.STOPPED, container.pod_id)
        elif (
            container.shim is not None
            and not is_alive(container.shim)
            and (container.process is None or not is_alive(container.process))
        ):
            # The shim died without recording an exit: the code is not known.
            container.state = ContainerState.EXITED
            container.exit_code = 255
            container.finished_at = now_ns()
            container.reason = "Unknown"
            container.message = "container shim exited without recording an exit code"
            self.store.save_container(container)
            self._emit(container.id, ContainerEventType.STOPPED, container.pod_id)

    # ------------------------------------------------------------------ pods
    async def run_pod(self, config: PodConfig) -> str:
        meta = config.metadata
        if not meta.name or not meta.namespace:
            raise InvalidArgumentError("pod metadata needs a name and a namespace")
        for pod in self.pods.values():
            m = pod.metadata
            if (m.name, m.namespace, m.uid, m.attempt) == (
                meta.name,
                meta.namespace,
                meta.uid,
                meta.attempt,
            ) and pod.state is PodState.READY:
                raise FailedPreconditionError(
                    f"pod sandbox {meta.namespace}/{meta.name} (attempt {meta.attempt}) "
                    f"is already running as {pod.id}"
                )
        pod_id = secrets.token_hex(32)
        log_dir = config.log_directory or str(
            self.store.logs_dir / f"{meta.namespace}_{meta.name}_{meta.uid or pod_id[:12]}"
        )
        pod = PodRecord(
            id=pod_id,
            metadata=meta,
            state=PodState.NOTREADY,
            created_at=now_ns(),
            # containerd: the config's hostname, else the node's; never the pod's name.
            hostname=config.hostname or node_hostname(),
            log_directory=log_dir,
            runtime_handler=config.runtime_handler,
            labels=dict(config.labels),
            annotations=dict(config.annotations),
            pid_mode=config.pid_mode,
            network_mode=config.network_mode,
            ipc_mode=config.ipc_mode,
            cgroup_parent=config.cgroup_parent,
            privileged=config.privileged,
            dns=config.dns,
            sysctls=dict(config.sysctls),
            overhead=dict(config.overhead),
            resources=dict(config.resources),
        )
        try:
            sysctls = pod_sysctls(
                config.sysctls,
                host_network=pod.network_mode is NamespaceMode.NODE,
                host_ipc=pod.ipc_mode is NamespaceMode.NODE,
            )
        except SpecError as exc:
            raise InvalidArgumentError(str(exc)) from exc
        run = self.store.run_path(pod_id)
        async with self._lock(pod_id):
            try:
                await self._pod_namespaces(pod, run, sysctls)
                try:
                    self.oci.pod_files(pod, run)
                except OSError as exc:
                    raise FailedPreconditionError(
                        f"failed to set up the pod's files: {exc}"
                    ) from exc
                # Sandboxed pods: the shim, which starts the guest and the agent.
                await sandbox.start_for_pod(pod, run, self.forker.spawn)
                if self.nri is not None:
                    try:
                        await self.nri.pod_started(pod)  # network plugins configure the netns
                    except Exception as exc:
                        raise FailedPreconditionError(f"NRI RunPodSandbox failed: {exc}") from exc
            except BaseException:
                # Nothing of a pod that did not start stays behind: processes, run directory.
                await asyncio.shield(self._undo_pod_start(pod))
                raise
            pod.state = PodState.READY
            self.store.ensure_dir(log_dir)
            self.pods[pod_id] = pod
            self.store.save_pod(pod)
            # containerd sends both for a sandbox, with the sandbox's ID as the container's.
            self._emit(pod_id, ContainerEventType.CREATED, pod_id)
            self._emit(pod_id, ContainerEventType.STARTED, pod_id)
        log.info(
            "pod %s/%s running as %s",
            meta.namespace,
            meta.name,
            pod_id[:12],
            extra={"pod": f"{meta.namespace}/{meta.name}", "pod_id": pod_id},
        )
        return pod_id

    async def _pod_namespaces(self, pod: PodRecord, run: Path, sysctls: dict[str, str]) -> None:
        """The pod's net, IPC and UTS namespaces: pinned by bind mounts, no process; a pod
        that shares a PID namespace needs a process as its PID 1, the holder, which holds
        them all."""
        if pod.pid_mode is not NamespaceMode.POD:
            try:
                pod.ns_files = await asyncio.to_thread(
                    nspin.pin, str(run / "ns"), pod.hostname, sysctls
                )
            except OSError as exc:
                raise holder_mod.HolderError(f"pod namespaces setup failed: {exc}") from exc
            return
        pod.holder, pod.ns_process = await holder_mod.start_holder(
            hostname=pod.hostname,
            pid_ns=True,
            ready_file=str(run / "holder.json"),
            log_file=str(run / "holder.log"),
            sysctls=sysctls,
            empty_root="" if sandbox.is_sandboxed(pod) else str(run / "holder-root"),
            spawn=self.forker.spawn,
        )

    async def _release_pod_namespaces(self, pod: PodRecord) -> None:
        if pod.holder is not None:
            await holder_mod.stop_holder(pod.holder)
        if pod.ns_files:
            await asyncio.to_thread(nspin.unpin, pod.ns_files)

    async def _undo_pod_start(self, pod: PodRecord) -> None:
        try:
            await sandbox.stop_for_pod(pod)
            await self._release_pod_namespaces(pod)
        finally:
            try:
                # The pod's files may be made by now: its /dev/shm mount goes with them.
                self.oci.release_pod(pod, self.store.run_path(pod.id))
            finally:
                self.store.remove_run_path(pod.id)

    async def stop_pod(self, pod_id: str) -> None:
        try:
            pod = self.get_pod(pod_id)
        except NotFoundError:
            return
        async with self._lock(pod.id):
            for container in self.pod_containers(pod.id):
                await self._stop_container(container, POD_STOP_GRACE_SECONDS)
            if self.nri is not None and pod.state is PodState.READY:
                await self.nri.pod_stopping(pod)  # namespaces still exist: plugins tear down
            await sandbox.stop_for_pod(pod)  # sandboxed pods: the shim and the guest
            await self._release_pod_namespaces(pod)
            self.oci.release_pod(pod, self.store.run_path(pod.id))
            was_ready = pod.state is PodState.READY
            pod.state = PodState.NOTREADY
            self.store.save_pod(pod)
            if was_ready:
                self._emit(pod.id, ContainerEventType.STOPPED, pod.id)

    async def remove_pod(self, pod_id: str) -> None:
        try:
            pod = self.get_pod(pod_id)
        except NotFoundError:
            return
        await self.stop_pod(pod.id)
        for container in self.pod_containers(pod.id):
            await self.remove_container(container.id)
        if self.nri is not None:
            await self.nri.pod_removed(pod)
        self.pods.pop(pod.id, None)
        self._cpu_samples.pop(pod.id, None)
        self.store.delete_pod(pod.id)
        self._emit(pod.id, ContainerEventType.DELETED, pod.id)
        self.oci.remove_pod_cgroup(pod)
        self.store.remove_run_path(pod.id)

    async def pod_network(self, pod: PodRecord) -> tuple[str, list[str]]:
        if self.nri is None:
            return pod.ip, list(pod.additional_ips)
        try:
            return await self.nri.pod_ips(pod)
        except Exception as exc:
            raise FailedPreconditionError(f"NRI PodSandboxStatus failed: {exc}") from exc

    def pod_netns_path(self, pod: PodRecord) -> str:
        path = pod.ns_path("net")
        if pod.state is not PodState.READY or path is None:
            raise FailedPreconditionError(f"pod sandbox {pod.id} is not ready")
        return path

    # ------------------------------------------------------------------ containers
    async def create_container(
        self,
        pod_id: str,
        metadata: ContainerMetadata,
        spec: ContainerSpec,
        labels: Mapping[str, str],
        annotations: Mapping[str, str],
    ) -> str:
        pod = self.get_pod(pod_id)
        if pod.state is not PodState.READY:
            raise FailedPreconditionError(f"pod sandbox {pod.id} is not ready")
        if not metadata.name:
            raise InvalidArgumentError("container metadata needs a name")
        from_store = bool(spec.image) and not spec.rootfs and self.images is not None
        if not from_store and not spec.rootfs and not spec.command and not spec.args:
            raise InvalidArgumentError("container needs a command")
        if spec.run_as_username and not (spec.rootfs or from_store):
            raise InvalidArgumentError("run_as_username needs a container root (an image)")
        if spec.tty and not spec.stdin and spec.stdin_once:
            raise InvalidArgumentError("stdin_once needs stdin")
        for other in self.pod_containers(pod.id):
            if (other.metadata.name, other.metadata.attempt) == (metadata.name, metadata.attempt):
                raise FailedPreconditionError(
                    f"container {metadata.name!r} (attempt {metadata.attempt}) already exists "
                    f"in pod {pod.id}: {other.id}"
                )
        container_id = secrets.token_hex(32)
        if from_store:
            spec = await self._image_root(spec, container_id)
        try:
            return await self._create_container(
                pod, container_id, metadata, spec, labels, annotations
            )
        except BaseException:
            if from_store:
                await asyncio.shield(self._release_image(container_id))
            raise

    async def _image_root(self, spec: ContainerSpec, container_id: str) -> ContainerSpec:
        """The container's root from the image store: the image's snapshots, held for the
        container (a lease named by its ID) until it is removed, and the image's config."""
        assert self.images is not None
        try:
            found = await asyncio.to_thread(self.images.acquire, spec.image, container_id)
        except FileNotFoundError as exc:  # a snapshot of the image is missing
            raise NotFoundError(f'failed to resolve image "{spec.image}": {exc}') from exc
        if found is None:
            raise NotFoundError(f'failed to resolve image "{spec.image}": not found')
        rec, lowers = found
        return dataclasses.replace(
            spec,
            rootfs=[str(d) for d in lowers],
            image_config=dict(rec.spec.get("config") or {}),
            image_id=rec.id,
            image_ref=rec.repo_digests[0] if rec.repo_digests else rec.id,
            image_name=rec.repo_tags[0] if rec.repo_tags else spec.image,
        )

    async def _release_image(self, container_id: str) -> None:
        if self.images is not None:
            await asyncio.to_thread(self.images.release, container_id)

    async def _create_container(
        self,
        pod: PodRecord,
        container_id: str,
        metadata: ContainerMetadata,
        spec: ContainerSpec,
        labels: Mapping[str, str],
        annotations: Mapping[str, str],
    ) -> str:
        log_file = ""
        if spec.log_path:
            log_file = secure_join(pod.log_directory, spec.log_path)
        elif pod.log_directory:
            log_file = str(Path(pod.log_directory) / metadata.name / f"{metadata.attempt}.log")
        container = ContainerRecord(
            id=container_id,
            pod_id=pod.id,
            metadata=metadata,
            spec=spec,
            state=ContainerState.CREATED,
            created_at=now_ns(),
            log_file=log_file,
            labels=dict(labels),
            annotations=dict(annotations),
        )
        adjustment: dict[str, Any] = {}
        if self.nri is not None:
            try:  # plugins' adjustments: the spec's, and the rest for config.json
                adjustment = await self.nri.container_creating(pod, container)
            except Exception as exc:
                raise FailedPreconditionError(f"NRI CreateContainer failed: {exc}") from exc
        if spec.rootfs:
            run = self.store.run_path(container_id)
            try:
                await asyncio.to_thread(
                    self.oci.create, pod, container, self.store.run_path(pod.id), run, adjustment
                )
            except OciError as exc:
                self.store.remove_run_path(container_id)
                raise InvalidArgumentError(f"failed to create container: {exc}") from exc
            container.user = self.oci.user(run)
        self.containers[container_id] = container
        self.store.save_container(container)
        self._emit(container_id, ContainerEventType.CREATED, pod.id)
        if self.nri is not None:
            await self.nri.container_created(pod, container)
        return container_id

    async def start_container(self, container_id: str) -> None:
        container = self.get_container(container_id)
        async with self._lock(container.id):
            if container.state is not ContainerState.CREATED:
                raise FailedPreconditionError(
                    f"container {container.id} is {container.state.value}, not created"
                )
            pod = self.get_pod(container.pod_id)
            if pod.state is not PodState.READY or not pod.has_namespaces:
                raise FailedPreconditionError(f"pod sandbox {pod.id} is not ready")
            if self.nri is not None:
                try:
                    await self.nri.container_starting(pod, container)
                except Exception as exc:
                    raise FailedPreconditionError(f"NRI StartContainer failed: {exc}") from exc
            run = self.store.run_path(container.id)
            spec = container.spec
            env = {"PATH": DEFAULT_PATH, "HOSTNAME": pod.hostname, **spec.envs}
            if spec.tty:
                env.setdefault("TERM", "xterm")
            if container.log_file:
                self.store.ensure_dir(str(Path(container.log_file).parent))
            shim_spec = shim_mod.ShimSpec(
                container_id=container.id,
                command=[*spec.command, *spec.args],
                env=env,
                working_dir=spec.working_dir,
                root_dir=spec.root_dir,
                uid=spec.run_as_user,
                gid=spec.run_as_group,
                tty=spec.tty,
                stdin=spec.stdin,
                stdin_once=spec.stdin_once,
                ns_paths=sandbox.container_ns_paths(pod),  # the guest's, for sandboxed pods
                pid_mode=_shim_pid_mode(pod.pid_mode, spec.pid_mode),
                log_file=container.log_file,
                exit_file=str(run / "exit.json"),
                attach_socket=str(run / "attach.sock"),
                mounts=[m for m in spec.mounts if m.get("host_path") and m.get("container_path")],
                ready_file=str(run / "ready.json"),
                shim_log=str(run / "shim.log"),
                oci=self.oci.shim_config(container, run) if spec.rootfs else {},
            )
            try:
                ready = await shim_mod.start_shim(shim_spec, spawn=self.forker.spawn)
            except shim_mod.ShimError as exc:
                container.state = ContainerState.EXITED
                container.exit_code = 128
                container.finished_at = container.started_at = now_ns()
                container.reason = "StartError"
                container.message = str(exc)
                self.store.save_container(container)
                self._emit(container.id, ContainerEventType.STOPPED, pod.id)
                raise FailedPreconditionError(f"failed to start container: {exc}") from exc
            container.shim = ready.shim
            container.process = ready.process
            container.started_at = now_ns()
            container.state = ContainerState.RUNNING
            self.store.save_container(container)
            self._emit(container.id, ContainerEventType.STARTED, pod.id)
        if self.nri is not None:
            await self.nri.container_started(pod, container)

    async def stop_container(self, container_id: str, timeout: float) -> None:
        container = self.get_container(container_id)
        async with self._lock(container.id):
            await self._stop_container(container, timeout)

    async def _stop_container(
        self, container: ContainerRecord, timeout: float, *, notify: bool = True
    ) -> None:
        self._refresh_container(container)
        if container.state is ContainerState.CREATED:
            container.state = ContainerState.EXITED
            container.finished_at = now_ns()
            container.reason = "Stopped"
            self.store.save_container(container)
            self._emit(container.id, ContainerEventType.STOPPED, container.pod_id)
            return
        if container.state is not ContainerState.RUNNING or container.process is None:
            return
        process = container.process
        stop_signal = _stop_signal(container.spec.image_config.get("StopSignal"))
        if signal_process(process, stop_signal) and not await self._wait_exit(container, timeout):
            signal_process(process, signal.SIGKILL)
        if not await self._wait_exit(container, KILL_WAIT_SECONDS):
            log.warning("container %s did not report its exit", container.id[:12])
        self._refresh_container(container)
        pod = self.pods.get(container.pod_id)
        if self.nri is not None and pod is not None and notify:
            await self.nri.container_stopped(pod, container)

    async def _wait_exit(self, container: ContainerRecord, timeout: float) -> bool:
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            self._refresh_container(container)
            if container.state is not ContainerState.RUNNING:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)

    async def remove_container(self, container_id: str) -> None:
        try:
            container = self.get_container(container_id)
        except NotFoundError:
            return
        async with self._lock(container.id):
            await self._stop_container(container, 0)
            self.containers.pop(container.id, None)
            self._cpu_samples.pop(container.id, None)
            self.store.delete_container(container.id)
            if container.spec.rootfs:
                await asyncio.to_thread(
                    self.oci.remove, container, self.store.run_path(container.id)
                )
            if container.spec.image_id:
                await self._release_image(container.id)
            # Log files are the caller's (the kubelet deletes them), as containerd leaves them.
            self.store.remove_run_path(container.id)
            self._emit(container.id, ContainerEventType.DELETED, container.pod_id)
        pod = self.pods.get(container.pod_id)
        if self.nri is not None and pod is not None:
            await self.nri.container_removed(pod, container)

    # ------------------------------------------------------------------ exec
    def running_container(self, container_id: str) -> ContainerRecord:
        container = self.get_container(container_id)
        if container.state is not ContainerState.RUNNING or container.process is None:
            raise FailedPreconditionError(
                f"container {container.id} is not running (state {container.state.value})"
            )
        return container

    def exec_argv(
        self, container: ContainerRecord, command: Sequence[str], *, tty: bool = False
    ) -> list[str]:
        """argv that runs `command` in the container: `runc exec --process FILE` for a container
        with a root (the file stays in the container's run directory until it is removed;
        exec_command cleans up after itself), else nsenter into every namespace of the main
        process with the container's environment, user and working directory."""
        return self.exec_command(container, command, tty=tty)[0]

    def exec_command(
        self, container: ContainerRecord, command: Sequence[str], *, tty: bool = False
    ) -> tuple[list[str], str]:
        """(argv, a file to remove once the command ended, or "")."""
        assert container.process is not None
        spec = container.spec
        if spec.rootfs:
            return self.oci.exec_argv(container, self.store.run_path(container.id), command, tty)
        argv = [
            NSENTER,
            "--target",
            str(container.process.pid),
            "--mount",
            "--uts",
            "--ipc",
            "--net",
            "--pid",
            "--root",
            "--wd",
        ]
        if spec.run_as_group is not None:
            argv += ["--setgid", str(spec.run_as_group)]
        if spec.run_as_user is not None:
            argv += ["--setuid", str(spec.run_as_user)]
        pod = self.pods.get(container.pod_id)
        env = {"PATH": DEFAULT_PATH, "HOSTNAME": pod.hostname if pod else "", **spec.envs}
        # The environment goes through a file (never an argv); nsexec closes our descriptors.
        spec_file = self.store.run_path(container.id) / f"exec-{secrets.token_hex(8)}.json"
        write_private_json(str(spec_file), {"argv": [*argv, "--", *command], "env": env})
        return [sys.executable, "-m", "podgate.linux.nsexec", str(spec_file)], str(spec_file)

    async def exec_sync(
        self, container_id: str, command: Sequence[str], timeout: float
    ) -> ExecSyncResult:
        container = self.running_container(container_id)
        if not command:
            raise InvalidArgumentError("exec needs a command")
        argv, cleanup = self.exec_command(container, command)
        try:
            result = await _run_exec_sync(argv, command, timeout)
            if cleanup:
                failure = await asyncio.to_thread(_read_text, f"{cleanup}.error")
                if failure is not None:
                    detail = result.stderr.decode("utf-8", "replace").strip()
                    raise ExecStartError(f"failed to exec in container: {detail or failure}")
            return result
        finally:
            if cleanup:
                discard(cleanup)
                discard(f"{cleanup}.error")

    # ------------------------------------------------------------------ resources, stats, logs
    async def container_usage(self, container: ContainerRecord) -> ContainerUsage:
        """CPU and memory from the container's cgroup, the writable layer from its upper
        directory. A container without a root has no cgroup of its own: zeros."""
        run = self.store.run_path(container.id)
        cgroup = self.oci.cgroup(run) if container.spec.rootfs else ""
        if not cgroup:
            return ContainerUsage(timestamp=now_ns(), writable_mountpoint=str(self.store.root))
        sample = await asyncio.to_thread(cgroups.stats, cgroup)
        upper = self.oci.bundle_dir(run) / "upper"
        used, inodes = await asyncio.to_thread(overlay.disk_usage, str(upper))
        limit = await asyncio.to_thread(cgroups.memory_limit, cgroup)
        nano_cores = self._nano_cores(container.id, sample)
        return ContainerUsage(
            timestamp=sample.timestamp,
            cpu_usage_ns=sample.cpu_usage_ns,
            cpu_nano_cores=nano_cores,
            memory_usage=sample.memory_usage,
            memory_working_set=sample.memory_working_set,
            memory_rss=sample.memory_rss,
            memory_available=max(limit - sample.memory_working_set, 0) if limit else None,
            page_faults=sample.page_faults,
            major_page_faults=sample.major_page_faults,
            writable_mountpoint=str(upper),
            writable_bytes=used,
            writable_inodes=inodes,
        )

    def _nano_cores(self, key: str, sample: cgroups.CgroupStats) -> int | None:
        """CPU use since the previous sample of `key`, in nano-cores (None the first time)."""
        previous = self._cpu_samples.get(key)
        self._cpu_samples[key] = (sample.timestamp, sample.cpu_usage_ns)
        if previous is None or sample.timestamp <= previous[0]:
            return None
        delta = max(sample.cpu_usage_ns - previous[1], 0)
        return delta * 1_000_000_000 // (sample.timestamp - previous[0])

    async def pod_usage(self, pod: PodRecord) -> PodUsage:
        """CPU, memory and processes from the pod's cgroup (its containers with a root are
        under it), the counters of its network namespace's interfaces, each container's usage.
        A pod that is not ready has no network namespace left: no interfaces."""
        sample = await asyncio.to_thread(cgroups.stats, self.oci.cgroup_parent(pod))
        limit = await asyncio.to_thread(cgroups.memory_limit, self.oci.cgroup_parent(pod))
        interfaces = []
        netns = pod.ns_path("net") if pod.state is PodState.READY else None
        if netns is not None and pod.network_mode is not NamespaceMode.NODE:
            interfaces = await asyncio.to_thread(read_net_dev_at, netns)
        default = next((i for i in interfaces if i.name == DEFAULT_INTERFACE), None) or next(
            (i for i in interfaces if i.name != "lo"), None
        )
        return PodUsage(
            timestamp=sample.timestamp,
            cpu_usage_ns=sample.cpu_usage_ns,
            cpu_nano_cores=self._nano_cores(pod.id, sample),
            memory_usage=sample.memory_usage,
            memory_working_set=sample.memory_working_set,
            memory_rss=sample.memory_rss,
            memory_available=max(limit - sample.memory_working_set, 0) if limit else None,
            page_faults=sample.page_faults,
            major_page_faults=sample.major_page_faults,
            processes=sample.pids,
            default_interface=default,
            interfaces=[i for i in interfaces if i is not default],
            containers=[(c, await self.container_usage(c)) for c in self.pod_containers(pod.id)],
        )

    async def update_container_resources(
        self, container_id: str, resources: Mapping[str, object]
    ) -> None:
        container = self.get_container(container_id)
        if not container.spec.rootfs:
            raise FailedPreconditionError(
                f"container {container.id} has no root of its own (no cgroup to update)"
            )
        merged = dict(container.spec.resources)
        merged.update({k: v for k, v in resources.items() if v})  # zero = unchanged
        if self.nri is not None:
            # UpdateContainer: plugins may change the request and ask for other updates, all
            # applied through apply_resources; then PostUpdateContainer.
            pod = self.get_pod(container.pod_id)
            try:
                await self.nri.container_updating(pod, container, nri_resources(merged))
            except Exception as exc:
                raise FailedPreconditionError(f"NRI UpdateContainer failed: {exc}") from exc
            async with self._lock(container.id):
                if "oom_score_adj" in resources:  # not NRI's: config.json only, as without NRI
                    await self.oci.update_resources(
                        container,
                        self.store.run_path(container.id),
                        {},
                        running=False,
                        oom_score_adj=int(merged.get("oom_score_adj") or 0),
                    )
                container.spec.resources = merged
                self.store.save_container(container)
            return
        async with self._lock(container.id):
            if container.state not in (ContainerState.CREATED, ContainerState.RUNNING):
                raise FailedPreconditionError(
                    f"container {container.id} is {container.state.value}"
                )
            try:
                await self.oci.update(
                    container,
                    self.store.run_path(container.id),
                    merged,
                    running=container.state is ContainerState.RUNNING,
                )
            except OciError as exc:
                raise FailedPreconditionError(str(exc)) from exc
            container.spec.resources = merged
            self.store.save_container(container)

    async def update_pod_resources(
        self, pod_id: str, overhead: Mapping[str, object], resources: Mapping[str, object]
    ) -> None:
        """containerd's order: NRI UpdatePodSandbox (the pod as it is, the new resources beside
        it; a plugin's error fails the call and changes nothing), then the change, then
        PostUpdatePodSandbox with the pod as it now is. The request is the whole pod-level
        state: what it leaves out is no longer set."""
        pod = self.get_pod(pod_id)
        new_overhead = {k: v for k, v in overhead.items() if v}
        new_resources = {k: v for k, v in resources.items() if v}
        if self.nri is not None:
            try:
                await self.nri.pod_updating(
                    pod,
                    nri_resources(new_overhead) if new_overhead else None,
                    nri_resources(new_resources) if new_resources else None,
                )
            except Exception as exc:
                raise FailedPreconditionError(f"NRI UpdatePodSandbox failed: {exc}") from exc
        async with self._lock(pod.id):
            # A sandboxed pod's containers run in its guest, not under this cgroup.
            if pod.state is PodState.READY and not sandbox.is_sandboxed(pod):
                try:
                    await asyncio.to_thread(
                        self.oci.limit_pod_cgroup, pod, new_overhead, new_resources
                    )
                except OSError as exc:
                    raise FailedPreconditionError(
                        f"failed to set the pod's cgroup limits: {exc}"
                    ) from exc
            pod.overhead, pod.resources = new_overhead, new_resources
            self.store.save_pod(pod)
        if self.nri is not None:
            await self.nri.pod_updated(pod)

    async def apply_resources(self, container_id: str, resources: dict[str, Any]) -> None:
        """An NRI container update: a partial OCI `linux.resources` into config.json and, for
        a running container, its cgroup (runtime.nri.ContainerUpdater)."""
        container = self.get_container(container_id)
        if not container.spec.rootfs:
            raise FailedPreconditionError(
                f"container {container.id} has no root of its own (no cgroup to update)"
            )
        if container.state not in (ContainerState.CREATED, ContainerState.RUNNING):
            raise FailedPreconditionError(f"container {container.id} is {container.state.value}")
        async with self._lock(container.id):
            try:
                await self.oci.update_resources(
                    container,
                    self.store.run_path(container.id),
                    resources,
                    running=container.state is ContainerState.RUNNING,
                )
            except OciError as exc:
                raise FailedPreconditionError(str(exc)) from exc

    async def evict_container(self, container_id: str, reason: str) -> None:
        """An NRI eviction: the container is stopped at once (SIGKILL after no grace)."""
        container = self.get_container(container_id)
        async with self._lock(container.id):
            await self._stop_container(container, 0, notify=False)
            container.reason = "Evicted"
            container.message = reason
            self.store.save_container(container)

    async def reopen_container_log(self, container_id: str) -> None:
        container = self.get_container(container_id)
        if container.state is not ContainerState.RUNNING or container.shim is None:
            raise FailedPreconditionError("container is not running")
        if not container.log_file:
            return
        if not signal_process(container.shim, signal.SIGUSR1):
            raise FailedPreconditionError("container is not running")
        deadline = time.monotonic() + REOPEN_LOG_SECONDS
        while not await asyncio.to_thread(os.path.exists, container.log_file):
            if time.monotonic() >= deadline:
                raise FailedPreconditionError(
                    f"the container's shim did not reopen {container.log_file}"
                )
            await asyncio.sleep(0.01)

    # ------------------------------------------------------------------ streaming URLs
    def pod_ref(self, pod: PodRecord) -> PodRef:
        return PodRef(pod.metadata.namespace, pod.metadata.name, pod.metadata.uid, pod.id)

    def _url(self, pending: PendingStream) -> str:
        if self.streaming is None:
            raise FailedPreconditionError("the streaming server is not running")
        try:
            return self.streaming.url_for(pending)
        except TooManyRequestsError as exc:
            raise ResourceExhaustedError(str(exc)) from exc

    def exec_url(
        self,
        container_id: str,
        command: Sequence[str],
        *,
        tty: bool,
        stdin: bool,
        stdout: bool,
        stderr: bool,
    ) -> str:
        return self._url(
            self.exec_request(
                container_id, command, tty=tty, stdin=stdin, stdout=stdout, stderr=stderr
            )
        )

    def exec_request(
        self,
        container_id: str,
        command: Sequence[str],
        *,
        tty: bool,
        stdin: bool,
        stdout: bool,
        stderr: bool,
    ) -> PendingStream:
        """The checked exec that CRI Exec hands a URL for (and an in-process gateway runs)."""
        container = self.running_container(container_id)
        _check_stdio(tty, stdin, stdout, stderr)
        if not command:
            raise InvalidArgumentError("exec needs a command")
        options = rc.ExecOptions(
            tuple(command), container.metadata.name, stdin, stdout, stderr, tty
        )
        pod = self.pods[container.pod_id]
        return PendingStream(StreamKind.EXEC, self.pod_ref(pod), container.id, options)

    def attach_url(
        self, container_id: str, *, tty: bool, stdin: bool, stdout: bool, stderr: bool
    ) -> str:
        return self._url(
            self.attach_request(container_id, tty=tty, stdin=stdin, stdout=stdout, stderr=stderr)
        )

    def attach_request(
        self, container_id: str, *, tty: bool, stdin: bool, stdout: bool, stderr: bool
    ) -> PendingStream:
        """The checked attach that CRI Attach hands a URL for."""
        container = self.running_container(container_id)
        _check_stdio(tty, stdin, stdout, stderr)
        if tty != container.spec.tty:
            raise InvalidArgumentError(
                f"tty {tty} does not match the container's tty {container.spec.tty}"
            )
        options = rc.ExecOptions((), container.metadata.name, stdin, stdout, stderr, tty)
        pod = self.pods[container.pod_id]
        return PendingStream(StreamKind.ATTACH, self.pod_ref(pod), container.id, options)

    def port_forward_url(self, pod_id: str, ports: Sequence[int]) -> str:
        return self._url(self.port_forward_request(pod_id, ports))

    def port_forward_request(self, pod_id: str, ports: Sequence[int] = ()) -> PendingStream:
        """The checked port-forward that CRI PortForward hands a URL for."""
        pod = self.get_pod(pod_id)
        if pod.state is not PodState.READY:
            raise FailedPreconditionError(f"pod sandbox {pod.id} is not ready")
        for port in ports:
            if not 1 <= port <= 65535:
                raise InvalidArgumentError(f"invalid port {port}")
        return PendingStream(StreamKind.PORTFORWARD, self.pod_ref(pod), None, None, tuple(ports))

    # ------------------------------------------------------------------ runtime
    def conditions(self) -> list[RuntimeCondition]:
        return [
            RuntimeCondition("RuntimeReady", True),
            RuntimeCondition("NetworkReady", True),
        ]

    def update_runtime_config(self, pod_cidr: str) -> None:
        self.pod_cidr = pod_cidr


async def _run_exec_sync(
    argv: Sequence[str], command: Sequence[str], timeout: float
) -> ExecSyncResult:
    """Run `argv` to its exit, with output capped. Once it exited, output still buffered in
    its sockets is read for at most EXEC_SYNC_DRAIN_SECONDS: a background child that keeps
    them open does not hold the answer back."""
    proc, out_r, err_r = await spawn_with_outputs(
        argv, stdin=asyncio.subprocess.DEVNULL, start_new_session=True, close_fds=True
    )
    outputs = (PipeOutput(out_r), PipeOutput(err_r))
    kept = (bytearray(), bytearray())

    async def capped(output: PipeOutput, buf: bytearray) -> None:
        while chunk := await output.read():
            room = EXEC_SYNC_MAX_OUTPUT - len(buf)
            if room > 0:
                buf += chunk[:room]

    code: int | None = None
    try:
        async with asyncio.TaskGroup() as tg:
            readers = [tg.create_task(capped(o, b)) for o, b in zip(outputs, kept, strict=True)]
            try:
                async with asyncio.timeout(timeout if timeout > 0 else None):
                    code = await proc.wait()
            except TimeoutError:
                await _kill_exec(proc)
                for reader in readers:
                    reader.cancel()
            else:
                _, pending = await asyncio.wait(readers, timeout=EXEC_SYNC_DRAIN_SECONDS)
                for reader in pending:
                    reader.cancel()
    finally:
        for output, fd in zip(outputs, (out_r, err_r), strict=True):
            output.stop()
            os.close(fd)
    if code is None:
        raise DeadlineExceededError(f"command {list(command)} timed out after {timeout:g}s")
    return ExecSyncResult(bytes(kept[0]), bytes(kept[1]), 128 - code if code < 0 else code)


async def _kill_exec(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM first (execwait then kills the container process), SIGKILL to the group."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        async with asyncio.timeout(EXEC_KILL_GRACE_SECONDS):
            await proc.wait()
    except TimeoutError:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    await proc.wait()


def _stop_signal(name: object) -> signal.Signals:
    """The image config's StopSignal ("SIGQUIT", "QUIT" or "3"), else SIGTERM (containerd)."""
    text = str(name or "").strip().upper()
    if not text:
        return signal.SIGTERM
    try:
        return (
            signal.Signals(int(text))
            if text.isdigit()
            else signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]
        )
    except (KeyError, ValueError):
        log.warning("image stop signal %r is not a signal; using SIGTERM", name)
        return signal.SIGTERM


def _check_stdio(tty: bool, stdin: bool, stdout: bool, stderr: bool) -> None:
    if tty and stderr:
        raise InvalidArgumentError("tty and stderr cannot both be true")
    if not (stdin or stdout or stderr):
        raise InvalidArgumentError("one of stdin, stdout, or stderr must be set")
