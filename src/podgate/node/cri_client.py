"""A CRI client for the node gateway: the runtime's pods as the API shows them, and the one-time
streaming URLs of Exec, Attach and PortForward.

It speaks runtime.v1 over gRPC to any CRI runtime (podgate's, containerd, CRI-O). Only what the
gateway needs is here; errors come out as CriError and its subclasses, carrying the runtime's
own message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import TypeGuard, TypeVar

import grpc
import grpc.aio

from podgate.cri import api_pb2 as pb
from podgate.cri import api_pb2_grpc as pb_grpc
from podgate.node.kubeapi import ContainerView, PodView
from podgate.node.logs import LogSource, LogSourceLost
from podgate.streaming.target import StreamTarget

log = logging.getLogger(__name__)

# Annotation podgate's runtime reads a container's ports from (CRI has no field for them).
PODGATE_PORTS_ANNOTATION = "podgate.io/ports"
# The kubelet records a container's spec ports here (a JSON list of ContainerPort objects).
KUBELET_PORTS_ANNOTATION = "io.kubernetes.container.ports"
# Deadline of every CRI call: a hung runtime fails a request instead of hanging kubectl.
CALL_TIMEOUT_SECONDS = 30.0
# kubectl polls pods; a sandbox's IP is looked up at most this often.
STATUS_CACHE_SECONDS = 1.0
# The kubelet's CRI message limit (pkg/kubelet/cri/remote maxMsgSize): big pod lists fit.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

_T = TypeVar("_T")


class CriError(Exception):
    """A CRI call failed; the message is the runtime's own text."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class CriNotFound(CriError):
    """The pod or container does not exist (gRPC NOT_FOUND)."""


class CriUnavailable(CriError):
    """The runtime cannot be reached or did not answer in time."""


_UNAVAILABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def _mapped(exc: grpc.aio.AioRpcError) -> CriError:
    code = exc.code()
    message = exc.details() or code.name
    if code is grpc.StatusCode.NOT_FOUND:
        return CriNotFound(message, code)
    if code in _UNAVAILABLE_CODES:
        return CriUnavailable(message, code)
    return CriError(message, code)


@dataclass(frozen=True, slots=True)
class RuntimeVersion:
    version: str
    runtime_name: str
    runtime_version: str
    runtime_api_version: str


def container_ports(annotations: Mapping[str, str]) -> tuple[int, ...]:
    """Declared ports: podgate's annotation (a JSON list of ints), else the kubelet's (a JSON
    list of objects with containerPort). Malformed values count as no ports."""
    raw = annotations.get(PODGATE_PORTS_ANNOTATION)
    try:
        if raw is not None:
            items = json.loads(raw)
            if isinstance(items, list):
                return tuple(p for p in items if _is_port(p))
            return ()
        raw = annotations.get(KUBELET_PORTS_ANNOTATION)
        if raw is not None:
            items = json.loads(raw)
            if isinstance(items, list):
                ports = [p.get("containerPort") for p in items if isinstance(p, dict)]
                return tuple(p for p in ports if _is_port(p))
    except ValueError:
        log.debug("ignoring malformed ports annotation %r", raw)
    return ()


