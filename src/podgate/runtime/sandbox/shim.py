"""The sandbox shim: one per pod of the `sandboxed` handler. It boots the pod's "VM" and serves
the shim-level PortForward API (containerd PR #4814's shape) on top of an in-guest agent.

Run as `python -m podgate.runtime.sandbox.shim --dir DIR --ready-file FILE [--hostname H]
[--adopt-guest HOLDER_PID:START:NS_PID:START]`. It daemonizes (the first process exits at once),
then:

1. starts the guest, a second pod holder with its own network, UTS, IPC and PID namespaces (or,
   with --adopt-guest, takes over the guest of a shim that died);
2. starts the hybrid-vsock muxer (the VMM's host side) on DIR/v.sock and the agent inside the
   guest's namespaces, listening on guest vsock port 1024;
3. waits for the agent's Health over hybrid vsock;
4. serves `podgate.shim.v1.Shim` over ttrpc on DIR/shim.sock and writes the ready file.

The muxer and the agent die with the shim (PR_SET_PDEATHSIG); the guest does not, so containers
outlive a shim crash. When the agent or the muxer exits, connections through them are aborted
and both are started again.

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

import argparse
import asyncio
import contextlib
import ctypes
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
from typing import Any, Final

from google.protobuf.message import DecodeError

from podgate.agent import agent_pb2
from podgate.aio import fdpass
from podgate.aio.errors import ConnectError, StreamError
from podgate.aio.ksplice import splice_sockets
from podgate.aio.splice import splice
from podgate.aio.streams import DEFAULT_RECEIVE_BYTES, Buffer, ByteStream, SocketStream
from podgate.aio.tasks import TaskSet
from podgate.aio.ttrpc import RequestContext, TtrpcClient, TtrpcClosedError, TtrpcServer
from podgate.linux import holder as holder_mod
from podgate.linux import vsock
from podgate.linux.proc import (
    SpawnError,
    atomic_write_json,
    is_alive,
    is_exiting,
    process_ref,
    wait_ready_file,
)
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
# A fresh agent is an interpreter start inside the guest plus a listen, seconds.
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
# Grace for the agent and muxer after SIGTERM before SIGKILL, seconds.
CHILD_STOP_SECONDS: Final = 2.0
VMM_START_TIMEOUT_SECONDS: Final = 15.0
NSENTER: Final = "/usr/bin/nsenter"

_PR_SET_PDEATHSIG: Final = 1
_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl


def _die_with_parent() -> None:
    # Runs in the forked child before exec: nothing but the one syscall.
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _source_root() -> str:
    import podgate

    return os.path.dirname(os.path.dirname(os.path.abspath(podgate.__file__)))


class ShimStartError(Exception):
    """The sandbox could not be booted; the message goes to the ready file."""


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
        self._agent_proc: asyncio.subprocess.Process | None = None
        # The running agent, once healthy: Stats checks it is not exiting (see get_stats).
        self._agent_ref: ProcessRef | None = None
        self._vmm_proc: asyncio.subprocess.Process | None = None
        self._agent: TtrpcClient | None = None
        self._agent_up = asyncio.Event()
        self._agent_lock = asyncio.Lock()
        self._stopping = False

    # -- the guest's processes

    async def _spawn(self, argv: list[str], log_name: str) -> asyncio.subprocess.Process:
        env = dict(os.environ)
        root = _source_root()
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        log_fd = os.open(
            self.run_dir / log_name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644
        )
        try:
            return await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=log_fd,
                env=env,
                preexec_fn=_die_with_parent,
            )
        finally:
            os.close(log_fd)

    async def _start_vmm(self) -> asyncio.subprocess.Process:
        ready = self.run_dir / "vmm.json"
        with contextlib.suppress(FileNotFoundError):
            ready.unlink()
        proc = await self._spawn(
            [
                sys.executable,
                "-m",
                "podgate.linux.vmm",
                "--uds",
                self.device.path,
                "--guest-prefix",
                str(self.run_dir / "guest.vsock"),
                "--ready-file",
                str(ready),
            ],
            "vmm.log",
        )
        try:
            await wait_ready_file(
                str(ready), VMM_START_TIMEOUT_SECONDS, str(self.run_dir / "vmm.log")
            )
        except SpawnError as exc:
            await _stop_child(proc)
            raise ShimStartError(f"the hybrid vsock muxer did not start: {exc}") from exc
        return proc

    async def _start_agent(self) -> asyncio.subprocess.Process:
        guest = f"/proc/{self.guest_ns_pid}/ns"
        with contextlib.suppress(FileNotFoundError):
            (self.run_dir / f"guest.vsock_{AGENT_VSOCK_PORT}").unlink()
        return await self._spawn(
            [
                NSENTER,
                f"--net={guest}/net",
                f"--uts={guest}/uts",
                f"--ipc={guest}/ipc",
                "--",
                sys.executable,
                "-m",
                "podgate",
                "agent",
                "serve",
                "--listen",
                f"unix://{self.run_dir / 'guest.vsock'}_{AGENT_VSOCK_PORT}",
                "--host",
                str(self.device),
            ],
            "agent.log",
        )

    async def _health(self, proc: asyncio.subprocess.Process, timeout: float) -> TtrpcClient:
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

    async def boot(self) -> None:
        """Start the muxer and the agent and wait for the agent's health."""
        self._vmm_proc = await self._start_vmm()
        self._agent_proc = await self._start_agent()
        self.stats.agent_starts += 1
        try:
            self._agent = await self._health(self._agent_proc, AGENT_BOOT_TIMEOUT_SECONDS)
        except ShimStartError:
            await self._stop_vm()
            raise
        self._agent_running(self._agent_proc.pid)
        self._spawn_task(self._supervise(), "supervisor")

    async def _supervise(self) -> None:
        """Restart the muxer and the agent whenever either exits."""
        backoff = RESTART_BACKOFF_SECONDS
        while not self._stopping:
            waits = {
                asyncio.ensure_future(p.wait())
                for p in (self._agent_proc, self._vmm_proc)
                if p is not None
            }
            if waits:
                _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for waiter in pending:
                    waiter.cancel()
            if self._stopping:
                return
            self._agent_down("the sandbox agent exited")
            await self._stop_vm()
            await asyncio.sleep(backoff)
            try:
                self._vmm_proc = await self._start_vmm()
                self._agent_proc = await self._start_agent()
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

    async def _stop_vm(self) -> None:
        for proc in (self._agent_proc, self._vmm_proc):
            if proc is not None:
                await _stop_child(proc)

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
        await self._stop_vm()
        await self._tasks.aclose()


