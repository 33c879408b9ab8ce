"""The in-sandbox agent: port-forward by dialing back to the host.

A VM-style sandbox's pod netns on the host has no listeners, so the host asks the agent inside
the sandbox (ttrpc service `podgate.agent.v1.Agent`) to do the dialing:

1. `PortForward(container_id, port, vsock_port)`: the agent first connects to the target
   inside the guest, 127.0.0.1:port then [::1]:port, one after the other as containerd does.
   If both fail the call fails at once and nothing is dialed back.
2. Then it connects back to the host on `vsock_port` (`--host vsock://2`: AF_VSOCK CID 2;
   `--host hvsock://UDS`: the unix socket `UDS_<vsock_port>`, which is what a hybrid-vsock VMM
   connects a guest's CID 2 dial to). The host listens there before it calls.
3. It replies and splices the two connections in the background; the bytes never travel in
   RPC payloads, and the forward outlives the ttrpc connection that asked for it.

Status codes:

- INVALID_ARGUMENT: a request that cannot be decoded, port outside 1..65535, a vsock_port
  of VMADDR_PORT_ANY, or a protocol other than "", "tcp" and "udp".
- UNAVAILABLE: the target refused on both addresses (`failed to connect to localhost:<p>
  inside the sandbox, IPv4: … IPv6 … `, containerd's wording), or the dial-back failed
  (`failed to connect back to the host …`). UNAVAILABLE rather than Kata's INTERNAL: nothing
  is broken, the port is just not served (yet), and a retry may succeed.

UDP (`protocol: "udp"`, a podgate extension): step 1 makes a UDP socket connected to
127.0.0.1:port instead (a connect that cannot be refused; ICMP port-unreachable later only
drops datagrams), and the dial-back connection carries framed datagrams (uint16 big-endian
length, payload; podgate.proto.datagram). The reply names "udp" so the caller knows the field
was understood. The host's EOF on the dial-back connection closes the UDP socket.

`Health` answers `status: "ok"`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
from dataclasses import dataclass
from typing import Final, TypeVar

from google.protobuf.message import DecodeError

from podgate.agent.agent_pb2 import (
    HealthRequest,
    HealthResponse,
    PortForwardRequest,
    PortForwardResponse,
)
from podgate.aio.datagram import DatagramStream, connected_udp_socket
from podgate.aio.errors import StreamError
from podgate.aio.ksplice import splice_sockets
from podgate.aio.streams import ByteStream, SocketStream
from podgate.aio.tasks import TaskSet
from podgate.aio.ttrpc import RequestContext, TtrpcServer
from podgate.forwarders import localhost_refused_message
from podgate.linux import vsock
from podgate.linux.vsock import Address, Scheme
from podgate.proto.ttrpc import Code, TtrpcError

__all__ = [
    "AGENT_VSOCK_PORT",
    "DEFAULT_HOST",
    "DEFAULT_LISTEN",
    "DIAL_BACK_TIMEOUT_SECONDS",
    "HEALTH_OK",
    "SERVICE",
    "Agent",
    "ForwardRecord",
    "dial_localhost",
    "serve",
]

log = logging.getLogger(__name__)

SERVICE: Final = "podgate.agent.v1.Agent"
HEALTH_OK: Final = "ok"
# Kata's DEFAULT_AGENT_VSOCK_PORT: where the agent's ttrpc server listens in the guest.
AGENT_VSOCK_PORT: Final = 1024
DEFAULT_LISTEN: Final = f"vsock://-1:{AGENT_VSOCK_PORT}"
DEFAULT_HOST: Final = f"vsock://{vsock.VMADDR_CID_HOST}"
# The host accepts the dial-back for 10 s (containerd PR #4814); trying longer is pointless.
DIAL_BACK_TIMEOUT_SECONDS: Final = 10.0
# On SIGTERM, how long forwards in progress may finish before they are cut.
SHUTDOWN_GRACE_SECONDS: Final = 10.0
_MAX_PORT: Final = 65535
_M = TypeVar("_M", PortForwardRequest, HealthRequest)

_TARGETS: Final = (
    (socket.AF_INET, "tcp4", "127.0.0.1", "127.0.0.1"),
    (socket.AF_INET6, "tcp6", "::1", "[::1]"),
)


def _go_strerror(err: int) -> str:
    # Go spells errno texts in lower case ("connection refused").
    text = os.strerror(err)
    return text[:1].lower() + text[1:]


async def dial_localhost(port: int) -> socket.socket:
    """A connected non-blocking socket to 127.0.0.1:`port`, else [::1]:`port`, tried serially.

    Raises TtrpcError(UNAVAILABLE) with containerd's wording when both fail.
    """
    loop = asyncio.get_running_loop()
    failures: list[str] = []
    for family, network, host, shown in _TARGETS:
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            failures.append(
                f"dial {network} {shown}:{port}: socket: {_go_strerror(exc.errno or 0)}"
            )
            continue
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, (host, port))
        except OSError as exc:
            sock.close()
            err = exc.errno or errno.ECONNREFUSED
            failures.append(f"dial {network} {shown}:{port}: connect: {_go_strerror(err)}")
            continue
        except BaseException:
            sock.close()
            raise
        return sock
    raise TtrpcError(Code.UNAVAILABLE, localhost_refused_message(port, *failures))


@dataclass(slots=True)
class ForwardRecord:
    """One forward, for logs: who asked for what and what it moved."""

    container_id: str
    port: int
    vsock_port: int
    started: float
    protocol: str = "tcp"
    to_target: int = 0
    to_host: int = 0

    def fields(self) -> dict[str, object]:
        """Its ids as log fields (`extra=`): JSON keys, or key=value pairs in text."""
        return {"container": self.container_id, "port": self.port, "vsock_port": self.vsock_port}


class Agent:
    """The agent's services; `register()` them on a TtrpcServer."""

    def __init__(
        self, host: Address, *, dial_back_timeout: float = DIAL_BACK_TIMEOUT_SECONDS
    ) -> None:
        if host.scheme not in (Scheme.VSOCK, Scheme.HVSOCK) or host.port is not None:
            raise vsock.AddressError(
                f"the host address must be vsock://CID or hvsock://PATH (no port), not {host}"
            )
        self.host = host
        self.dial_back_timeout = dial_back_timeout
        self._forwards = TaskSet("agent forwards", log)

    def register(self, server: TtrpcServer) -> None:
        server.register(SERVICE, {"PortForward": self.port_forward, "Health": self.health})

    @property
    def active_forwards(self) -> int:
        return len(self._forwards)

    async def health(self, payload: bytes, context: RequestContext) -> bytes:
        del context
        _decode(HealthRequest, payload)
        return bytes(HealthResponse(status=HEALTH_OK).SerializeToString())

    async def port_forward(self, payload: bytes, context: RequestContext) -> bytes:
        del context
        request = _decode(PortForwardRequest, payload)
        if not 1 <= request.port <= _MAX_PORT:
            raise TtrpcError(Code.INVALID_ARGUMENT, f"invalid port {request.port}")
        if request.vsock_port == vsock.VMADDR_PORT_ANY:
            raise TtrpcError(Code.INVALID_ARGUMENT, f"invalid vsock_port {request.vsock_port}")
        protocol = request.protocol or "tcp"
        if protocol not in ("tcp", "udp"):
            raise TtrpcError(Code.INVALID_ARGUMENT, f"invalid protocol {request.protocol!r}")
        loop = asyncio.get_running_loop()
        record = ForwardRecord(
            request.container_id, request.port, request.vsock_port, loop.time(), protocol
        )
        # The target first: a refused port must fail the call before the host is dialed.
        target: ByteStream
        if protocol == "udp":
            target = _udp_localhost(request.port)
        else:
            target = await SocketStream.from_socket(await dial_localhost(request.port))
        try:
            async with asyncio.timeout(self.dial_back_timeout):
                back = await vsock.connect(self.host, request.vsock_port)
                sock = back.transport.get_extra_info("socket")
                if sock is not None:
                    # What the pod sends then reaches the host in bursts (hybrid vsock).
                    vsock.widen_send_buffer(sock)
                if request.nonce:
                    # First on the wire: the host pairs the connection by it.
                    try:
                        await back.send(request.nonce)
                    except BaseException:
                        await back.aclose()
                        raise
        except (TimeoutError, StreamError, OSError) as exc:
            await target.aclose()
            reason = str(exc) or f"no connection within {self.dial_back_timeout:g} s"
            log.warning(
                "port-forward container=%s port=%d vsock_port=%d: dial-back failed: %s",
                record.container_id,
                record.port,
                record.vsock_port,
                reason,
            )
            raise TtrpcError(
                Code.UNAVAILABLE,
                f"failed to connect back to the host at {self.host} port "
                f"{request.vsock_port}: {reason}",
            ) from exc
        except BaseException:
            await target.aclose()
            raise
        self._forwards.spawn(
            self._forward(record, back, target),
            name=f"forward {record.container_id}:{record.port} vsock {record.vsock_port}",
        )
        log.info("port-forward start", extra={**record.fields(), "protocol": record.protocol})
        if protocol == "tcp":
            return b""  # PortForwardResponse{} encodes to nothing, as before the extension
        return bytes(PortForwardResponse(protocol=protocol).SerializeToString())

    async def _forward(self, record: ForwardRecord, back: SocketStream, target: ByteStream) -> None:
        loop = asyncio.get_running_loop()
        error: BaseException | None = None
        try:
            result = await splice_sockets(back, target)  # in the kernel when it can
            record.to_target, record.to_host = result.a_to_b, result.b_to_a
            error = result.error
        except asyncio.CancelledError:
            error = asyncio.CancelledError("agent shutting down")
            raise
        except Exception as exc:
            error = exc
            log.exception(
                "port-forward container=%s port=%d failed", record.container_id, record.port
            )
        finally:
            fields = {
                **record.fields(),
                "to_target": record.to_target,
                "to_host": record.to_host,
                "duration": f"{loop.time() - record.started:.3f}s",
                "protocol": record.protocol,
            }
            if error is not None:
                fields["error"] = str(error)
            log.info("port-forward end", extra=fields)

    async def idle(self) -> None:
        """Wait until no forward is running."""
        await self._forwards.join()

    async def aclose(self, grace: float = 0.0) -> None:
        """Let forwards in progress finish for `grace` seconds, then cut the rest."""
        await self._forwards.aclose(grace)


