"""Helpers for the sandboxed-runtime suite (imported by module name; keep the name unique).

Builds on the runtime suite's helpers: a `podgate runtime` child process per fixture, pods made
through CRI, podgate's own port-forward client. Sandboxed pods have more processes than the
runtime suite's cleanup knows (the sandbox shim, the guest holder): those are SIGKILLed by the
identity recorded in the pod records too, never by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime_e2e_support import (
    POD_NAMESPACE,
    POLL_SECONDS,
    READY_LINE,
    READY_TIMEOUT_SECONDS,
    WAIT_SECONDS,
    Pod,
    Pods,
    RuntimeDaemon,
    kill_recorded_processes,
    new_state_root,
    stream_target,
)

from podgate.aio import fdpass
from podgate.aio.streams import ByteStream, SocketStream
from podgate.aio.ttrpc import TtrpcClient
from podgate.cri import api_pb2 as pb
from podgate.cri import api_pb2_grpc as pb_grpc
from podgate.linux.proc import signal_process
from podgate.model import ProcessRef
from podgate.runtime.store import Store
from podgate.shimapi import shim_pb2
from podgate.streaming.client import ForwardedStream, PortForwardSession

SANDBOXED = "sandboxed"
MIB = 1024 * 1024
TRANSFER_CHUNK = MIB
# Bound on one large transfer through every hop (client, runtime, shim, agent, server).
TRANSFER_TIMEOUT_SECONDS = 120.0
# Process refs a sandboxed pod keeps in PodRecord.extra.
EXTRA_REFS = ("sandbox_shim", "guest_holder", "guest_ns_process")


def start_daemon(state_dir: Path, output: Path, extra_args: Sequence[str] = ()) -> RuntimeDaemon:
    """`podgate runtime --state-dir STATE [extra_args]`, once it printed its ready line."""
    with open(output, "ab") as out:
        start_offset = out.tell()
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "podgate",
                "runtime",
                "--state-dir",
                str(state_dir),
                *extra_args,
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
        )
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    while True:
        text = output.read_bytes()[start_offset:].decode(errors="replace")
        found = READY_LINE.search(text)
        if found is not None:
            return RuntimeDaemon(state_dir, process, found["cri"], found["streaming"], output)
        if process.poll() is not None or time.monotonic() >= deadline:
            if process.poll() is None:
                process.kill()
            process.wait()
            raise RuntimeError(f"podgate runtime did not get ready:\n{text[-4000:]}")
        time.sleep(POLL_SECONDS)


def kill_sandbox_processes(state_dir: Path) -> None:
    """SIGKILL the sandbox shims and guests recorded in `state_dir`'s pod records."""
    for path in sorted((state_dir / "pods").glob("*.json")):
        try:
            extra = json.loads(path.read_text()).get("extra", {})
        except (OSError, ValueError):
            continue
        for key in EXTRA_REFS:
            ref = extra.get(key)
            if ref:
                signal_process(ProcessRef(**ref), signal.SIGKILL)


@contextlib.contextmanager
def sandbox_daemon(extra_args: Sequence[str] = ()) -> Iterator[RuntimeDaemon]:
    """A daemon on a fresh state root; on exit its pods are removed, it gets SIGTERM, and
    anything left is killed by recorded identity."""
    root = new_state_root()
    daemon = None
    try:
        daemon = start_daemon(root / "s", root / "daemon.log", extra_args)
        yield daemon
    finally:
        try:
            if daemon is not None:
                try:
                    daemon.remove_all_pods()
                finally:
                    daemon.terminate()
        finally:
            kill_sandbox_processes(root / "s")
            kill_recorded_processes(root / "s")
            shutil.rmtree(root, ignore_errors=True)


async def run_pod(pods: Pods, name: str, handler: str = SANDBOXED) -> Pod:
    """A pod of `handler` made through CRI (removed with the others `pods` made)."""
    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(
            name=name, namespace=POD_NAMESPACE, uid=uuid.uuid4().hex, attempt=0
        ),
        hostname=name,
    )
    response = await pods.rt.RunPodSandbox(
        pb.RunPodSandboxRequest(config=config, runtime_handler=handler)
    )
    pods.created.append(response.pod_sandbox_id)
    return Pod(response.pod_sandbox_id, config)


