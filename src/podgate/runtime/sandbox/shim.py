"""The sandbox shim: one per pod of the `sandboxed` handler. It boots the pod's "VM" and serves
the shim-level PortForward API (containerd PR #4814's shape) on top of an in-guest agent.

Run as `python -m podgate.runtime.sandbox.shim --dir DIR --ready-file FILE [--hostname H]
[--adopt-guest HOLDER_PID:START:NS_PID:START]`, or forked from a warm interpreter
(podgate.linux.forker, which warms it with `warm`). It daemonizes (the first process exits at
once), then:

1. starts the guest: new network, UTS, IPC and PID namespaces whose PID 1 is a `sleep`
   (podgate.linux.pidone; the guest's holder and namespace process are that one process), or,
   with --adopt-guest, takes over the guest of a shim that died;
2. runs the hybrid-vsock muxer (the VMM's host side, podgate.linux.vmm.Muxer) on DIR/v.sock in
   its own event loop, as Kata's runtime-rs runs its built-in VMM in the shim, and forks the
   agent, which enters the guest's namespaces and listens on guest vsock port 1024;
3. waits for the agent's Health over hybrid vsock;
4. serves `podgate.shim.v1.Shim` over ttrpc on DIR/shim.sock and writes the ready file.

The agent dies with the shim (PR_SET_PDEATHSIG); the guest does not, so containers outlive a
shim crash. When the agent exits, connections through it are aborted and it is started again.

PortForward(id, port, addr, protocol, hand_over): a dial-back listener DIR/v.sock_P is shared
by every connection to the same (container, port, protocol) and closed when the last one ends
(Kata PR #5979's pool, on hybrid vsock). It listens BEFORE the agent is asked to connect to the
port and dial back to vsock port P; the agent's connection must arrive within 10 s; then the
shim dials `addr` and copies. With hand_over (podgate's runtime asks for it) it passes the
agent's connection over `addr` instead (podgate.aio.fdpass) and is done with it: the bytes go
runtime → agent with no copy here, and the connection ends, for the pool, once passed. A shim
killed outright takes its agent with it (PDEATHSIG), so a passed connection still breaks.
A UDP flow (protocol "udp") travels the same way as framed datagrams; the shim only checks that
the agent's reply confirms UDP (an agent that predates the field would have connected TCP) and
otherwise passes or copies bytes as for TCP.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import heapq
import logging
import os
import secrets
import signal
import socket
import sys
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TextIO

from google.protobuf.message import DecodeError

from podgate.agent import agent as agent_mod
from podgate.agent import agent_pb2
from podgate.aio import fdpass
from podgate.aio.errors import ConnectError, StreamError
from podgate.aio.ksplice import splice_sockets
from podgate.aio.loop import run
from podgate.aio.splice import splice
from podgate.aio.streams import DEFAULT_RECEIVE_BYTES, Buffer, ByteStream, SocketStream
from podgate.aio.tasks import TaskSet, cancel_and_wait
from podgate.aio.ttrpc import RequestContext, TtrpcClient, TtrpcClosedError, TtrpcServer
from podgate.linux import ns, pidone, vsock
from podgate.linux.proc import (
    atomic_write_json,
    fork_call,
    is_alive,
    is_exiting,
    process_ref,
    signal_process,
)
from podgate.linux.vmm import Muxer
from podgate.model import ProcessRef
from podgate.proto.ttrpc import Code, TtrpcError
from podgate.shimapi import shim_pb2

__all__ = [
    "AGENT_SERVICE",
    "AGENT_VSOCK_PORT",
    "DIAL_BACK_TIMEOUT_SECONDS",
    "SHIM_SERVICE",
    "SandboxShim",
    "main",
    "warm",
]

log = logging.getLogger("podgate.sandbox.shim")

SHIM_SERVICE: Final = "podgate.shim.v1.Shim"
AGENT_SERVICE: Final = "podgate.agent.v1.Agent"
# How the agent's error for a failed dial-back begins (any other error is about the port).
AGENT_DIAL_BACK_FAILED: Final = "failed to connect back to the host"
# Kata's DEFAULT_AGENT_VSOCK_PORT: where the agent listens inside the guest.
AGENT_VSOCK_PORT: Final = 1024
# Dial-back ports handed to the agent start here, clear of the agent's own port.
FIRST_DIAL_BACK_PORT: Final = 10000
# containerd PR #4814 waits 10 s for the one dial-back connection; the agent gets as long.
DIAL_BACK_TIMEOUT_SECONDS: Final = 10.0
# Random bytes per PortForward the agent writes first on its dial-back: 128 bits cannot be
# guessed by another guest process racing for the port.
DIAL_BACK_NONCE_BYTES: Final = 16
# How long a connection to a dial-back port may take to present its nonce; the agent writes
# it at once after connecting, seconds.
DIAL_BACK_NONCE_TIMEOUT_SECONDS: Final = 5.0
AGENT_CALL_TIMEOUT_SECONDS: Final = 10.0
# A fresh agent is a fork of this shim and a listen inside the guest, seconds (generous: a
# loaded node).
AGENT_BOOT_TIMEOUT_SECONDS: Final = 30.0
# How long one Health call may take, and the pause between attempts while booting, seconds.
HEALTH_CALL_TIMEOUT_SECONDS: Final = 2.0
HEALTH_RETRY_SECONDS: Final = 0.05
# While the agent is being restarted, PortForward waits this long for it before failing, so a
# connection right after a crash does not fail needlessly, seconds.
AGENT_WAIT_SECONDS: Final = 5.0
# Pause before restarting an agent that exited; doubles up to the maximum, seconds.
RESTART_BACKOFF_SECONDS: Final = 0.2
RESTART_BACKOFF_MAX_SECONDS: Final = 5.0
# Grace for the agent after SIGTERM before SIGKILL, seconds.
CHILD_STOP_SECONDS: Final = 2.0
# The guest's namespaces the agent joins (its PID namespace it does not: it is no process of
# the pod's, and a PID namespace can only be entered by children).
AGENT_NAMESPACES: Final = (
    ("net", ns.CLONE_NEWNET),
    ("uts", ns.CLONE_NEWUTS),
    ("ipc", ns.CLONE_NEWIPC),
)

# Health calls a forker makes through an agent and a muxer of its own before it forks (`warm`),
# and how long that may take, seconds.
WARM_ROUNDS: Final = 10
WARM_TIMEOUT_SECONDS: Final = 10.0

_PR_SET_PDEATHSIG: Final = 1
_PR_SET_NAME: Final = 15
_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl


class ShimStartError(Exception):
    """The sandbox could not be booted; the message goes to the ready file."""


# --------------------------------------------------------------------------- the agent process


class _AgentProcess:
    """The agent, a forked child of this shim; its exit is seen through a pidfd."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._pidfd = os.pidfd_open(pid)
        self._loop.add_reader(self._pidfd, self._reap)

    def _reap(self) -> None:
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        _, status = os.waitpid(self.pid, 0)
        self.returncode = os.waitstatus_to_exitcode(status)
        self._exited.set()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # not reaped yet: the pid is still this child's
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_agent(run_dir: Path, guest_ns_pid: int) -> int:
    """Fork the agent (its pid): it shares this process's pages instead of starting an
    interpreter. The shim forks its first agent before its event loop runs, so that agent
    shares only pages the shim has not written yet; a restarted one is forked from the
    running shim."""
    with contextlib.suppress(FileNotFoundError):
        (run_dir / f"guest.vsock_{AGENT_VSOCK_PORT}").unlink()
    listen = f"unix://{run_dir / 'guest.vsock'}_{AGENT_VSOCK_PORT}"
    host = f"hvsock://{run_dir / 'v.sock'}"
    shim_pid = os.getpid()
    # Nothing of the child may return into the shim's event loop: fork_call exits it.
    return fork_call(
        lambda: _agent_child(shim_pid, str(run_dir / "agent.log"), guest_ns_pid, listen, host),
        "sandbox agent",
    )


