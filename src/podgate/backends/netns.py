"""Port-forward by dialing localhost inside the pod's network namespace (what containerd and
CRI-O do for runc pods): a worker thread makes the socket in the netns, the loop connects."""

from __future__ import annotations

from podgate.aio.errors import ConnectError
from podgate.aio.streams import ByteStream, SocketStream
from podgate.backends.base import BackendError
from podgate.linux.ns import NetnsWorker, connect_in_netns
from podgate.runtime.model import PodRecord


class NetnsBackend:
    name = "netns"

    def __init__(self, worker: NetnsWorker | None = None) -> None:
        self.worker = worker or NetnsWorker()

    async def open(self, pod: PodRecord, port: int) -> ByteStream:
        if pod.ns_process is None:
            raise BackendError(f"network namespace for sandbox {pod.id!r} is closed")
        path = f"/proc/{pod.ns_process.pid}/ns/net"
        try:
            sock = await connect_in_netns(self.worker, path, port, label=pod.id)
        except (ConnectError, OSError) as exc:
            raise BackendError(
                f'failed to execute portforward in network namespace "{path}": {exc}'
            ) from exc
        return await SocketStream.from_socket(sock)
