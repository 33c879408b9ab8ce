"""Port-forward through the pod's sandbox shim (containerd PR #4814's shim API): listen on a fresh
unix socket, ask the shim to forward `port` to it, accept the one connection it dials back.

The shim is asked to hand the agent's connection over rather than copy it: the dial-back then
carries the agent's socket (podgate.aio.fdpass) and the bytes go from here to the in-guest
agent with no relay in the shim. A shim that copies instead is used as it is. Either way this
side never sees the guest. A shim that is not
running is started again once (through `restart`) before the backend reports it unavailable.
UDP asks the same call for protocol "udp": the agent opens the UDP socket in the guest and the
dial-back connection carries framed datagrams, which this side passes on as they are.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Final

from google.protobuf.message import DecodeError

from podgate.aio import fdpass
from podgate.aio.errors import BrokenStreamError, ConnectError, ForwardError
from podgate.aio.spdysplice import KernelSpliceable, PodSocket
from podgate.aio.streams import DEFAULT_RECEIVE_BYTES, Buffer, ByteStream, SocketStream
from podgate.aio.ttrpc import TtrpcClient, TtrpcClosedError
from podgate.backends.base import BackendError, BackendUnavailableError
from podgate.linux import vsock
from podgate.model import PodRecord
from podgate.proto.portforward import forward_error_message
from podgate.proto.ttrpc import Code, TtrpcError
from podgate.shimapi import shim_pb2, shim_socket

SHIM_SERVICE: Final = "podgate.shim.v1.Shim"
# containerd PR #4814: exactly one connection, within 10 s of the call's success.
ACCEPT_TIMEOUT_SECONDS: Final = 10.0
# The shim may wait 5 s for a restarting agent, 10 s for its answer and 10 s for its dial-back.
CALL_TIMEOUT_SECONDS: Final = 30.0

RunDir = Callable[[str], Path]
Restart = Callable[[PodRecord], Awaitable[None]]


class AgentBackend:
    name = "agent"

    def __init__(self, run_dir: RunDir, restart: Restart | None = None) -> None:
        self._run_dir = run_dir
        self._restart = restart
        self._clients: dict[str, TtrpcClient] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def open(self, pod: PodRecord, port: int, protocol: str = "tcp") -> ByteStream:
        if protocol not in ("tcp", "udp"):
            raise BackendError(f"unsupported port-forward protocol {protocol!r}")
        path = self._run_dir(pod.id) / f"pf-{secrets.token_hex(4)}.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            listener.bind(str(path))
            listener.listen(1)
            listener.setblocking(False)
            reply = await self._port_forward(pod, port, f"unix://{path}", protocol)
            try:
                async with asyncio.timeout(ACCEPT_TIMEOUT_SECONDS):
                    conn, _ = await asyncio.get_running_loop().sock_accept(listener)
                    pending = b""
                    if reply.handed_over:
                        with conn as channel:
                            channel.setblocking(False)
                            conn, pending = await fdpass.receive_socket(channel)
            except TimeoutError:
                raise BackendError(f"port forwarding timeout for sandbox {pod.id!r}") from None
            except fdpass.HandOverError as exc:
                raise BackendError(f"sandbox {pod.id!r}: {exc}") from exc
        finally:
            listener.close()
            path.unlink(missing_ok=True)
        # Uploads then reach the agent in bursts (its dial-back widens the other way).
        vsock.widen_send_buffer(conn)
        try:
            stream = await SocketStream.from_socket(conn)
        except BaseException:
            conn.close()  # cancelled or refused by the loop: not left open in this process
            raise
        generation = reply.agent_generation
        return _AgentStream(stream, pod, port, lambda: self._broken_since(pod, generation), pending)

    async def _broken_since(self, pod: PodRecord, generation: int) -> str | None:
        """Why a connection made under agent `generation` cannot have ended cleanly, if so.

        A dial-back is a unix socket: a peer killed with nothing unread in its socket leaves
        EOF, not a reset. So at EOF the shim is asked whether its agent has since exited."""
        if not generation:
            return None  # a shim that does not report its agent: EOF is all there is
        client = self._clients.get(pod.id)
        if client is None or client.closed:
            return "the sandbox shim went away"
        try:
            reply = await client.call(SHIM_SERVICE, "Stats", b"", timeout=ACCEPT_TIMEOUT_SECONDS)
            stats = shim_pb2.StatsResponse.FromString(reply)
        except TtrpcClosedError:
            return "the sandbox shim went away"
        except (TtrpcError, DecodeError, TimeoutError) as exc:
            return f"the sandbox shim did not confirm the end: {exc}"
        if not stats.agent_pid or stats.agent_starts != generation:
            return "the sandbox agent exited"
        return None

    async def _port_forward(
        self, pod: PodRecord, port: int, addr: str, protocol: str
    ) -> shim_pb2.PortForwardResponse:
        # containerd PR #4814's fields, plus podgate's: protocol (left empty for TCP) and
        # hand_over, which a shim that does not know it ignores (it then copies).
        request = shim_pb2.PortForwardRequest(
            id=pod.id,
            port=port,
            addr=addr,
            protocol="" if protocol == "tcp" else protocol,
            hand_over=True,
        )
        for attempt in range(2):
            client = await self._client(pod)
            try:
                reply = await client.call(
                    SHIM_SERVICE,
                    "PortForward",
                    request.SerializeToString(),
                    timeout=CALL_TIMEOUT_SECONDS,
                )
                try:
                    return shim_pb2.PortForwardResponse.FromString(reply)
                except DecodeError:
                    # Not podgate's reply: a copied connection, EOF taken as it comes.
                    return shim_pb2.PortForwardResponse()
            except TtrpcClosedError as exc:
                # A connection to a shim that has since died: once more, on a new one.
                self._clients.pop(pod.id, None)
                if attempt:
                    raise BackendUnavailableError(
                        f"the sandbox shim of pod {pod.id} went away: {exc.message}"
                    ) from exc
            except TtrpcError as exc:
                if exc.code == Code.UNIMPLEMENTED:
                    what = "ports" if protocol == "tcp" else f"{protocol} ports"
                    raise BackendUnavailableError(
                        f"the sandbox shim of pod {pod.id} cannot forward {what}: {exc.message}"
                    ) from exc
                if exc.code == Code.UNAVAILABLE:
                    raise BackendUnavailableError(exc.message) from exc
                raise BackendError(exc.message) from exc
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def _client(self, pod: PodRecord) -> TtrpcClient:
        for pod_id in [k for k, c in self._clients.items() if c.closed]:
            del self._clients[pod_id]
        lock = self._locks.setdefault(pod.id, asyncio.Lock())
        async with lock:
            client = self._clients.get(pod.id)
            if client is not None:
                return client
            path = str(shim_socket(self._run_dir(pod.id)))
            try:
                client = await TtrpcClient.connect_unix(path, name=f"shim {pod.id[:12]}")
            except (ConnectError, OSError) as exc:
                if self._restart is None:
                    raise BackendUnavailableError(
                        f"the sandbox shim of pod {pod.id} is not running: {exc}"
                    ) from exc
                await self._restart(pod)
                try:
                    client = await TtrpcClient.connect_unix(path, name=f"shim {pod.id[:12]}")
                except (ConnectError, OSError) as again:
                    raise BackendUnavailableError(
                        f"the sandbox shim of pod {pod.id} does not answer: {again}"
                    ) from again
            self._clients[pod.id] = client
            return client

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.aclose()


class _AgentStream(ByteStream, KernelSpliceable):
    """The dial-back connection; a broken one is reported to the client, not taken for EOF.
    A SPDY forward may splice its socket in the kernel (podgate.aio.spdysplice) with the
    same meaning of EOF and errors."""

    def __init__(
        self,
        inner: SocketStream,
        pod: PodRecord,
        port: int,
        broken: Callable[[], Awaitable[str | None]],
        pending: bytes = b"",
    ) -> None:
        self._inner = inner
        self._pod = pod
        self._port = port
        self._broken = broken
        # Received by the shim before it passed the connection on: they come first.
        self._pending = pending

    def _lost(self, exc: BrokenStreamError | str) -> ForwardError:
        reason = f"the connection through the sandbox agent broke: {exc}"
        return ForwardError(
            forward_error_message(self._port, self._pod.id, self._pod.metadata.uid, reason)
        )

    async def receive(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        if self._pending:
            data, self._pending = self._pending[:max_bytes], self._pending[max_bytes:]
            return data
        try:
            data = await self._inner.receive(max_bytes)
        except BrokenStreamError as exc:
            raise self._lost(exc) from exc
        if not data and (why := await self._broken()) is not None:
            raise self._lost(why)
        return data

    def pod_socket(self) -> PodSocket:
        return PodSocket(self._inner, self._pending, self._check_eof, self._lost)

    async def _check_eof(self) -> None:
        if (why := await self._broken()) is not None:
            raise self._lost(why)

    async def send(self, data: Buffer) -> None:
        try:
            await self._inner.send(data)
        except BrokenStreamError as exc:
            raise self._lost(exc) from exc

    async def send_eof(self) -> None:
        try:
            await self._inner.send_eof()
        except BrokenStreamError as exc:
            raise self._lost(exc) from exc

    async def aclose(self) -> None:
        await self._inner.aclose()
