"""Sandbox transports: AF_VSOCK, hybrid vsock (Firecracker, Cloud Hypervisor) and unix sockets.

Addresses are URLs:

- `vsock://CID:PORT`: AF_VSOCK. CID -1 is VMADDR_CID_ANY (listening), 2 the host; PORT -1 is
  VMADDR_PORT_ANY (listening on a port the kernel picks). `vsock://CID` leaves the port to
  the caller: the agent dials back to `vsock://2` on the port each request names.
- `hvsock://PATH:PORT`: a guest port behind a hybrid-vsock muxer. Connecting means a unix
  connect to PATH, then `CONNECT PORT\\n`, then one reply line that must contain `OK`
  (`OK <hostport>\\n`), read byte by byte so no payload after it is consumed.
- `hvsock://PATH`: the host side of guest-initiated connections. Port P is the unix socket
  `PATH_P` (what the VMM connects to when the guest dials CID 2 port P); no handshake.
- `unix://PATH`: a plain unix socket.

A PATH whose text after the last ':' is a decimal number is read as PATH:PORT, as Kata's
`hvsock://` parser does; such a file name cannot be written without a port.

Everything returns `SocketStream`s. uvloop builds transports only for AF_INET, AF_INET6 and
AF_UNIX sockets, so under uvloop a connected AF_VSOCK socket is handed to it labelled AF_UNIX:
libuv treats both as plain stream fds.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import socket
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Final

from podgate.aio.errors import ConnectError, StreamError, map_os_errors
from podgate.aio.streams import SocketStream, start_unix_server
from podgate.aio.tasks import TaskSet

__all__ = [
    "HANDSHAKE_TIMEOUT_SECONDS",
    "MAX_REPLY_LINE_BYTES",
    "VMADDR_CID_ANY",
    "VMADDR_CID_HOST",
    "VMADDR_PORT_ANY",
    "Address",
    "AddressError",
    "HybridVsockError",
    "Listener",
    "Scheme",
    "adopt_socket",
    "connect",
    "connect_request",
    "listen",
    "parse_address",
    "parse_ok_reply",
    "vsock_available",
    "widen_send_buffer",
]

log = logging.getLogger(__name__)

# <linux/vm_sockets.h>
VMADDR_CID_ANY: Final = 0xFFFFFFFF
VMADDR_CID_HOST: Final = 2
VMADDR_PORT_ANY: Final = 0xFFFFFFFF
_U32_MAX: Final = 0xFFFFFFFF

# Kata's hybrid-vsock dialer gives up after 10 s: a kernel vsock race can leave CONNECT
# unanswered forever.
HANDSHAKE_TIMEOUT_SECONDS: Final = 10.0
# Longest reply line read while waiting for OK; "OK 1073741824\n" is 14 bytes, anything much
# longer is not a muxer talking.
MAX_REPLY_LINE_BYTES: Final = 64
# Pending connections on a vsock listener (the kernel caps it at somaxconn anyway).
LISTEN_BACKLOG: Final = 128
# Pause before accepting again when out of descriptors or memory, so the loop does not spin.
ACCEPT_RETRY_SECONDS: Final = 0.1
_ACCEPT_RETRY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

_DIGITS = re.compile(r"[0-9]+")
_KNOWN_FAMILIES = frozenset({socket.AF_INET, socket.AF_INET6, socket.AF_UNIX})
# The send buffer both ends of a unix dial-back ask for (the kernel doubles it for its
# bookkeeping). With net.core.wmem_default (~200 KiB) the relay in the agent woke for every
# ~210 KiB; with this it takes bigger bursts: ~20% less of its CPU per GB (bench/README.md).
UNIX_SEND_BUFFER_BYTES: Final = 1024 * 1024
_SO_SNDBUFFORCE: Final = getattr(socket, "SO_SNDBUFFORCE", 32)
_Handler = Callable[[SocketStream], Awaitable[None]]


class AddressError(ValueError):
    """An address string that is not one of the forms above."""


class HybridVsockError(ConnectError):
    """The hybrid-vsock muxer did not accept CONNECT (nothing listens on the guest port, or
    the peer is not a muxer)."""


class Scheme(StrEnum):
    VSOCK = "vsock"
    HVSOCK = "hvsock"
    UNIX = "unix"


@dataclass(frozen=True, slots=True)
class Address:
    """A parsed transport address; `port` None means the caller supplies it."""

    scheme: Scheme
    path: str = ""  # hvsock and unix
    cid: int = 0  # vsock, as the kernel sees it (VMADDR_CID_ANY for -1)
    port: int | None = None  # vsock and hvsock

    def __str__(self) -> str:
        if self.scheme is Scheme.VSOCK:
            cid = "-1" if self.cid == VMADDR_CID_ANY else str(self.cid)
            if self.port is None:
                return f"vsock://{cid}"
            port = "-1" if self.port == VMADDR_PORT_ANY else str(self.port)
            return f"vsock://{cid}:{port}"
        if self.scheme is Scheme.HVSOCK and self.port is not None:
            return f"hvsock://{self.path}:{self.port}"
        return f"{self.scheme}://{self.path}"

    def with_port(self, port: int) -> Address:
        return replace(self, port=_check_u32(port, "port"))


def _check_u32(value: int, what: str) -> int:
    if not 0 <= value <= _U32_MAX:
        raise AddressError(f"{what} {value} is not a 32-bit unsigned number")
    return value


def _parse_number(text: str, what: str, *, any_value: int | None = None) -> int:
    if text == "-1" and any_value is not None:
        return any_value
    if not _DIGITS.fullmatch(text):
        raise AddressError(f"{what} {text!r} is not a number")
    return _check_u32(int(text), what)


def parse_address(text: str) -> Address:
    """Parse `vsock://CID[:PORT]`, `hvsock://PATH[:PORT]` or `unix://PATH`."""
    scheme_text, sep, rest = text.partition("://")
    if not sep:
        raise AddressError(f"address {text!r} has no scheme (vsock://, hvsock://, unix://)")
    try:
        scheme = Scheme(scheme_text)
    except ValueError:
        raise AddressError(f"address {text!r}: unknown scheme {scheme_text!r}") from None
    if scheme is Scheme.VSOCK:
        cid_text, has_port, port_text = rest.partition(":")
        cid = _parse_number(cid_text, "CID", any_value=VMADDR_CID_ANY)
        port = _parse_number(port_text, "port", any_value=VMADDR_PORT_ANY) if has_port else None
        return Address(scheme, cid=cid, port=port)
    if not rest or "\0" in rest:
        raise AddressError(f"address {text!r} has no usable path")
    if scheme is Scheme.UNIX:
        return Address(scheme, path=rest)
    path, has_port, port_text = rest.rpartition(":")
    if has_port and _DIGITS.fullmatch(port_text):
        if not path:
            raise AddressError(f"address {text!r} has no path")
        return Address(scheme, path=path, port=_parse_number(port_text, "port"))
    return Address(scheme, path=rest)


# ----------------------------------------------------------------------------- hybrid vsock


def connect_request(port: int) -> bytes:
    """The line a host sends to a hybrid-vsock muxer to reach guest `port`."""
    return b"CONNECT %d\n" % _check_u32(port, "port")


def parse_ok_reply(line: bytes) -> int | None:
    """The host port from a muxer's reply line (None if it gives none); HybridVsockError if
    the line is not an acceptance. Like Kata, any line containing "OK" is one."""
    if b"OK" not in line:
        raise HybridVsockError(f"unexpected hybrid vsock reply {line[:MAX_REPLY_LINE_BYTES]!r}")
    words = line.split()
    if len(words) >= 2 and _DIGITS.fullmatch(words[1].decode("ascii", "replace")):
        return int(words[1])
    return None


async def _read_reply_line(stream: SocketStream) -> bytes:
    # One byte per receive(): what follows the newline stays in the stream for the caller.
    line = bytearray()
    while len(line) < MAX_REPLY_LINE_BYTES:
        byte = await stream.receive(1)
        if not byte:
            raise HybridVsockError(
                "the muxer closed the connection without OK (nothing listening on that port?)"
            )
        line += byte
        if byte == b"\n":
            return bytes(line)
    raise HybridVsockError(f"no newline in the first {MAX_REPLY_LINE_BYTES} bytes of the reply")


async def _hybrid_connect(path: str, port: int, timeout: float) -> SocketStream:
    stream = await _unix_connect(path)
    try:
        async with asyncio.timeout(timeout):
            await stream.send(connect_request(port))
            host_port = parse_ok_reply(await _read_reply_line(stream))
    except TimeoutError:
        await stream.aclose()
        raise HybridVsockError(
            f"hybrid vsock {path}: no answer to CONNECT {port} within {timeout:g} s"
        ) from None
    except HybridVsockError as exc:
        await stream.aclose()
        raise HybridVsockError(f"hybrid vsock {path} port {port}: {exc}") from exc
    except StreamError as exc:
        await stream.aclose()
        raise HybridVsockError(f"hybrid vsock {path} port {port}: {exc}") from exc
    except BaseException:
        await stream.aclose()
        raise
    log.debug("hybrid vsock %s port %d connected (host port %s)", path, port, host_port)
    return stream


# ----------------------------------------------------------------------------- dialing


def widen_send_buffer(sock: socket.socket, size: int = UNIX_SEND_BUFFER_BYTES) -> None:
    """Ask for a `size` send buffer on a unix socket (past net.core.wmem_max when privileged,
    else as far as it allows); other families keep theirs (AF_VSOCK has its own)."""
    if sock.family != socket.AF_UNIX:
        return
    for option in (_SO_SNDBUFFORCE, socket.SO_SNDBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, size)
            return
        except OSError:
            continue


def _go_strerror(err: int) -> str:
    text = os.strerror(err)
    return text[:1].lower() + text[1:]


async def _unix_connect(path: str) -> SocketStream:
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, path)
    except OSError as exc:
        sock.close()
        err = exc.errno or errno.ECONNREFUSED
        raise ConnectError(f"dial unix {path}: connect: {_go_strerror(err)}", err) from exc
    except BaseException:
        sock.close()
        raise
    return await adopt_socket(sock)


async def _vsock_connect(cid: int, port: int) -> SocketStream:
    # uvloop's sock_connect resolves every non-unix address with getaddrinfo, which knows no
    # AF_VSOCK: connect by hand and wait for writability.
    loop = asyncio.get_running_loop()
    shown = f"vsock {cid}:{port}"
    try:
        sock = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
    except (AttributeError, OSError) as exc:
        err = getattr(exc, "errno", None) or errno.EAFNOSUPPORT
        raise ConnectError(f"dial {shown}: socket: {_go_strerror(err)}", err) from exc
    try:
        sock.setblocking(False)
        err = sock.connect_ex((cid, port))
        if err in (errno.EINPROGRESS, errno.EAGAIN):
            writable = loop.create_future()
            loop.add_writer(sock.fileno(), _resolve, writable)
            try:
                await writable
            finally:
                loop.remove_writer(sock.fileno())
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            raise ConnectError(f"dial {shown}: connect: {_go_strerror(err)}", err)
    except BaseException:
        sock.close()
        raise
    return await adopt_socket(sock)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _stand_in(sock: socket.socket) -> socket.socket:
    """The same fd as a socket object labelled AF_UNIX (for loops that check the family)."""
    return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0, fileno=sock.detach())


async def adopt_socket(sock: socket.socket) -> SocketStream:
    """A connected stream socket of any family as a SocketStream, on any event loop."""
    loop = asyncio.get_running_loop()
    if sock.family not in _KNOWN_FAMILIES and not isinstance(loop, asyncio.BaseEventLoop):
        sock = _stand_in(sock)
    return await SocketStream.from_socket(sock)


def _dial_port(address: Address, port: int | None) -> int:
    if address.port is not None and port is not None:
        raise AddressError(f"{address} already names a port; got port {port} as well")
    chosen = address.port if address.port is not None else port
    if chosen is None:
        raise AddressError(f"{address} names no port and none was given")
    return _check_u32(chosen, "port")


async def connect(
    address: Address, port: int | None = None, *, timeout: float = HANDSHAKE_TIMEOUT_SECONDS
) -> SocketStream:
    """Connect to `address`; `port` completes an address that has none (`vsock://2`,
    `hvsock://PATH`). `timeout` bounds the hybrid-vsock handshake.

    Raises ConnectError (HybridVsockError for a refused handshake) or AddressError.
    """
    if address.scheme is Scheme.UNIX:
        if port is not None:
            raise AddressError(f"{address} is a unix socket and takes no port")
        return await _unix_connect(address.path)
    if address.scheme is Scheme.HVSOCK:
        if address.port is not None:
            return await _hybrid_connect(address.path, _dial_port(address, port), timeout)
        return await _unix_connect(f"{address.path}_{_dial_port(address, port)}")
    chosen = _dial_port(address, port)
    if address.cid == VMADDR_CID_ANY or chosen == VMADDR_PORT_ANY:
        raise AddressError(f"cannot connect to a wildcard: {address.with_port(chosen)}")
    return await _vsock_connect(address.cid, chosen)


# ----------------------------------------------------------------------------- listening


class Listener:
    """A listening socket serving each connection in its own task; `address` is where it
    listens (for `vsock://-1:-1`, with the port the kernel picked)."""

    def __init__(
        self,
        address: Address,
        *,
        server: asyncio.Server | None = None,
        sock: socket.socket | None = None,
        handler: _Handler | None = None,
    ) -> None:
        self.address = address
        self._server = server
        self._sock = sock
        self._inode: int | None = None
        self._accept_task: asyncio.Task[None] | None = None
        # The accept loop and the connections still being served.
        self._tasks = TaskSet(f"vsock listener {address}", log)
        if sock is not None and handler is not None:
            self._accept_task = self._tasks.spawn(
                self._accept_loop(sock, handler), name=f"vsock listener {address}"
            )
        if address.scheme is not Scheme.VSOCK:
            with contextlib.suppress(OSError):
                self._inode = os.stat(self.path).st_ino

    @property
    def path(self) -> str:
        """The socket file of a unix listener."""
        if self.address.scheme is Scheme.HVSOCK:
            return f"{self.address.path}_{self.address.port}"
        return self.address.path

    def close(self) -> None:
        """Stop accepting (connections already accepted go on); remove our socket file."""
        if self._server is not None:
            self._server.close()
            self._remove_socket_file()
        if self._accept_task is not None:
            self._accept_task.cancel()
        if self._sock is not None:
            self._sock.close()

    def _remove_socket_file(self) -> None:
        # Only if it is still ours: a successor may already listen on the same path.
        with contextlib.suppress(OSError):
            info = os.stat(self.path)
            if stat.S_ISSOCK(info.st_mode) and info.st_ino == self._inode:
                os.unlink(self.path)

    async def wait_closed(self) -> None:
        if self._server is not None:
            await self._server.wait_closed()
        if self._accept_task is not None:
            await asyncio.wait({self._accept_task})  # its cancellation is its end, not ours

    async def __aenter__(self) -> Listener:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
        await self.wait_closed()

    async def _accept_loop(self, sock: socket.socket, handler: _Handler) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, peer = await loop.sock_accept(sock)
            except OSError as exc:
                if exc.errno in _ACCEPT_RETRY_ERRNOS:
                    log.warning("%s: accept failed: %s", self.address, exc)
                    await asyncio.sleep(ACCEPT_RETRY_SECONDS)
                    continue
                raise
            conn.setblocking(False)
            self._tasks.spawn(_serve_one(handler, conn), name=f"vsock conn {peer}")


async def _serve_one(handler: _Handler, sock: socket.socket) -> None:
    try:
        stream = await adopt_socket(sock)
    except (OSError, StreamError) as exc:
        log.warning("vsock: dropping an accepted connection: %s", exc)
        sock.close()
        return
    try:
        await handler(stream)
    except Exception:
        log.exception("vsock: connection handler failed")
    finally:
        await stream.aclose()


def vsock_available() -> str | None:
    """None if AF_VSOCK sockets can be made here, else why not."""
    family = getattr(socket, "AF_VSOCK", None)
    if family is None:
        return "this Python has no socket.AF_VSOCK"
    try:
        socket.socket(family, socket.SOCK_STREAM).close()
    except OSError as exc:
        return f"the kernel refuses AF_VSOCK sockets: {exc}"
    return None


async def listen(
    address: Address, handler: _Handler, port: int | None = None, *, mode: int = 0o600
) -> Listener:
    """Listen on `address`, running `handler(stream)` per connection (the stream is closed
    when it returns). `port` completes `vsock://CID` and `hvsock://PATH` (which listens on the
    unix socket PATH_port). Unix socket files get `mode`; a stale one is replaced.
    """
    if address.scheme is Scheme.UNIX:
        if port is not None:
            raise AddressError(f"{address} is a unix socket and takes no port")
        server = await start_unix_server(handler, address.path, mode=mode)
        return Listener(address, server=server)
    if address.scheme is Scheme.HVSOCK:
        if address.port is not None:
            raise AddressError(f"{address} is a guest port; listen inside the guest instead")
        bound = address.with_port(_dial_port(address, port))
        server = await start_unix_server(handler, f"{bound.path}_{bound.port}", mode=mode)
        return Listener(bound, server=server)
    chosen = _dial_port(address, port)
    why = vsock_available()
    if why is not None:
        raise ConnectError(f"listen {address}: {why}", errno.EAFNOSUPPORT)
    sock = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
    try:
        with map_os_errors():
            sock.bind((address.cid, chosen))
            sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
        cid, bound_port = sock.getsockname()
    except BaseException:
        sock.close()
        raise
    return Listener(Address(Scheme.VSOCK, cid=cid, port=bound_port), sock=sock, handler=handler)
