"""Port-forward by dialing localhost inside the pod's network namespace (what containerd and
CRI-O do for runc pods): the loop connects a socket made in the netns ahead of time (a pool per
pod, podgate.linux.netns_pool; a worker thread makes them in batches), so a new connection
takes neither a thread hop nor a /proc access.

UDP gets a datagram socket made the same way and connected to 127.0.0.1:port (a connect that
only sets the peer, so there is nothing to refuse and no ::1 fallback to try)."""

from __future__ import annotations

import socket

from podgate.aio.datagram import DatagramStream
from podgate.aio.errors import ConnectError
from podgate.aio.streams import ByteStream, SocketStream
from podgate.backends.base import BackendError
from podgate.linux.netns_pool import NetnsPools
from podgate.linux.ns import NamespaceError, NetnsWorker, connect_in_netns
from podgate.model import PodRecord


class NetnsBackend:
    name = "netns"

    def __init__(self, worker: NetnsWorker | None = None) -> None:
        self.worker = worker or NetnsWorker()
        self.pools = NetnsPools(self.worker)

    async def open(self, pod: PodRecord, port: int, protocol: str = "tcp") -> ByteStream:
        path = pod.ns_path("net")
        if path is None:
            raise BackendError(f"network namespace for sandbox {pod.id!r} is closed")
        if protocol == "udp":
            return await self._open_udp(pod, path, port)
        if protocol != "tcp":
            raise BackendError(f"unsupported port-forward protocol {protocol!r}")
        try:
            # A pool holds its sockets until the pod's process exits; pinned namespaces have
            # no process to watch, so their sockets are made per connection.
            maker = (
                self.pools.for_process(pod.ns_process.pid, pod.ns_process.start_time)
                if pod.ns_process is not None and not pod.ns_files
                else self.worker
            )
            sock = await connect_in_netns(maker, path, port, label=pod.id)
        except (ConnectError, OSError) as exc:
            raise BackendError(
                f'failed to execute portforward in network namespace "{path}": {exc}'
            ) from exc
        return await SocketStream.from_socket(sock)

    async def _open_udp(self, pod: PodRecord, path: str, port: int) -> ByteStream:
        try:
            sock = await self.worker.socket(path, socket.AF_INET, socket.SOCK_DGRAM)
        except NamespaceError as exc:
            raise BackendError(
                f"failed to enter network namespace {path!r}: {exc.strerror}"
            ) from exc
        except OSError as exc:
            raise BackendError(f"udp socket in network namespace {path!r}: {exc}") from exc
        try:
            sock.setblocking(False)
            sock.connect(("127.0.0.1", port))
        except OSError as exc:
            sock.close()
            raise BackendError(
                f"failed to connect udp to localhost:{port} inside namespace {pod.id!r}: {exc}"
            ) from exc
        return DatagramStream(sock, label=f"udp {pod.id[:12]}:{port}")

    def close(self) -> None:
        """Drop every pod's pool of ready sockets."""
        self.pools.close()
