"""The CRI RuntimeService and ImageService over gRPC (grpc.aio), on a unix socket.

Thin: each method checks its request, calls the runtime and converts the answer (convert.py);
errors become status codes in one wrapper (errors.py). Exec, Attach and PortForward only
return a one-time URL on the runtime's streaming server.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Callable

import grpc
import grpc.aio

from podgate.cri import api_pb2 as pb
from podgate.cri import api_pb2_grpc as pb_grpc
from podgate.runtime.api import NotFoundError, RuntimeApi
from podgate.runtime.cri import convert
from podgate.runtime.cri.errors import Context, cri_method

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


class ImageServicer(pb_grpc.ImageServiceServicer):
    """podgate runs commands on the node's (or a pod's root) filesystem and keeps no images.

    ListImages is empty and ImageStatus says "not present". ImageFsInfo reports the
    filesystem that holds `image_fs_path` (the state directory), measured with statvfs: its
    used bytes and inodes, as a bound on what podgate keeps there; with no path, no filesystems.
    """

    def __init__(self, image_fs_path: str | None = None, clock: Clock = time.time_ns) -> None:
        self.image_fs_path = image_fs_path
        self.clock = clock

    @cri_method
    async def ListImages(
        self, request: pb.ListImagesRequest, context: Context
    ) -> pb.ListImagesResponse:
        return pb.ListImagesResponse()

    @cri_method
    async def ImageStatus(
        self, request: pb.ImageStatusRequest, context: Context
    ) -> pb.ImageStatusResponse:
        return pb.ImageStatusResponse()

    @cri_method
    async def PullImage(
        self, request: pb.PullImageRequest, context: Context
    ) -> pb.PullImageResponse:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            f"podgate does not pull images (asked for {request.image.image!r}); "
            "containers run on the node's filesystem",
        )

    @cri_method
    async def RemoveImage(
        self, request: pb.RemoveImageRequest, context: Context
    ) -> pb.RemoveImageResponse:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            f"podgate does not manage images (asked to remove {request.image.image!r})",
        )

    @cri_method
    async def ImageFsInfo(
        self, request: pb.ImageFsInfoRequest, context: Context
    ) -> pb.ImageFsInfoResponse:
        if self.image_fs_path is None:
            return pb.ImageFsInfoResponse()
        st = os.statvfs(self.image_fs_path)
        usage = pb.FilesystemUsage(
            timestamp=self.clock(),
            fs_id=pb.FilesystemIdentifier(mountpoint=self.image_fs_path),
            used_bytes=pb.UInt64Value(value=(st.f_blocks - st.f_bfree) * st.f_frsize),
            inodes_used=pb.UInt64Value(value=st.f_files - st.f_ffree),
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
    runtime: RuntimeApi, socket_path: str, *, image_fs_path: str | None = None
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
    pb_grpc.add_ImageServiceServicer_to_server(ImageServicer(image_fs_path), server)
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