def _is_port(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536


def pod_phase(
    sandbox_ready: bool, states: Sequence[int], exit_codes: Sequence[int | None] = ()
) -> str:
    """The pod phase from the sandbox state and each container's CRI state (and, for exited
    containers, exit code; None when unknown)."""
    if states and all(s == pb.CONTAINER_EXITED for s in states):
        codes = list(exit_codes) or [None] * len(states)
        return "Succeeded" if all(c == 0 for c in codes) else "Failed"
    if not sandbox_ready:
        return "Failed" if not states else "Unknown"
    if not states or any(s == pb.CONTAINER_CREATED for s in states):
        return "Pending"
    if any(s == pb.CONTAINER_UNKNOWN for s in states):
        return "Unknown"
    # Every container is running, or some are and others have finished (Kubernetes' Running).
    return "Running"


def _rank(sandbox: pb.PodSandbox) -> tuple[bool, int]:
    return (sandbox.state == pb.SANDBOX_READY, sandbox.created_at)


def _latest_attempts(containers: Iterable[pb.Container]) -> list[pb.Container]:
    """One container per name: the kubelet keeps exited attempts until it collects them."""
    latest: dict[str, pb.Container] = {}
    for c in containers:
        seen = latest.get(c.metadata.name)
        if seen is None or (c.metadata.attempt, c.created_at) > (
            seen.metadata.attempt,
            seen.created_at,
        ):
            latest[c.metadata.name] = c
    return sorted(latest.values(), key=lambda c: (c.created_at, c.metadata.name))


class CriClient:
    """runtime.v1 RuntimeService over a unix socket (grpc.aio)."""

    def __init__(
        self,
        socket_path: str,
        *,
        timeout: float = CALL_TIMEOUT_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        channel: grpc.aio.Channel | None = None,
    ) -> None:
        """`channel`: one to the runtime to share (the caller closes it), else one of its own."""
        self.socket_path = socket_path
        self.timeout = timeout
        self._clock = clock
        self._owns_channel = channel is None
        self._channel = channel or grpc.aio.insecure_channel(
            f"unix://{os.path.abspath(socket_path)}",
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ],
        )
        self._rt = pb_grpc.RuntimeServiceStub(self._channel)
        self._ips: dict[str, tuple[float, str]] = {}  # sandbox id -> (when looked up, IP)
        self._exit_codes: dict[str, int] = {}  # exited container id -> its exit code
        self._stdio: dict[str, tuple[bool, bool]] = {}  # container id -> (stdin, tty)

    async def _call(self, call: Awaitable[_T]) -> _T:
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            raise _mapped(exc) from None

    async def version(self) -> RuntimeVersion:
        r = await self._call(self._rt.Version(pb.VersionRequest(), timeout=self.timeout))
        return RuntimeVersion(r.version, r.runtime_name, r.runtime_version, r.runtime_api_version)

    async def list_pods(self, *, one_per_name: bool = False) -> list[PodView]:
        """Every sandbox the runtime knows, with its containers (the latest attempt of each).

        With `one_per_name`, one sandbox per namespace/name: a READY one wins over stopped ones
        (the kubelet keeps those until it collects them), then the newest.
        """
        sandboxes, containers = await asyncio.gather(
            self._call(self._rt.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=self.timeout)),
            self._call(self._rt.ListContainers(pb.ListContainersRequest(), timeout=self.timeout)),
        )
        by_pod: dict[str, list[pb.Container]] = {}
        for c in containers.containers:
            by_pod.setdefault(c.pod_sandbox_id, []).append(c)
        grouped = {s.id: _latest_attempts(by_pod.get(s.id, ())) for s in sandboxes.items}
        ready = [s.id for s in sandboxes.items if s.state == pb.SANDBOX_READY]
        exited = [c.id for cs in grouped.values() for c in cs if c.state == pb.CONTAINER_EXITED]
        everyone = [c.id for cs in grouped.values() for c in cs]
        ips, codes, stdio = await asyncio.gather(
            self._pod_ips(ready), self._exit_codes_of(exited), self._stdio_of(everyone)
        )
        items: Iterable[pb.PodSandbox] = sandboxes.items
        if one_per_name:
            best: dict[tuple[str, str], pb.PodSandbox] = {}
            for s in items:
                key = (s.metadata.namespace, s.metadata.name)
                seen = best.get(key)
                if seen is None or _rank(s) > _rank(seen):
                    best[key] = s
            items = best.values()
        return [self._view(s, grouped[s.id], ips.get(s.id, ""), codes, stdio) for s in items]

    def _view(
        self,
        sandbox: pb.PodSandbox,
        containers: list[pb.Container],
        ip: str,
        codes: dict[str, int],
        stdio: dict[str, tuple[bool, bool]],
    ) -> PodView:
        meta = sandbox.metadata
        states = [c.state for c in containers]
        return PodView(
            namespace=meta.namespace,
            name=meta.name,
            uid=meta.uid or sandbox.id,
            containers=[
                ContainerView(
                    c.metadata.name,
                    id=c.id,
                    ports=container_ports(c.annotations),
                    ready=c.state == pb.CONTAINER_RUNNING,
                    stdin=stdio.get(c.id, (False, False))[0],
                    tty=stdio.get(c.id, (False, False))[1],
                    image=c.image.image or c.image_ref,
                )
                for c in containers
            ],
            phase=pod_phase(
                sandbox.state == pb.SANDBOX_READY, states, [codes.get(c.id) for c in containers]
            ),
            created=datetime.fromtimestamp(sandbox.created_at / 1e9, UTC),
            ip=ip,
            sandbox_id=sandbox.id,
        )

    async def _pod_ips(self, sandbox_ids: list[str]) -> dict[str, str]:
        now = self._clock()
        ips = {
            sid: cached[1]
            for sid in sandbox_ids
            if (cached := self._ips.get(sid)) is not None and now - cached[0] < STATUS_CACHE_SECONDS
        }
        missing = [sid for sid in sandbox_ids if sid not in ips]
        results = await asyncio.gather(
            *(
                self._rt.PodSandboxStatus(
                    pb.PodSandboxStatusRequest(pod_sandbox_id=sid), timeout=self.timeout
                )
                for sid in missing
            ),
            return_exceptions=True,
        )
        fresh = {}
        for sid, result in zip(missing, results, strict=True):
            if isinstance(result, grpc.aio.AioRpcError):
                # Removed since the list, most likely; it shows without an IP this once.
                log.debug("PodSandboxStatus %s: %s", sid, result.details())
                continue
            if isinstance(result, BaseException):
                raise result
            fresh[sid] = result.status.network.ip
        self._ips = {sid: (now, ip) for sid, ip in fresh.items()} | {
            sid: self._ips[sid] for sid in ips
        }
        return ips | fresh

    async def _stdio_of(self, container_ids: list[str]) -> dict[str, tuple[bool, bool]]:
        """(stdin, tty) of each container, from its verbose status's config (containerd and
        podgate both put the CRI ContainerConfig there). A container's config never changes,
        so each is asked for once; kubectl needs these for `attach -it`."""
        missing = [cid for cid in container_ids if cid not in self._stdio]

        async def one(cid: str) -> None:
            request = pb.ContainerStatusRequest(container_id=cid, verbose=True)
            try:
                response = await self._call(self._rt.ContainerStatus(request, timeout=self.timeout))
                config = json.loads(response.info.get("info", "{}")).get("config", {})
            except (CriError, ValueError, AttributeError):
                return
            if isinstance(config, dict):
                self._stdio[cid] = (bool(config.get("stdin")), bool(config.get("tty")))

        await asyncio.gather(*(one(cid) for cid in missing))
        return {cid: self._stdio[cid] for cid in container_ids if cid in self._stdio}

    async def _exit_codes_of(self, container_ids: list[str]) -> dict[str, int]:
        """Exit codes of exited containers; they never change, so each is asked for once."""
        missing = [cid for cid in container_ids if cid not in self._exit_codes]
        results = await asyncio.gather(
            *(
                self._rt.ContainerStatus(
                    pb.ContainerStatusRequest(container_id=cid), timeout=self.timeout
                )
                for cid in missing
            ),
            return_exceptions=True,
        )
        for cid, result in zip(missing, results, strict=True):
            if isinstance(result, grpc.aio.AioRpcError):
                log.debug("ContainerStatus %s: %s", cid, result.details())
                continue
            if isinstance(result, BaseException):
                raise result
            self._exit_codes[cid] = result.status.exit_code
        # Forget containers that are gone, so the cache is bounded by what the runtime holds.
        self._exit_codes = {
            cid: self._exit_codes[cid] for cid in container_ids if cid in self._exit_codes
        }
        return dict(self._exit_codes)

    async def exec_url(
        self,
        container_id: str,
        cmd: Sequence[str],
        *,
        tty: bool = False,
        stdin: bool = False,
        stdout: bool = True,
        stderr: bool = True,
    ) -> str:
        request = pb.ExecRequest(
            container_id=container_id,
            cmd=list(cmd),
            tty=tty,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
        )
        return (await self._call(self._rt.Exec(request, timeout=self.timeout))).url

    async def attach_url(
        self,
        container_id: str,
        *,
        tty: bool = False,
        stdin: bool = False,
        stdout: bool = True,
        stderr: bool = True,
    ) -> str:
        request = pb.AttachRequest(
            container_id=container_id, tty=tty, stdin=stdin, stdout=stdout, stderr=stderr
        )
        return (await self._call(self._rt.Attach(request, timeout=self.timeout))).url

    async def port_forward_url(self, pod_sandbox_id: str, ports: Sequence[int] = ()) -> str:
        """A port-forward URL for the sandbox; with no ports, each stream pair names its own."""
        request = pb.PortForwardRequest(pod_sandbox_id=pod_sandbox_id, port=list(ports))
        return (await self._call(self._rt.PortForward(request, timeout=self.timeout))).url

    async def container_log_path(self, container_id: str) -> str:
        request = pb.ContainerStatusRequest(container_id=container_id)
        response = await self._call(self._rt.ContainerStatus(request, timeout=self.timeout))
        return response.status.log_path

    async def first_running_container(self, sandbox_id: str) -> str | None:
        """The oldest running container of a pod sandbox, or None."""
        request = pb.ListContainersRequest(
            filter=pb.ContainerFilter(
                pod_sandbox_id=sandbox_id,
                state=pb.ContainerStateValue(state=pb.CONTAINER_RUNNING),
            )
        )
        response = await self._call(self._rt.ListContainers(request, timeout=self.timeout))
        running = sorted(response.containers, key=lambda c: c.created_at)
        return running[0].id if running else None

    async def exec_sync(self, container_id: str, cmd: Sequence[str], timeout: int) -> str:
        """stdout of a command run to completion; CriError when it fails or exits non-zero."""
        request = pb.ExecSyncRequest(container_id=container_id, cmd=list(cmd), timeout=timeout)
        response = await self._call(
            self._rt.ExecSync(request, timeout=max(self.timeout, timeout + 5))
        )
        if response.exit_code != 0:
            raise CriError(
                f"{list(cmd)[:1]} exited {response.exit_code}: "
                f"{response.stderr.decode(errors='replace').strip()}"
            )
        return response.stdout.decode(errors="replace")

    async def container_running(self, container_id: str) -> bool:
        request = pb.ContainerStatusRequest(container_id=container_id)
        response = await self._call(self._rt.ContainerStatus(request, timeout=self.timeout))
        return response.status.state == pb.CONTAINER_RUNNING

    async def close(self) -> None:
        if self._owns_channel:
            await self._channel.close()