def _agent_child(shim_pid: int, log_file: str, guest_ns_pid: int, listen: str, host: str) -> int:
    """In the forked child: leave the shim's state behind, enter the guest, serve the agent."""
    gc.freeze()  # the shim's objects: the collector would write to (and copy) their pages
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != shim_pid:
        return 1  # the shim died before the line above
    _prctl(_PR_SET_NAME, b"podgate-agent", 0, 0, 0)
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    _own_descriptors(log_file)
    for kind, flag in AGENT_NAMESPACES:
        fd = os.open(f"/proc/{guest_ns_pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            ns.setns(fd, flag)
        finally:
            os.close(fd)
    asyncio.events._set_running_loop(None)  # the shim's, running in the frame we forked from
    _trim_heap()
    run(agent_mod.serve(vsock.parse_address(listen), vsock.parse_address(host)))
    return 0


def _trim_heap() -> None:
    """Give back the C heap's free pages (booting left some; a forked agent inherits the
    shim's): pages shared with the forker that are unmapped count in nobody's PSS."""
    with contextlib.suppress(AttributeError):  # not glibc
        _libc.malloc_trim(0)


def _own_descriptors(log_file: str) -> None:
    """stdio to /dev/null and `log_file`; every other descriptor (the shim's sockets, its loop's
    epoll) becomes /dev/null: their peers see them closed, and a shim object that closes its
    number later closes /dev/null, never a descriptor of the agent's."""
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    log_fd = os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.dup2(log_fd, 2)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in (devnull, log_fd):
            with contextlib.suppress(OSError):
                os.dup2(devnull, fd, inheritable=False)
    os.close(log_fd)
    os.close(devnull)


# --------------------------------------------------------------------------- connections


class _Relay:
    """One forwarded connection: the agent's dial-back spliced to the runtime's socket.

    Any stream error, or the agent going away, aborts both sockets rather than closing them, so
    the runtime sees an error where one happened (when it has data in flight) instead of EOF.
    """

    def __init__(self, agent_side: SocketStream, runtime_side: SocketStream) -> None:
        self.failed = False
        self._sockets = (agent_side, runtime_side)
        self._agent = _Tracked(agent_side, self)
        self._runtime = _Tracked(runtime_side, self)

    async def run(self) -> None:
        agent, runtime = self._sockets
        if agent.can_hand_over() and runtime.can_hand_over():
            # Both plain sockets: in the kernel (os.splice), aborting both on an error.
            result = await splice_sockets(runtime, agent, abort_on_error=True)
            self.failed = self.failed or result.error is not None
        else:
            result = await splice(self._runtime, self._agent)
        log.debug(
            "relay ended: %d in, %d out, error %s", result.a_to_b, result.b_to_a, result.error
        )

    def abort(self) -> None:
        self.failed = True
        for sock in self._sockets:
            sock.abort()


class _Tracked(ByteStream):
    def __init__(self, inner: SocketStream, relay: _Relay) -> None:
        self._inner = inner
        self._relay = relay

    async def receive(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        try:
            return await self._inner.receive(max_bytes)
        except StreamError:
            self._relay.failed = True
            raise

    async def send(self, data: Buffer) -> None:
        try:
            await self._inner.send(data)
        except StreamError:
            self._relay.failed = True
            raise

    async def send_eof(self) -> None:
        try:
            await self._inner.send_eof()
        except StreamError:
            self._relay.failed = True
            raise

    async def aclose(self) -> None:
        if self._relay.failed:
            self._inner.abort()
        else:
            await self._inner.aclose()


@dataclass(slots=True)
class _Arrival:
    """A dial-back connection from the agent; its listener closes it once `done` is set."""

    stream: SocketStream
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(slots=True)
class _Pool:
    """The dial-back listener shared by every connection to one (container, port, protocol).

    Each PortForward waits under its own nonce; a connection is paired only with the request
    whose nonce it presents first."""

    key: tuple[str, int, str]
    vsock_port: int
    listener: vsock.Listener | None = None
    waiting: dict[bytes, asyncio.Future[_Arrival]] = field(default_factory=dict)
    refs: int = 0


# --------------------------------------------------------------------------- the shim


class SandboxShim:
    """The guest's processes, the dial-back pool and the ttrpc service of one sandbox."""

    def __init__(self, run_dir: Path, guest_ns_pid: int) -> None:
        self.run_dir = run_dir
        self.guest_ns_pid = guest_ns_pid
        self.device = vsock.parse_address(f"hvsock://{run_dir / 'v.sock'}")
        self.agent_address = self.device.with_port(AGENT_VSOCK_PORT)
        self.stats = shim_pb2.StatsResponse()
        self._pools: dict[tuple[str, int, str], _Pool] = {}
        self._pool_lock = asyncio.Lock()
        self._free_ports: list[int] = []
        self._next_port = FIRST_DIAL_BACK_PORT
        self._relays: set[_Relay] = set()
        self._tasks = TaskSet("sandbox shim", log)
        self._agent_proc: _AgentProcess | None = None
        # The running agent, once healthy: Stats checks it is not exiting (see get_stats).
        self._agent_ref: ProcessRef | None = None
        self._muxer: Muxer | None = None
        self._muxer_listener: vsock.Listener | None = None
        self._agent: TtrpcClient | None = None
        self._agent_up = asyncio.Event()
        self._agent_lock = asyncio.Lock()
        self._stopping = False

    # -- the guest's processes

    async def _start_muxer(self) -> None:
        """The VMM's host side, in this process: host connections on DIR/v.sock to the guest's
        listeners DIR/guest.vsock_PORT. It runs as long as the shim."""
        muxer = Muxer(str(self.run_dir / "guest.vsock"))
        try:
            self._muxer_listener = await muxer.listen(self.device.path)
        except (OSError, StreamError) as exc:
            raise ShimStartError(f"the hybrid vsock muxer cannot listen: {exc}") from exc
        self._muxer = muxer

    def _start_agent(self) -> _AgentProcess:
        return _AgentProcess(fork_agent(self.run_dir, self.guest_ns_pid))

    async def _health(self, proc: _AgentProcess, timeout: float) -> TtrpcClient:
        """A client on the agent once it answers Health "ok"; ShimStartError if it exits first
        or does not answer in time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last = "no answer"
        while loop.time() < deadline:
            if proc.returncode is not None:
                raise ShimStartError(f"the agent exited with status {proc.returncode}: {last}")
            try:
                stream = await vsock.connect(
                    self.agent_address, timeout=HEALTH_CALL_TIMEOUT_SECONDS
                )
            except (ConnectError, OSError) as exc:
                last = str(exc)
                await asyncio.sleep(HEALTH_RETRY_SECONDS)
                continue
            client = TtrpcClient(stream, name="agent")
            try:
                reply = agent_pb2.HealthResponse.FromString(
                    await client.call(
                        AGENT_SERVICE,
                        "Health",
                        agent_pb2.HealthRequest().SerializeToString(),
                        timeout=HEALTH_CALL_TIMEOUT_SECONDS,
                    )
                )
            except (TtrpcError, DecodeError) as exc:
                last = f"Health: {exc}"
                await client.aclose()
                await asyncio.sleep(HEALTH_RETRY_SECONDS)
                continue
            if reply.status == "ok":
                return client
            last = f"Health says {reply.status!r}"
            await client.aclose()
            await asyncio.sleep(HEALTH_RETRY_SECONDS)
        raise ShimStartError(f"the agent did not become healthy within {timeout:g} s: {last}")

    async def boot(self, agent_pid: int = 0) -> None:
        """Start the muxer and the agent (or take the one forked already, a child of this
        process, `agent_pid`) and wait for the agent's health."""
        proc = self._agent_proc = _AgentProcess(agent_pid) if agent_pid else None
        await self._start_muxer()
        if proc is None:
            proc = self._agent_proc = self._start_agent()
        self.stats.agent_starts += 1
        try:
            self._agent = await self._health(proc, AGENT_BOOT_TIMEOUT_SECONDS)
        except ShimStartError:
            await self._stop_agent()
            raise
        self._agent_running(proc.pid)
        self._spawn_task(self._supervise(), "supervisor")

    async def _supervise(self) -> None:
        """Restart the agent whenever it exits."""
        backoff = RESTART_BACKOFF_SECONDS
        while not self._stopping:
            if self._agent_proc is not None:
                await self._agent_proc.wait()
            if self._stopping:
                return
            self._agent_down("the sandbox agent exited")
            await self._stop_agent()
            await asyncio.sleep(backoff)
            try:
                self._agent_proc = self._start_agent()
                self.stats.agent_starts += 1
                self._agent = await self._health(self._agent_proc, AGENT_BOOT_TIMEOUT_SECONDS)
            except (ShimStartError, OSError) as exc:
                log.error("restarting the agent failed: %s", exc)
                backoff = min(backoff * 2, RESTART_BACKOFF_MAX_SECONDS)
                continue
            backoff = RESTART_BACKOFF_SECONDS
            self._agent_running(self._agent_proc.pid)
            log.info("agent running again as pid %d", self._agent_proc.pid)

    def _agent_running(self, pid: int) -> None:
        try:
            self._agent_ref = process_ref(pid)
        except ProcessLookupError:
            self._agent_ref = None  # already gone: the supervisor restarts it
        self.stats.agent_pid = pid
        self._agent_up.set()

    def _agent_down(self, reason: str) -> None:
        if self._agent_up.is_set():
            log.warning("%s; aborting %d connections", reason, len(self._relays))
        self._agent_up.clear()
        self._agent_ref = None
        self.stats.agent_pid = 0
        for relay in list(self._relays):
            relay.abort()
        if self._agent is not None:
            self._spawn_task(self._agent.aclose(), "close agent client")
            self._agent = None

    async def _stop_agent(self) -> None:
        if self._agent_proc is not None:
            await _stop_child(self._agent_proc)

    async def _agent_client(self) -> TtrpcClient:
        """The agent's client, waiting a little for one that is restarting."""
        try:
            async with asyncio.timeout(AGENT_WAIT_SECONDS):
                await self._agent_up.wait()
        except TimeoutError:
            raise TtrpcError(
                Code.UNAVAILABLE, "sandbox has no agent: it is not running (restarting?)"
            ) from None
        async with self._agent_lock:
            if self._agent is None or self._agent.closed:
                try:
                    stream = await vsock.connect(self.agent_address)
                except (ConnectError, OSError) as exc:
                    raise TtrpcError(Code.UNAVAILABLE, f"sandbox has no agent: {exc}") from exc
                self._agent = TtrpcClient(stream, name="agent")
            return self._agent

    # -- the dial-back pool

    async def _acquire(self, key: tuple[str, int, str]) -> _Pool:
        async with self._pool_lock:
            pool = self._pools.get(key)
            if pool is None:
                if self._free_ports:
                    port = heapq.heappop(self._free_ports)
                else:
                    port, self._next_port = self._next_port, self._next_port + 1
                    self.stats.vsock_ports_allocated += 1
                pool = _Pool(key, port)

                async def arrived(stream: SocketStream, pool: _Pool = pool) -> None:
                    waiter = await self._claim(stream, pool)
                    if waiter is None:
                        return  # its listener closes it
                    arrival = _Arrival(stream)
                    waiter.set_result(arrival)
                    await arrival.done.wait()

                try:
                    pool.listener = await vsock.listen(self.device, arrived, port=port)
                except (OSError, StreamError) as exc:
                    heapq.heappush(self._free_ports, port)
                    raise TtrpcError(
                        Code.INTERNAL, f"cannot listen on {self.device.path}_{port}: {exc}"
                    ) from exc
                self._pools[key] = pool
                self.stats.listeners_opened += 1
                self.stats.listeners_open = len(self._pools)
            pool.refs += 1
            return pool

    async def _claim(self, stream: SocketStream, pool: _Pool) -> asyncio.Future[_Arrival] | None:
        """The request a dial-back connection belongs to, by the nonce it sends first; None
        (logged, counted) for a stray one, which is then closed without a byte of user data."""
        received = b""
        try:
            async with asyncio.timeout(DIAL_BACK_NONCE_TIMEOUT_SECONDS):
                while len(received) < DIAL_BACK_NONCE_BYTES:
                    chunk = await stream.receive(DIAL_BACK_NONCE_BYTES - len(received))
                    if not chunk:
                        break
                    received += chunk
        except (TimeoutError, StreamError):
            pass
        waiter = None
        if len(received) == DIAL_BACK_NONCE_BYTES:
            waiter = pool.waiting.pop(received, None)
        if waiter is None or waiter.done():
            self.stats.stray_dial_backs += 1
            count = self.stats.stray_dial_backs
            if count <= 10 or count & (count - 1) == 0:  # the first ten, then at powers of two
                log.warning(
                    "closed a stray connection to dial-back port %d (%s); %d so far",
                    pool.vsock_port,
                    "no nonce" if len(received) < DIAL_BACK_NONCE_BYTES else "unknown nonce",
                    count,
                )
            return None
        return waiter

    def _release(self, pool: _Pool) -> None:
        pool.refs -= 1
        if pool.refs > 0:
            return
        self._pools.pop(pool.key, None)
        if pool.listener is not None:
            pool.listener.close()
        heapq.heappush(self._free_ports, pool.vsock_port)
        self.stats.listeners_open = len(self._pools)

    # -- the service

    async def port_forward(self, payload: bytes, context: RequestContext) -> bytes:
        try:
            request = shim_pb2.PortForwardRequest.FromString(payload)
        except DecodeError as exc:
            raise TtrpcError(Code.INVALID_ARGUMENT, f"bad PortForwardRequest: {exc}") from exc
        if not 1 <= request.port <= 65535:
            raise TtrpcError(Code.INVALID_ARGUMENT, f"invalid port {request.port}")
        protocol = request.protocol or "tcp"
        if protocol not in ("tcp", "udp"):
            raise TtrpcError(Code.INVALID_ARGUMENT, f"invalid protocol {request.protocol!r}")
        try:
            addr = vsock.parse_address(request.addr)
        except vsock.AddressError as exc:
            raise TtrpcError(Code.INVALID_ARGUMENT, str(exc)) from exc
        if addr.scheme is not vsock.Scheme.UNIX:
            raise TtrpcError(Code.INVALID_ARGUMENT, f"addr {request.addr!r} is not unix://PATH")
        agent = await self._agent_client()
        pool = await self._acquire((request.id, request.port, protocol))
        response = shim_pb2.PortForwardResponse()
        relayed = False
        arrival: _Arrival | None = None
        try:
            arrival = await self._ask_agent(agent, request, protocol, pool)
            response.agent_generation = self.stats.agent_starts
            if request.hand_over and arrival.stream.can_hand_over():
                # An agent that has exited since leaves a socket at EOF: the caller's check
                # at EOF (the generation above) reads that as broken.
                await self._hand_over(arrival.stream, addr.path, request.addr)
                response.handed_over = True
            else:
                try:
                    runtime_side = await vsock.connect(addr)
                except (ConnectError, OSError) as exc:
                    raise TtrpcError(
                        Code.ABORTED, f"cannot dial back to {request.addr}: {exc}"
                    ) from exc
                relay = _Relay(arrival.stream, runtime_side)
                if not self._agent_up.is_set():
                    relay.abort()
                self._spawn_task(self._run_relay(relay, arrival, pool), f"relay {request.port}")
                relayed = True
        finally:
            if not relayed:
                if arrival is not None:
                    arrival.done.set()  # its listener closes it (our descriptor only, if passed)
                self._release(pool)
        return response.SerializeToString()

    async def _hand_over(self, agent_side: SocketStream, path: str, shown: str) -> None:
        """Pass the agent's connection to the caller listening on `path`: the bytes then go
        from the caller to the agent with no copy in this process."""
        loop = asyncio.get_running_loop()
        channel = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            channel.setblocking(False)
            try:
                await loop.sock_connect(channel, path)
            except OSError as exc:
                raise TtrpcError(Code.ABORTED, f"cannot dial back to {shown}: {exc}") from exc
            sock, pending, _ = agent_side.take_socket(give_away=True)
            try:
                await fdpass.send_socket(channel, sock, pending)
            except fdpass.HandOverError as exc:
                raise TtrpcError(Code.ABORTED, f"cannot hand over to {shown}: {exc}") from exc
            finally:
                sock.close()
        finally:
            channel.close()
        self.stats.connections_handed_over += 1

    async def _ask_agent(
        self,
        agent: TtrpcClient,
        request: shim_pb2.PortForwardRequest,
        protocol: str,
        pool: _Pool,
    ) -> _Arrival:
        nonce = secrets.token_bytes(DIAL_BACK_NONCE_BYTES)
        waiter: asyncio.Future[_Arrival] = asyncio.get_running_loop().create_future()
        pool.waiting[nonce] = waiter  # before the agent is asked: it may dial back at once
        try:
            return await self._call_agent(agent, request, protocol, pool, nonce, waiter)
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                waiter.result().done.set()  # paired, but this call failed: its listener closes it
            raise
        finally:
            pool.waiting.pop(nonce, None)
            if not waiter.done():
                waiter.cancel()

    async def _call_agent(
        self,
        agent: TtrpcClient,
        request: shim_pb2.PortForwardRequest,
        protocol: str,
        pool: _Pool,
        nonce: bytes,
        waiter: asyncio.Future[_Arrival],
    ) -> _Arrival:
        message = agent_pb2.PortForwardRequest(
            container_id=request.id,
            port=request.port,
            vsock_port=pool.vsock_port,
            protocol="" if protocol == "tcp" else protocol,
            nonce=nonce,
        )
        self.stats.agent_port_forwards += 1
        try:
            reply = await agent.call(
                AGENT_SERVICE,
                "PortForward",
                message.SerializeToString(),
                timeout=AGENT_CALL_TIMEOUT_SECONDS,
            )
        except TtrpcClosedError as exc:
            raise TtrpcError(
                Code.UNAVAILABLE, f"sandbox has no agent: lost the connection ({exc.message})"
            ) from exc
        except TtrpcError as exc:
            if exc.code == Code.DEADLINE_EXCEEDED:
                raise TtrpcError(
                    Code.DEADLINE_EXCEEDED,
                    f"timeout: the agent did not answer within {AGENT_CALL_TIMEOUT_SECONDS:g} s",
                ) from exc
            if exc.code == Code.UNIMPLEMENTED:
                raise TtrpcError(
                    Code.UNAVAILABLE, f"sandbox has no agent that forwards ports: {exc.message}"
                ) from exc
            if exc.code == Code.INVALID_ARGUMENT:
                raise
            if exc.message.startswith(AGENT_DIAL_BACK_FAILED):
                raise TtrpcError(
                    Code.INTERNAL, f"the agent could not dial back: {exc.message}"
                ) from exc
            # The agent connects to the port before it dials back: anything else is the port.
            raise TtrpcError(
                Code.FAILED_PRECONDITION,
                f"port {request.port} refused inside the sandbox: {exc.message}",
            ) from exc
        try:
            async with asyncio.timeout(DIAL_BACK_TIMEOUT_SECONDS):
                arrival = await asyncio.shield(waiter)
        except TimeoutError:
            raise TtrpcError(
                Code.DEADLINE_EXCEEDED,
                f"timeout: the agent did not connect back on vsock port {pool.vsock_port} "
                f"within {DIAL_BACK_TIMEOUT_SECONDS:g} s",
            ) from None
        if protocol != "tcp" and _answered_protocol(reply) != protocol:
            # An agent that ignored the field connected TCP: never hand that on as UDP.
            arrival.done.set()
            raise TtrpcError(
                Code.UNIMPLEMENTED, f"the sandbox agent does not support {protocol} port-forward"
            )
        return arrival

    async def _run_relay(self, relay: _Relay, arrival: _Arrival, pool: _Pool) -> None:
        self._relays.add(relay)
        self.stats.connections_active = len(self._relays)
        try:
            await relay.run()
        finally:
            self._relays.discard(relay)
            self.stats.connections_active = len(self._relays)
            arrival.done.set()
            self._release(pool)

    async def get_stats(self, payload: bytes, context: RequestContext) -> bytes:
        stats = self.stats
        if self._agent_ref is None or is_exiting(self._agent_ref):
            # Killed but not yet reaped: the kernel closes its sockets (which a caller may
            # already have read as EOF) before the supervisor hears of the exit.
            stats = shim_pb2.StatsResponse()
            stats.CopyFrom(self.stats)
            stats.agent_pid = 0
        return stats.SerializeToString()

    def _spawn_task(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        self._tasks.spawn(coro, name=name)

    async def stop(self) -> None:
        self._stopping = True
        for relay in list(self._relays):
            relay.abort()
        for pool in list(self._pools.values()):
            pool.refs = 1
            self._release(pool)
        if self._agent is not None:
            await self._agent.aclose()
        await self._stop_agent()
        if self._muxer_listener is not None:
            self._muxer_listener.close()
        if self._muxer is not None:
            await self._muxer.aclose()
        await self._tasks.aclose()


def _answered_protocol(reply: bytes) -> str:
    try:
        return agent_pb2.PortForwardResponse.FromString(reply).protocol or "tcp"
    except DecodeError:
        return ""


async def _stop_child(proc: _AgentProcess) -> None:
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        async with asyncio.timeout(CHILD_STOP_SECONDS):
            await proc.wait()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


# --------------------------------------------------------------------------- the process


@dataclass(slots=True)
class _Args:
    dir: str = ""
    ready_file: str = ""
    hostname: str = ""
    adopt_guest: str = ""
    foreground: bool = False
    verbose: bool = False


_USAGE: Final = (
    "usage: python -m podgate.runtime.sandbox.shim --dir DIR [--ready-file FILE] "
    "[--hostname H] [--adopt-guest HOLDER_PID:START:NS_PID:START] [--foreground] [-v]"
)
_VALUED: Final = {"--dir": "dir", "--ready-file": "ready_file", "--hostname": "hostname"}
_VALUED_ADOPT: Final = "--adopt-guest"


def _parse_args(argv: Sequence[str]) -> _Args:
    """Not argparse: a parser's objects would cost a forked shim pages it otherwise shares with
    its forker (see podgate.linux.shim)."""
    args, rest = _Args(), list(argv)
    while rest:
        arg = rest.pop(0)
        name, eq, value = arg.partition("=")
        if name in (*_VALUED, _VALUED_ADOPT):
            if not eq:
                if not rest:
                    raise ValueError(f"{name} needs a value")
                value = rest.pop(0)
            setattr(args, _VALUED.get(name, "adopt_guest"), value)
        elif arg == "--foreground":
            args.foreground = True
        elif arg in ("-v", "--verbose"):
            args.verbose = True
        else:
            raise ValueError(f"unexpected argument {arg!r}")
    if not args.dir:
        raise ValueError("--dir DIR is required")
    args.dir = os.path.abspath(args.dir)
    args.ready_file = args.ready_file or os.path.join(args.dir, "sandbox.json")
    return args


def _parse_adopt(text: str) -> tuple[ProcessRef, ProcessRef]:
    parts = text.split(":")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        raise ShimStartError(f"--adopt-guest {text!r}: want HOLDER_PID:START:NS_PID:START")
    numbers = [int(p) for p in parts]
    return ProcessRef(numbers[0], numbers[1]), ProcessRef(numbers[2], numbers[3])


def _guest(args: _Args) -> tuple[ProcessRef, ProcessRef, bool]:
    """(holder, namespace process, started by us) of the guest: one process, the guest's PID 1,
    unless adopted from a shim of an older podgate (a holder and its PID 1 child)."""
    if args.adopt_guest:
        holder, ns_process = _parse_adopt(args.adopt_guest)
        if not (is_alive(holder) and is_alive(ns_process)):
            raise ShimStartError("the sandbox's guest is gone; nothing to adopt")
        return holder, ns_process, False
    try:
        empty_root = os.path.join(args.dir, "guest-root")
        os.makedirs(empty_root, mode=0o755, exist_ok=True)
        pid_one = pidone.start(args.hostname, empty_root)
    except OSError as exc:
        raise ShimStartError(f"the guest did not start: {exc}") from exc
    return pid_one, pid_one, True


def _fail(args: _Args, exc: BaseException, started_guest: ProcessRef | None) -> int:
    message = f"sandbox shim: {exc}"
    log.error("%s", message)
    if started_guest is not None:
        signal_process(started_guest, signal.SIGKILL)  # its PID 1: the guest ends
    atomic_write_json(args.ready_file, {"error": message})
    return 1


async def _run(args: _Args, holder: ProcessRef, ns_process: ProcessRef, agent_pid: int) -> int:
    run_dir = Path(args.dir)
    socket_path = str(run_dir / "shim.sock")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    shim = SandboxShim(run_dir, ns_process.pid)
    try:
        await shim.boot(agent_pid)
    except (ShimStartError, OSError) as exc:
        await shim.stop()
        return _fail(args, exc, None if args.adopt_guest else ns_process)
    server = TtrpcServer(name="sandbox shim")
    server.register(SHIM_SERVICE, {"PortForward": shim.port_forward, "Stats": shim.get_stats})
    listener = await server.listen_unix(socket_path)
    me = process_ref(os.getpid())
    atomic_write_json(
        args.ready_file,
        {
            "shim": {"pid": me.pid, "start_time": me.start_time},
            "guest_holder": {"pid": holder.pid, "start_time": holder.start_time},
            "guest_ns_process": {"pid": ns_process.pid, "start_time": ns_process.start_time},
        },
    )
    log.info("sandbox in %s ready: guest pid %d, shim on %s", run_dir, ns_process.pid, socket_path)
    _trim_heap()
    try:
        await stop.wait()
    finally:
        listener.close()
        await server.aclose()
        await shim.stop()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)
    log.info("stopped")
    return 0


def _setup_logging(verbose: bool, stream: TextIO | None = None) -> None:
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)


async def _warm_boot(scratch: Path) -> None:
    """An agent, a muxer and Health calls through them, in `scratch`."""
    device = vsock.parse_address(f"hvsock://{scratch / 'v.sock'}")
    agent = asyncio.create_task(
        agent_mod.serve(
            vsock.parse_address(f"unix://{scratch / 'guest.vsock'}_{AGENT_VSOCK_PORT}"), device
        ),
        name="warm agent",
    )
    muxer = Muxer(str(scratch / "guest.vsock"))
    listener = await muxer.listen(device.path)
    try:
        for _ in range(WARM_ROUNDS):
            try:
                stream = await vsock.connect(device.with_port(AGENT_VSOCK_PORT))
            except (ConnectError, OSError):
                await asyncio.sleep(HEALTH_RETRY_SECONDS)  # the agent is not listening yet
                continue
            client = TtrpcClient(stream, name="agent")
            try:
                await client.call(
                    AGENT_SERVICE,
                    "Health",
                    agent_pb2.HealthRequest().SerializeToString(),
                    timeout=HEALTH_CALL_TIMEOUT_SECONDS,
                )
            finally:
                await client.aclose()
    finally:
        listener.close()
        await muxer.aclose()
        await cancel_and_wait(agent)


def warm(scratch: str) -> None:
    """What a forker runs once before it forks shims: logging set up, the agent's loop imported,
    an agent and a muxer answering Health calls in `scratch`: the code they run is quickened and
    what they create lazily exists, in pages the shims and agents then share. Nothing stays
    running."""
    with open(os.devnull, "w", encoding="utf-8") as devnull:
        _setup_logging(False, devnull)  # the lines of a boot formatted, and dropped
        with contextlib.suppress(TimeoutError, OSError, StreamError, TtrpcError):
            asyncio.run(asyncio.wait_for(_warm_boot(Path(scratch)), WARM_TIMEOUT_SECONDS))
        logging.getLogger().handlers.clear()
    # Imported, not run: a libuv loop would leave at-fork handlers that close descriptors by
    # number in every process forked from here.
    with contextlib.suppress(ImportError):
        import uvloop  # noqa: F401 - the agent's loop (podgate.aio.loop.run)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parse_args(sys.argv[1:] if argv is None else argv)
    except ValueError as exc:
        print(f"{_USAGE}\nerror: {exc}", file=sys.stderr)
        return 2
    _setup_logging(args.verbose)
    if not args.foreground and os.fork() != 0:
        os._exit(0)
    _prctl(_PR_SET_NAME, b"podgate-sbxshim", 0, 0, 0)
    # The guest and the first agent before the event loop: the agent is forked while this
    # process still shares nearly every page with its forker.
    started_guest: ProcessRef | None = None
    try:
        holder, ns_process, ours = _guest(args)
        started_guest = ns_process if ours else None
        agent_pid = fork_agent(Path(args.dir), ns_process.pid)
    except (ShimStartError, OSError) as exc:
        return _fail(args, exc, started_guest)
    return asyncio.run(_run(args, holder, ns_process, agent_pid))


if __name__ == "__main__":
    sys.exit(main())