async def pod_info(rt: pb_grpc.RuntimeServiceStub, pod: Pod) -> dict[str, Any]:
    """The verbose PodSandboxStatus info document (pid, extra, ...)."""
    status = await rt.PodSandboxStatus(
        pb.PodSandboxStatusRequest(pod_sandbox_id=pod.id, verbose=True)
    )
    info: dict[str, Any] = json.loads(status.info["info"])
    return info


def run_dir(daemon: RuntimeDaemon, pod: Pod) -> Path:
    return Store(daemon.state_dir).run_path(pod.id)


async def shim_stats(daemon: RuntimeDaemon, pod: Pod) -> shim_pb2.StatsResponse:
    """The sandbox shim's counters, asked on its own socket."""
    async with await TtrpcClient.connect_unix(str(run_dir(daemon, pod) / "shim.sock")) as client:
        reply = await client.call("podgate.shim.v1.Shim", "Stats", b"", timeout=10)
    return shim_pb2.StatsResponse.FromString(reply)


async def port_forward(
    rt: pb_grpc.RuntimeServiceStub, pod: Pod, ports: Sequence[int]
) -> PortForwardSession:
    url = (await rt.PortForward(pb.PortForwardRequest(pod_sandbox_id=pod.id, port=ports))).url
    endpoint, path = stream_target(url)
    return await PortForwardSession.connect(endpoint, path)


@dataclass
class Transfer:
    """What one echo transfer sent and got back."""

    sent: int
    received: int
    sent_sha256: str
    received_sha256: str
    error: str


async def echo_transfer(
    forwarded: ForwardedStream, total: int, *, chunk: int = TRANSFER_CHUNK
) -> Transfer:
    """Send `total` random bytes through an echo server while reading the echo; both hashed."""
    transfer = await echo_stream(forwarded.data, total, chunk=chunk)
    transfer.error = await forwarded.error()
    return transfer


async def echo_stream(stream: ByteStream, total: int, *, chunk: int = TRANSFER_CHUNK) -> Transfer:
    """echo_transfer over any byte stream (no error stream: `error` stays empty)."""
    sent, received = hashlib.sha256(), hashlib.sha256()
    counts = [0, 0]

    async def upload() -> None:
        for _ in range(total // chunk):
            data = os.urandom(chunk)
            sent.update(data)
            await stream.send(data)
            counts[0] += len(data)
        await stream.send_eof()

    async def download() -> None:
        while data := await stream.receive():
            received.update(data)
            counts[1] += len(data)

    async with asyncio.timeout(TRANSFER_TIMEOUT_SECONDS), asyncio.TaskGroup() as group:
        group.create_task(upload())
        group.create_task(download())
    return Transfer(counts[0], counts[1], sent.hexdigest(), received.hexdigest(), "")


async def shim_forward(
    daemon: RuntimeDaemon, pod: Pod, port: int, *, hand_over: bool, protocol: str = ""
) -> tuple[SocketStream, shim_pb2.PortForwardResponse]:
    """One PortForward asked of the pod's shim directly, as containerd PR #4814's caller asks
    (plus `hand_over`): listen on a unix socket, call, accept the shim's connection; when the
    reply says handed over, the agent's socket passed over that connection."""
    path = run_dir(daemon, pod) / f"t-{uuid.uuid4().hex[:8]}.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        listener.bind(str(path))
        listener.listen(1)
        listener.setblocking(False)
        request = shim_pb2.PortForwardRequest(
            id=pod.id, port=port, addr=f"unix://{path}", protocol=protocol, hand_over=hand_over
        )
        shim = str(run_dir(daemon, pod) / "shim.sock")
        async with await TtrpcClient.connect_unix(shim) as client:
            reply = shim_pb2.PortForwardResponse.FromString(
                await client.call(
                    "podgate.shim.v1.Shim", "PortForward", request.SerializeToString(), timeout=30
                )
            )
        async with asyncio.timeout(WAIT_SECONDS):
            conn, _ = await asyncio.get_running_loop().sock_accept(listener)
            if reply.handed_over:
                with conn as channel:
                    channel.setblocking(False)
                    conn, pending = await fdpass.receive_socket(channel)
                assert pending == b""  # an echo server sends nothing first
    finally:
        listener.close()
        path.unlink(missing_ok=True)
    return await SocketStream.from_socket(conn), reply


def socket_count(pid: int) -> int:
    """How many sockets process `pid` has open."""
    count = 0
    for entry in os.scandir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            count += os.readlink(entry.path).startswith("socket:")
    return count