class CriPodSource:
    """The runtime's pods for the API, streamed through `target` (a CriTarget)."""

    def __init__(self, client: CriClient, target: StreamTarget, *, node: str = "") -> None:
        self.client = client
        self._target = target
        self.node = node

    @property
    def target(self) -> StreamTarget:
        return self._target

    async def list_pods(self) -> list[PodView]:
        views = await self.client.list_pods(one_per_name=True)
        return [replace(v, node=self.node) for v in views] if self.node else views

    def stream_container(self, pod: PodView, name: str | None) -> str | None:
        for c in pod.containers:
            if name is None or c.name == name:
                return c.id
        return None

    async def logs(self, pod: PodView, container: str) -> LogSource | None:
        """The container's CRI log file (the gateway runs on the runtime's node)."""
        for c in pod.containers:
            if c.name != container or not c.id:
                continue
            try:
                path = await self.client.container_log_path(c.id)
            except CriError:
                return None
            if not path:
                return None

            async def running(container_id: str = c.id) -> bool:
                try:
                    return await self.client.container_running(container_id)
                except CriNotFound:
                    return False  # removed: nothing more will be written
                except CriError as exc:
                    # The runtime is gone (or failing): a follow that ended here quietly
                    # would read as the container's exit.
                    raise LogSourceLost(f"container {container_id}: {exc}") from exc

            return LogSource(path, running)
        return None
