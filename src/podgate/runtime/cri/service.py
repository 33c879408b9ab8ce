"""The CRI RuntimeService and ImageService over gRPC (grpc.aio), on a unix socket.

Thin: each method checks its request, calls the runtime and converts the answer (convert.py);
errors become status codes in one wrapper (errors.py). Exec, Attach and PortForward only
return a one-time URL on the runtime's streaming server.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import stat
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import grpc
import grpc.aio

from podgate.cri import api_pb2 as pb
from podgate.cri import api_pb2_grpc as pb_grpc
from podgate.images.config import Credentials
from podgate.images.reference import InvalidReferenceError, parse_normalized
from podgate.images.store import ImageRecord, ImageStore
from podgate.model import PodState
from podgate.runtime.api import (
    DeadlineExceededError,
    InvalidArgumentError,
    NotFoundError,
    RuntimeApi,
)
from podgate.runtime.cri import convert
from podgate.runtime.cri.errors import (
    Context,
    UnimplementedLog,
    cri_method,
    unimplemented_handler,
)
from podgate.runtime.events import SubscriberLaggedError

log = logging.getLogger(__name__)

# The kubelet API version podgate speaks (VersionResponse.version).
KUBELET_API_VERSION = "0.1.0"
RUNTIME_NAME = "podgate"
RUNTIME_API_VERSION = "v1"
# sockaddr_un.sun_path is 108 bytes on Linux, including the terminating NUL.
MAX_SOCKET_PATH_BYTES = 107
# CRI is root-only: whoever reaches the socket can run anything on the node.
SOCKET_MODE = 0o600
# The kubelet's CRI client limit (pkg/kubelet/cri/remote maxMsgSize); ExecSync output can
# approach it.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# ExecSync answers carry up to 16 MiB of stdout and 16 MiB of stderr plus framing.
MAX_SEND_MESSAGE_BYTES = 2 * MAX_MESSAGE_BYTES + 1024 * 1024
# Handlers Status lists ("" = the default, runc). Neither supports recursive read-only mounts
# (runc 1.1 has no `rro`) nor user namespaces yet.
RUNTIME_HANDLERS = ("", "sandboxed")
# How long in-flight calls may finish after stop_cri is called.
STOP_GRACE_SECONDS = 5.0

Clock = Callable[[], int]  # nanoseconds since the epoch
# Names a CRI AuthConfig.server_address may give Docker Hub (reference names say docker.io).
DOCKER_HUB_ALIASES = {"index.docker.io": "docker.io", "registry-1.docker.io": "docker.io"}


class RuntimeServicer(pb_grpc.RuntimeServiceServicer):
    def __init__(self, runtime: RuntimeApi, clock: Clock = time.time_ns) -> None:
        self.runtime = runtime
        self.clock = clock

    @cri_method
    async def Version(self, request: pb.VersionRequest, context: Context) -> pb.VersionResponse:
        return pb.VersionResponse(
            version=KUBELET_API_VERSION,
            runtime_name=RUNTIME_NAME,
            runtime_version=self.runtime.version,
            runtime_api_version=RUNTIME_API_VERSION,
        )

    @cri_method
    async def Status(self, request: pb.StatusRequest, context: Context) -> pb.StatusResponse:
        conditions = [convert.runtime_condition(c) for c in self.runtime.conditions()]
        return pb.StatusResponse(
            status=pb.RuntimeStatus(conditions=conditions),
            runtime_handlers=[
                pb.RuntimeHandler(name=name, features=pb.RuntimeHandlerFeatures())
                for name in RUNTIME_HANDLERS
            ],
            features=pb.RuntimeFeatures(supplemental_groups_policy=True),
        )

    @cri_method
    async def RuntimeConfig(
        self, request: pb.RuntimeConfigRequest, context: Context
    ) -> pb.RuntimeConfigResponse:
        # Containers' cgroups are directories under their parent: the cgroupfs driver.
        return pb.RuntimeConfigResponse(
            linux=pb.LinuxRuntimeConfiguration(cgroup_driver=pb.CGROUPFS)
        )

    @cri_method
    async def UpdatePodSandboxResources(
        self, request: pb.UpdatePodSandboxResourcesRequest, context: Context
    ) -> pb.UpdatePodSandboxResourcesResponse:
        await self.runtime.update_pod_resources(
            convert.require(request.pod_sandbox_id, "pod_sandbox_id"),
            convert.resources(request.overhead),
            convert.resources(request.resources),
        )
        return pb.UpdatePodSandboxResourcesResponse()

    @cri_method
    async def UpdateRuntimeConfig(
        self, request: pb.UpdateRuntimeConfigRequest, context: Context
    ) -> pb.UpdateRuntimeConfigResponse:
        self.runtime.update_runtime_config(convert.pod_cidr(request))
        return pb.UpdateRuntimeConfigResponse()

    # ------------------------------------------------------------------ pod sandboxes

    @cri_method
    async def RunPodSandbox(
        self, request: pb.RunPodSandboxRequest, context: Context
    ) -> pb.RunPodSandboxResponse:
        pod_id = await self.runtime.run_pod(convert.pod_config(request))
        return pb.RunPodSandboxResponse(pod_sandbox_id=pod_id)

    @cri_method
    async def StopPodSandbox(
        self, request: pb.StopPodSandboxRequest, context: Context
    ) -> pb.StopPodSandboxResponse:
        await self.runtime.stop_pod(convert.require(request.pod_sandbox_id, "pod_sandbox_id"))
        return pb.StopPodSandboxResponse()

    @cri_method
    async def RemovePodSandbox(
        self, request: pb.RemovePodSandboxRequest, context: Context
    ) -> pb.RemovePodSandboxResponse:
        await self.runtime.remove_pod(convert.require(request.pod_sandbox_id, "pod_sandbox_id"))
        return pb.RemovePodSandboxResponse()

    @cri_method
    async def PodSandboxStatus(
        self, request: pb.PodSandboxStatusRequest, context: Context
    ) -> pb.PodSandboxStatusResponse:
        pod = self.runtime.get_pod(convert.require(request.pod_sandbox_id, "pod_sandbox_id"))
        timestamp = self.clock()
        containers = [c for c in self.runtime.list_containers() if c.pod_id == pod.id]
        ip, additional_ips = await self.runtime.pod_network(pod)
        return pb.PodSandboxStatusResponse(
            status=convert.pod_sandbox_status(pod, ip, additional_ips),
            info=convert.pod_info(pod) if request.verbose else {},
            containers_statuses=[convert.container_status(c) for c in containers],
            timestamp=timestamp,
        )

    @cri_method
    async def ListPodSandbox(
        self, request: pb.ListPodSandboxRequest, context: Context
    ) -> pb.ListPodSandboxResponse:
        flt = request.filter
        pods = self.runtime.list_pods()
        if flt.id:
            pod_id = self._resolve_pod_id(flt.id)
            pods = [p for p in pods if p.id == pod_id]
        if flt.HasField("state"):
            pods = [p for p in pods if convert.pod_state(p.state) == flt.state.state]
        pods = [p for p in pods if convert.matches_selector(p.labels, flt.label_selector)]
        return pb.ListPodSandboxResponse(items=[convert.pod_sandbox(p) for p in pods])

    def _resolve_pod_id(self, prefix: str) -> str | None:
        # Filters take an id prefix as containerd's do; an unknown one matches nothing.
        try:
            return self.runtime.get_pod(prefix).id
        except NotFoundError:
            return None

    # ------------------------------------------------------------------ containers

    @cri_method
    async def CreateContainer(
        self, request: pb.CreateContainerRequest, context: Context
    ) -> pb.CreateContainerResponse:
        args = convert.container_request(request)
        container_id = await self.runtime.create_container(
            args.pod_id, args.metadata, args.spec, args.labels, args.annotations
        )
        return pb.CreateContainerResponse(container_id=container_id)

    @cri_method
    async def StartContainer(
        self, request: pb.StartContainerRequest, context: Context
    ) -> pb.StartContainerResponse:
        await self.runtime.start_container(convert.require(request.container_id, "container_id"))
        return pb.StartContainerResponse()

    @cri_method
    async def StopContainer(
        self, request: pb.StopContainerRequest, context: Context
    ) -> pb.StopContainerResponse:
        container_id = convert.require(request.container_id, "container_id")
        timeout = convert.timeout_seconds(request.timeout)
        await self.runtime.stop_container(container_id, timeout)
        return pb.StopContainerResponse()

    @cri_method
    async def RemoveContainer(
        self, request: pb.RemoveContainerRequest, context: Context
    ) -> pb.RemoveContainerResponse:
        await self.runtime.remove_container(convert.require(request.container_id, "container_id"))
        return pb.RemoveContainerResponse()

    @cri_method
    async def ListContainers(
        self, request: pb.ListContainersRequest, context: Context
    ) -> pb.ListContainersResponse:
        flt = request.filter
        containers = self.runtime.list_containers()
        if flt.id:
            container_id = self._resolve_container_id(flt.id)
            containers = [c for c in containers if c.id == container_id]
        if flt.pod_sandbox_id:
            pod_id = self._resolve_pod_id(flt.pod_sandbox_id)
            containers = [c for c in containers if c.pod_id == pod_id]
        if flt.HasField("state"):
            containers = [
                c for c in containers if convert.container_state(c.state) == flt.state.state
            ]
        containers = [
            c for c in containers if convert.matches_selector(c.labels, flt.label_selector)
        ]
        return pb.ListContainersResponse(containers=[convert.container(c) for c in containers])

    def _resolve_container_id(self, prefix: str) -> str | None:
        try:
            return self.runtime.get_container(prefix).id
        except NotFoundError:
            return None

    @cri_method
    async def ContainerStatus(
        self, request: pb.ContainerStatusRequest, context: Context
    ) -> pb.ContainerStatusResponse:
        record = self.runtime.get_container(convert.require(request.container_id, "container_id"))
        return pb.ContainerStatusResponse(
            status=convert.container_status(record),
            info=convert.container_info(record) if request.verbose else {},
        )

    @cri_method
    async def UpdateContainerResources(
        self, request: pb.UpdateContainerResourcesRequest, context: Context
    ) -> pb.UpdateContainerResourcesResponse:
        container_id = convert.require(request.container_id, "container_id")
        await self.runtime.update_container_resources(
            container_id, convert.resources(request.linux)
        )
        return pb.UpdateContainerResourcesResponse()

    @cri_method
    async def ReopenContainerLog(
        self, request: pb.ReopenContainerLogRequest, context: Context
    ) -> pb.ReopenContainerLogResponse:
        await self.runtime.reopen_container_log(
            convert.require(request.container_id, "container_id")
        )
        return pb.ReopenContainerLogResponse()

    @cri_method
    async def ContainerStats(
        self, request: pb.ContainerStatsRequest, context: Context
    ) -> pb.ContainerStatsResponse:
        record = self.runtime.get_container(convert.require(request.container_id, "container_id"))
        usage = await self.runtime.container_usage(record)
        return pb.ContainerStatsResponse(stats=convert.container_stats(record, usage))

    @cri_method
    async def ListContainerStats(
        self, request: pb.ListContainerStatsRequest, context: Context
    ) -> pb.ListContainerStatsResponse:
        flt = request.filter
        containers = self.runtime.list_containers()
        if flt.id:
            container_id = self._resolve_container_id(flt.id)
            containers = [c for c in containers if c.id == container_id]
        if flt.pod_sandbox_id:
            pod_id = self._resolve_pod_id(flt.pod_sandbox_id)
            containers = [c for c in containers if c.pod_id == pod_id]
        containers = [
            c for c in containers if convert.matches_selector(c.labels, flt.label_selector)
        ]
        stats = [
            convert.container_stats(c, await self.runtime.container_usage(c)) for c in containers
        ]
        return pb.ListContainerStatsResponse(stats=stats)

    @cri_method
    async def PodSandboxStats(
        self, request: pb.PodSandboxStatsRequest, context: Context
    ) -> pb.PodSandboxStatsResponse:
        pod = self.runtime.get_pod(convert.require(request.pod_sandbox_id, "pod_sandbox_id"))
        usage = await self.runtime.pod_usage(pod)
        return pb.PodSandboxStatsResponse(stats=convert.pod_sandbox_stats(pod, usage))

    @cri_method
    async def ListPodSandboxStats(
        self, request: pb.ListPodSandboxStatsRequest, context: Context
    ) -> pb.ListPodSandboxStatsResponse:
        # Ready pods only: a stopped pod's cgroup and network namespace are gone.
        flt = request.filter
        pods = [p for p in self.runtime.list_pods() if p.state is PodState.READY]
        if flt.id:
            pod_id = self._resolve_pod_id(flt.id)
            pods = [p for p in pods if p.id == pod_id]
        pods = [p for p in pods if convert.matches_selector(p.labels, flt.label_selector)]
        stats = [convert.pod_sandbox_stats(p, await self.runtime.pod_usage(p)) for p in pods]
        return pb.ListPodSandboxStatsResponse(stats=stats)

    async def GetContainerEvents(
        self, request: pb.GetEventsRequest, context: Context
    ) -> AsyncIterator[pb.ContainerEventResponse]:
        """Every lifecycle event from now on, in order, until the client leaves or the
        runtime shuts down (the stream then ends with OK). A client too slow to keep up is
        dropped with RESOURCE_EXHAUSTED (runtime/events.py)."""
        sub = self.runtime.events.subscribe()
        log.info("cri GetContainerEvents: subscriber joined (%d now)", len(self.runtime.events))
        try:
            # Headers now: a client that has them knows it is subscribed.
            await context.send_initial_metadata(())
            while (event := await sub.next()) is not None:
                yield convert.container_event(event)
        except SubscriberLaggedError as exc:
            log.warning("cri GetContainerEvents: %s", exc)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        finally:
            sub.close()
            log.info("cri GetContainerEvents: subscriber left (%d now)", len(self.runtime.events))

    # ------------------------------------------------------------------ exec, attach, port-forward

    @cri_method
    async def ExecSync(self, request: pb.ExecSyncRequest, context: Context) -> pb.ExecSyncResponse:
        container_id = convert.require(request.container_id, "container_id")
        cmd = convert.command(request.cmd)
        timeout = convert.timeout_seconds(request.timeout)
        result = await self.runtime.exec_sync(container_id, cmd, timeout)
        return pb.ExecSyncResponse(
            stdout=result.stdout, stderr=result.stderr, exit_code=result.exit_code
        )

    @cri_method
    async def Exec(self, request: pb.ExecRequest, context: Context) -> pb.ExecResponse:
        container_id = convert.require(request.container_id, "container_id")
        cmd = convert.command(request.cmd)
        convert.check_stdio(
            tty=request.tty, stdin=request.stdin, stdout=request.stdout, stderr=request.stderr
        )
        url = self.runtime.exec_url(
            container_id,
            cmd,
            tty=request.tty,
            stdin=request.stdin,
            stdout=request.stdout,
            stderr=request.stderr,
        )
        return pb.ExecResponse(url=url)

    @cri_method
    async def Attach(self, request: pb.AttachRequest, context: Context) -> pb.AttachResponse:
        container_id = convert.require(request.container_id, "container_id")
        convert.check_stdio(
            tty=request.tty, stdin=request.stdin, stdout=request.stdout, stderr=request.stderr
        )
        url = self.runtime.attach_url(
            container_id,
            tty=request.tty,
            stdin=request.stdin,
            stdout=request.stdout,
            stderr=request.stderr,
        )
        return pb.AttachResponse(url=url)

    @cri_method
    async def PortForward(
        self, request: pb.PortForwardRequest, context: Context
    ) -> pb.PortForwardResponse:
        pod_id = convert.require(request.pod_sandbox_id, "pod_sandbox_id")
        url = self.runtime.port_forward_url(pod_id, convert.ports(request.port))
        return pb.PortForwardResponse(url=url)


class Puller(Protocol):
    """Fetches an image from its registry into the image store (images/pull.py)."""

    async def pull(self, reference: str, credentials: Credentials | None) -> str:
        """Pull `reference` (normalised) and register it; returns the image ID."""
        ...


def credentials_from_auth(auth: pb.AuthConfig, reference: str) -> Credentials | None:
    """CRI AuthConfig → registry credentials, as containerd reads it (images-and-oci.md §2.3)."""
    if auth.server_address:
        # Credentials meant for another registry are not sent to this one.
        host = auth.server_address.split("://", 1)[-1].split("/", 1)[0]
        # Docker config files key Docker Hub as https://index.docker.io/v1/.
        host = DOCKER_HUB_ALIASES.get(host, host)
        if host != parse_normalized(reference).domain:
            return None
    if auth.username:
        return Credentials(username=auth.username, password=auth.password)
    if auth.identity_token:
        return Credentials(identity_token=auth.identity_token)
    if auth.auth:
        try:
            user, sep, password = base64.b64decode(auth.auth, validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            raise InvalidArgumentError("auth is not base64 of user:password") from None
        if not sep:
            raise InvalidArgumentError("auth is not base64 of user:password")
        return Credentials(username=user, password=password)
    if auth.registry_token:
        # A bearer token for the registry itself (containerd ignores it; podgate sends it).
        return Credentials(registry_token=auth.registry_token)
    return None


def image_message(rec: ImageRecord) -> pb.Image:
    image = pb.Image(
        id=rec.id,
        repo_tags=rec.repo_tags,
        repo_digests=rec.repo_digests,
        size=rec.size,
        username=rec.username,
        pinned=rec.pinned,
    )
    if rec.uid is not None:
        image.uid.value = rec.uid
    return image


class ImageServicer(pb_grpc.ImageServiceServicer):
    """The image service over podgate's image store (podgate.images).

    Lookups follow containerd: an ID, a name normalised as docker does, or a unique ID prefix.
    Store operations that touch the disk at length (removal with GC, usage walks) run in a
    worker thread so the event loop keeps serving. PullImage needs a `Puller`; without one it
    answers UNIMPLEMENTED.
    """

    def __init__(
        self,
        images: ImageStore,
        puller: Puller | None = None,
        clock: Clock = time.time_ns,
        unimplemented: UnimplementedLog | None = None,
    ) -> None:
        self.images = images
        self.puller = puller
        self.clock = clock
        self.unimplemented = unimplemented or UnimplementedLog()

    @cri_method
    async def ListImages(
        self, request: pb.ListImagesRequest, context: Context
    ) -> pb.ListImagesResponse:
        wanted = request.filter.image.image if request.HasField("filter") else ""
        # Lookups take the store's lock (and a file lock shared with `podgate images import`):
        # in a worker thread, so the event loop never waits on them.
        if wanted:
            rec = await asyncio.to_thread(self.images.get, wanted)
            records = [rec] if rec is not None else []
        else:
            records = await asyncio.to_thread(self.images.images)
        return pb.ListImagesResponse(images=[image_message(r) for r in records])

    @cri_method
    async def ImageStatus(
        self, request: pb.ImageStatusRequest, context: Context
    ) -> pb.ImageStatusResponse:
        rec = await asyncio.to_thread(self.images.get, request.image.image)
        if rec is None:
            return pb.ImageStatusResponse()
        info = self.images.verbose_info(rec) if request.verbose else {}
        return pb.ImageStatusResponse(image=image_message(rec), info=info)

    @cri_method
    async def PullImage(
        self, request: pb.PullImageRequest, context: Context
    ) -> pb.PullImageResponse:
        if self.puller is None:
            await self.unimplemented.abort(
                context,
                "/runtime.v1.ImageService/PullImage",
                "this runtime has no registry client configured; cannot pull images "
                "(load them with `podgate images import`)",
                f"this runtime has no registry client configured; cannot pull "
                f"{request.image.image!r} (load images with `podgate images import`)",
            )
        try:
            reference = str(parse_normalized(request.image.image))
        except InvalidReferenceError as exc:
            raise InvalidArgumentError(str(exc)) from exc
        credentials = credentials_from_auth(request.auth, reference)
        remaining = context.time_remaining()
        try:
            async with asyncio.timeout(remaining):
                image_id = await self.puller.pull(reference, credentials)
        except TimeoutError:
            raise DeadlineExceededError(f"pulling {reference!r}: deadline exceeded") from None
        return pb.PullImageResponse(image_ref=image_id)

    @cri_method
    async def RemoveImage(
        self, request: pb.RemoveImageRequest, context: Context
    ) -> pb.RemoveImageResponse:
        # An unknown image is success (the kubelet's GC and critest rely on it).
        await asyncio.to_thread(self.images.remove, request.image.image)
        return pb.RemoveImageResponse()

    @cri_method
    async def ImageFsInfo(
        self, request: pb.ImageFsInfoRequest, context: Context
    ) -> pb.ImageFsInfoResponse:
        used = await asyncio.to_thread(self.images.fs_info)
        usage = pb.FilesystemUsage(
            timestamp=self.clock(),
            fs_id=pb.FilesystemIdentifier(mountpoint=used.mountpoint),
            used_bytes=pb.UInt64Value(value=used.used_bytes),
            inodes_used=pb.UInt64Value(value=used.inodes_used),
        )
        return pb.ImageFsInfoResponse(image_filesystems=[usage])


def _remove_stale_socket(path: str) -> None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FileExistsError(f"{path} exists and is not a socket; refusing to replace it")
    os.unlink(path)


async def serve_cri(
    runtime: RuntimeApi, socket_path: str, *, images: ImageStore, puller: Puller | None = None
) -> grpc.aio.Server:
    """Start the CRI services on `unix://<socket_path>` (mode 0600) and return the server."""
    if len(os.fsencode(socket_path)) > MAX_SOCKET_PATH_BYTES:
        raise ValueError(f"socket path is longer than {MAX_SOCKET_PATH_BYTES} bytes: {socket_path}")
    _remove_stale_socket(socket_path)
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_SEND_MESSAGE_BYTES),
        ]
    )
    pb_grpc.add_RuntimeServiceServicer_to_server(RuntimeServicer(runtime), server)
    unimplemented = UnimplementedLog()
    pb_grpc.add_ImageServiceServicer_to_server(
        ImageServicer(images, puller, unimplemented=unimplemented), server
    )
    # Methods outside podgate's schema: UNIMPLEMENTED, logged once per method name.
    server.add_generic_rpc_handlers((unimplemented_handler(unimplemented),))
    # The socket is bound here; the umask keeps it private from its first moment.
    old_umask = os.umask(0o777 & ~SOCKET_MODE)
    try:
        server.add_insecure_port(f"unix://{socket_path}")
    finally:
        os.umask(old_umask)
    os.chmod(socket_path, SOCKET_MODE)
    await server.start()
    return server


async def stop_cri(
    server: grpc.aio.Server, socket_path: str, grace: float = STOP_GRACE_SECONDS
) -> None:
    """Stop accepting calls, let running ones finish for `grace` seconds, remove the socket."""
    await server.stop(grace)
    with contextlib.suppress(FileNotFoundError, FileExistsError):
        _remove_stale_socket(socket_path)
