"""setns/unshare through libc, per-thread netns entry and containerd-style dialing (real netns)."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

import pytest

from podgate.aio.errors import ConnectError
from podgate.linux import ns

T = TypeVar("T")

ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates network namespaces")
THREAD_NET = "/proc/thread-self/ns/net"


def _on_thread(fn: Callable[[], T]) -> T:
    """Run `fn` on a fresh thread, so namespace changes never touch the test's own thread."""
    result: dict[str, Any] = {}

    def work() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]  # type: ignore[no-any-return]


def _new_netns() -> tuple[int, int]:
    """A new netns held only by an fd (no process, no mount); (fd, lo flags before 'up')."""

    def work() -> tuple[int, int]:
        home = os.open(THREAD_NET, os.O_RDONLY | os.O_CLOEXEC)
        try:
            ns.unshare(ns.CLONE_NEWNET)
            fd = os.open(THREAD_NET, os.O_RDONLY | os.O_CLOEXEC)
            before = ns.link_flags("lo")
            ns.set_link_up("lo")
            ns.setns(home, ns.CLONE_NEWNET)
            return fd, before
        finally:
            os.close(home)

    return _on_thread(work)


@pytest.fixture
def netns() -> Iterator[tuple[str, int]]:
    """(path, lo flags before it was brought up) of a fresh network namespace."""
    fd, before = _new_netns()
    try:
        yield f"/proc/{os.getpid()}/fd/{fd}", before
    finally:
        os.close(fd)


@pytest.fixture
async def worker() -> AsyncIterator[ns.NetnsWorker]:
    w = ns.NetnsWorker()
    try:
        yield w
    finally:
        w.close()


def test_constants_match_linux_sched_h() -> None:
    assert ns.CLONE_NEWNS == 0x00020000
    assert ns.CLONE_NEWUTS == 0x04000000
    assert ns.CLONE_NEWIPC == 0x08000000
    assert ns.CLONE_NEWUSER == 0x10000000
    assert ns.CLONE_NEWPID == 0x20000000
    assert ns.CLONE_NEWNET == 0x40000000
    assert ns.ns_path(42, "net") == "/proc/42/ns/net"


def test_libc_errors_become_oserror_with_errno() -> None:
    with pytest.raises(OSError) as info:
        ns.setns(-1, ns.CLONE_NEWNET)
    assert info.value.errno == errno.EBADF
    with pytest.raises(OSError) as info:
        ns.unshare(0x1)  # not a namespace flag: EINVAL
    assert info.value.errno == errno.EINVAL


@pytest.mark.privileged
@ROOT
def test_lo_starts_down_and_is_brought_up(netns: tuple[str, int]) -> None:
    path, before = netns
    assert not before & ns.IFF_UP

    def flags() -> int:
        with ns.in_netns(path):
            return ns.link_flags("lo")

    assert _on_thread(flags) & ns.IFF_UP


@pytest.mark.privileged
@ROOT
def test_in_netns_changes_only_the_calling_thread(netns: tuple[str, int]) -> None:
    path, _ = netns
    host = ns.ns_inode(THREAD_NET)
    target = ns.ns_inode(path)
    assert target != host
    inside = threading.Event()
    release = threading.Event()

    def work() -> tuple[int, int]:
        with ns.in_netns(path):
            seen = ns.ns_inode(THREAD_NET)
            inside.set()
            release.wait(5)
        return seen, ns.ns_inode(THREAD_NET)

    result: list[tuple[int, int]] = []
    thread = threading.Thread(target=lambda: result.append(work()))
    thread.start()
    assert inside.wait(5)
    # While the other thread is inside, this one (and the process) stays in the host netns.
    assert ns.ns_inode(THREAD_NET) == host
    assert ns.ns_inode("/proc/self/ns/net") == host
    release.set()
    thread.join()
    assert result == [(target, host)]


@pytest.mark.privileged
@ROOT
def test_in_netns_refuses_bad_targets_and_stays_home() -> None:
    def attempt(path: str) -> tuple[int | None, int]:
        try:
            with ns.in_netns(path):
                pass
        except ns.NamespaceError as exc:
            return exc.errno, ns.ns_inode(THREAD_NET)
        raise AssertionError("entered a non-netns")

    host = ns.ns_inode(THREAD_NET)
    assert _on_thread(lambda: attempt("/nonexistent/ns")) == (errno.ENOENT, host)
    # A UTS namespace file is not a network namespace.
    assert _on_thread(lambda: attempt("/proc/self/ns/uts")) == (errno.EINVAL, host)