def _udp_localhost(port: int) -> DatagramStream:
    """A UDP flow to 127.0.0.1:`port`; UNAVAILABLE if the guest cannot even make the socket."""
    try:
        sock = connected_udp_socket("127.0.0.1", port)
    except OSError as exc:
        raise TtrpcError(
            Code.UNAVAILABLE,
            f"failed to open udp to localhost:{port} inside the sandbox: "
            f"{_go_strerror(exc.errno or 0)}",
        ) from exc
    return DatagramStream(sock, label=f"udp 127.0.0.1:{port}")


def _decode(kind: type[_M], payload: bytes) -> _M:
    try:
        return kind.FromString(payload)
    except DecodeError as exc:
        raise TtrpcError(Code.INVALID_ARGUMENT, f"bad {kind.__name__}: {exc}") from exc


async def serve(
    listen: Address, host: Address, *, shutdown_grace: float = SHUTDOWN_GRACE_SECONDS
) -> None:
    """Serve the agent on `listen` until SIGTERM or SIGINT, dialing back to `host`."""
    agent = Agent(host)
    server = TtrpcServer(name="agent")
    agent.register(server)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    listener = await vsock.listen(listen, server.serve)
    log.info("agent listening on %s, dialing back to %s", listener.address, host)
    try:
        await stop.wait()
        log.info("agent stopping: %d forwards in progress", agent.active_forwards)
    finally:
        listener.close()
        await server.aclose()
        with contextlib.suppress(Exception):
            await agent.aclose(shutdown_grace if stop.is_set() else 0.0)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