def _answered_protocol(reply: bytes) -> str:
    try:
        return agent_pb2.PortForwardResponse.FromString(reply).protocol or "tcp"
    except DecodeError:
        return ""


async def _stop_child(proc: asyncio.subprocess.Process) -> None:
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


def _parse_adopt(text: str) -> tuple[ProcessRef, ProcessRef]:
    parts = text.split(":")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        raise ShimStartError(f"--adopt-guest {text!r}: want HOLDER_PID:START:NS_PID:START")
    numbers = [int(p) for p in parts]
    return ProcessRef(numbers[0], numbers[1]), ProcessRef(numbers[2], numbers[3])


async def _guest(args: argparse.Namespace, run_dir: Path) -> tuple[ProcessRef, ProcessRef, bool]:
    """(holder, namespace process, started by us) of the guest."""
    if args.adopt_guest:
        holder, ns_process = _parse_adopt(args.adopt_guest)
        if not (is_alive(holder) and is_alive(ns_process)):
            raise ShimStartError("the sandbox's guest is gone; nothing to adopt")
        return holder, ns_process, False
    try:
        holder, ns_process = await holder_mod.start_holder(
            hostname=args.hostname,
            pid_ns=True,
            ready_file=str(run_dir / "guest.json"),
            log_file=str(run_dir / "guest.log"),
        )
    except holder_mod.HolderError as exc:
        raise ShimStartError(f"the guest did not start: {exc}") from exc
    return holder, ns_process, True


async def _run(args: argparse.Namespace) -> int:
    run_dir = Path(args.dir)
    ready_file = args.ready_file or str(run_dir / "sandbox.json")
    socket_path = str(run_dir / "shim.sock")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    started_guest: ProcessRef | None = None
    try:
        holder, ns_process, ours = await _guest(args, run_dir)
        started_guest = holder if ours else None
        shim = SandboxShim(run_dir, ns_process.pid)
        await shim.boot()
    except (ShimStartError, OSError) as exc:
        message = f"sandbox shim: {exc}"
        log.error("%s", message)
        if started_guest is not None:
            await holder_mod.stop_holder(started_guest)
        atomic_write_json(ready_file, {"error": message})
        return 1
    server = TtrpcServer(name="sandbox shim")
    server.register(SHIM_SERVICE, {"PortForward": shim.port_forward, "Stats": shim.get_stats})
    listener = await server.listen_unix(socket_path)
    me = process_ref(os.getpid())
    atomic_write_json(
        ready_file,
        {
            "shim": {"pid": me.pid, "start_time": me.start_time},
            "guest_holder": {"pid": holder.pid, "start_time": holder.start_time},
            "guest_ns_process": {"pid": ns_process.pid, "start_time": ns_process.start_time},
        },
    )
    log.info("sandbox in %s ready: guest pid %d, shim on %s", run_dir, ns_process.pid, socket_path)
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m podgate.runtime.sandbox.shim")
    parser.add_argument("--dir", required=True, help="the pod's run directory")
    parser.add_argument("--ready-file", default="", help="default: DIR/sandbox.json")
    parser.add_argument("--hostname", default="", help="the guest's hostname")
    parser.add_argument(
        "--adopt-guest", default="", help="HOLDER_PID:START:NS_PID:START of a running guest"
    )
    parser.add_argument("--foreground", action="store_true", help="do not fork away")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    args.dir = os.path.abspath(args.dir)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not args.foreground and os.fork() != 0:
        os._exit(0)
    return asyncio.run(_run(args))


if __name__ == "__main__":
    sys.exit(main())