@pytest.mark.privileged
@ROOT
def test_sockets_keep_their_netns_loopbacks_are_separate(netns: tuple[str, int]) -> None:
    path, _ = netns
    with socket.socket() as host_listener:
        host_listener.bind(("127.0.0.1", 0))
        host_listener.listen()
        port = host_listener.getsockname()[1]
        inner_listener = _on_thread(lambda: ns.socket_in_netns(path, socket.AF_INET))
        inner_client = _on_thread(lambda: ns.socket_in_netns(path, socket.AF_INET))
        with inner_listener, inner_client:
            # The same address and port binds again: it is another netns's loopback.
            inner_listener.bind(("127.0.0.1", port))
            inner_listener.listen()
            inner_listener.setblocking(False)
            host_listener.setblocking(False)
            # Host -> 127.0.0.1:port reaches the host listener only.
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                conn, _ = host_listener.accept()
                conn.close()
                with pytest.raises(BlockingIOError):
                    inner_listener.accept()
            # A socket made in the netns (used here, on the host thread) reaches the inner one.
            inner_client.connect(("127.0.0.1", port))
            conn, _ = inner_listener.accept()
            conn.close()
            with pytest.raises(BlockingIOError):
                host_listener.accept()
        # And a port open only on the host is closed inside.
        probe = _on_thread(lambda: ns.socket_in_netns(path, socket.AF_INET))
        with probe, pytest.raises(ConnectionRefusedError):
            probe.connect(("127.0.0.1", port))


async def _accept_and_echo(listener: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    conn, _ = await loop.sock_accept(listener)
    with conn:
        data = await loop.sock_recv(conn, 100)
        await loop.sock_sendall(conn, data.upper())
    return data


@pytest.mark.privileged
@ROOT
async def test_connect_in_netns_ipv4(netns: tuple[str, int], worker: ns.NetnsWorker) -> None:
    path, _ = netns
    loop = asyncio.get_running_loop()
    with await worker.socket(path, socket.AF_INET) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        server = asyncio.create_task(_accept_and_echo(listener))
        with await ns.connect_in_netns(worker, path, port) as sock:
            assert sock.family == socket.AF_INET
            assert sock.getpeername() == ("127.0.0.1", port)
            await loop.sock_sendall(sock, b"ping")
            assert await loop.sock_recv(sock, 100) == b"PING"
        assert await server == b"ping"


@pytest.mark.privileged
@ROOT
async def test_connect_in_netns_falls_back_to_ipv6(
    netns: tuple[str, int], worker: ns.NetnsWorker
) -> None:
    path, _ = netns
    loop = asyncio.get_running_loop()
    with await worker.socket(path, socket.AF_INET6) as listener:
        listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        listener.bind(("::1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        server = asyncio.create_task(_accept_and_echo(listener))
        with await ns.connect_in_netns(worker, path, port) as sock:
            assert sock.family == socket.AF_INET6
            assert sock.getpeername()[:2] == ("::1", port)
            await loop.sock_sendall(sock, b"six")
            assert await loop.sock_recv(sock, 100) == b"SIX"
        assert await server == b"six"


@pytest.mark.privileged
@ROOT
async def test_connect_in_netns_closed_port_has_containerd_wording(
    netns: tuple[str, int], worker: ns.NetnsWorker
) -> None:
    path, _ = netns
    with await worker.socket(path, socket.AF_INET) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # free inside the netns once closed
    with pytest.raises(ConnectError) as info:
        await ns.connect_in_netns(worker, path, port, label="sandbox-1")
    # k8s-streaming.md §3 quotes containerd; note the trailing space.
    assert str(info.value) == (
        f'failed to connect to localhost:{port} inside namespace "sandbox-1", '
        f"IPv4: dial tcp4 127.0.0.1:{port}: connect: connection refused "
        f"IPv6 dial tcp6 [::1]:{port}: connect: connection refused "
    )
    assert info.value.errno == errno.ECONNREFUSED
    with pytest.raises(ConnectError, match=f'inside namespace "{path}", IPv4'):
        await ns.connect_in_netns(worker, path, port)


@pytest.mark.privileged
@ROOT
async def test_connect_in_netns_bad_path(worker: ns.NetnsWorker) -> None:
    with pytest.raises(ConnectError, match="failed to enter network namespace") as info:
        await ns.connect_in_netns(worker, "/nonexistent/net", 80)
    assert info.value.errno == errno.ENOENT


@pytest.mark.privileged
@ROOT
def test_worker_thread_outside_its_netns_refuses_work(netns: tuple[str, int]) -> None:
    path, _ = netns
    w = ns.NetnsWorker()
    try:

        def stuck() -> None:
            with ns.in_netns(path):
                w._job(path, socket.AF_INET, socket.SOCK_STREAM).close()

        with pytest.raises(ns.NamespaceRestoreError, match="stuck in netns"):
            _on_thread(stuck)
    finally:
        w.close()
