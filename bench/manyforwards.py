"""Thousands of concurrent forwards to one pod through the gateway (issue: "performance").

`podgate up` (runtime and gateway in one process) runs one pod with an echo server; USERS
users, each with a token and a policy rule allowing port-forward to it, each run one kubectl
1.33 `port-forward` process. Through each, this process opens PER_USER TCP connections at once;
every connection sends its own random payload and checks the echo by sha256, and all of them
stay open until every one has been checked, then all are closed. Reported: connections that
succeeded, the time from the first connect to the last check, and the resident memory of the
gateway+runtime process and of the kubectl processes while everything is open.

The client side is also what the bounded test (tests/gateway/test_gateway_many_forwards.py)
runs: `hold_connections`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from rich.console import Console

from bench.portforward import find_kubectl
from bench.procs import Child, ChildError, ProcessSet
from bench.report import SectionTables, markdown_tables, print_tables

USERS: Final = 4
PER_USER: Final = 1000
ECHO_PORT: Final = 7000
# Bytes of random payload each connection sends and expects back.
PAYLOAD_BYTES: Final = 64
# Bound on the whole exchange of one user's connections, and on `podgate up` starting.
HOLD_TIMEOUT_SECONDS: Final = 300.0
READY_TIMEOUT_SECONDS: Final = 120.0
FORWARD_READY_SECONDS: Final = 30.0
# How long `podgate up` may take to remove its pod and exit after SIGTERM.
UP_STOP_SECONDS: Final = 60.0
# Descriptors the bench and its children may open: each connection costs one here, one in
# kubectl, a socket and a splice pipe or two in the runtime, and one in the pod.
NOFILE: Final = 65536
# Connects in flight at once per user: kubectl accepts one connection at a time and opens its
# stream pair before the next, so more only fill its listen backlog.
CONNECTS_IN_FLIGHT: Final = 256

# One thread, selectors: thousands of held connections cost a few MB, not a thread each.
ECHO_SERVER: Final = r"""
import os, selectors, signal, socket
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
sel = selectors.DefaultSelector()
server = socket.create_server(("127.0.0.1", PORT), backlog=4096)
server.setblocking(False)
sel.register(server, selectors.EVENT_READ)
while True:
    for key, _ in sel.select():
        if key.fileobj is server:
            while True:
                try:
                    conn, _ = server.accept()
                except BlockingIOError:
                    break
                conn.setblocking(True)
                sel.register(conn, selectors.EVENT_READ)
            continue
        conn = key.fileobj
        try:
            data = conn.recv(65536)
        except OSError:
            data = b""
        if data:
            conn.sendall(data)
        else:
            sel.unregister(conn)
            conn.close()
"""
READY_LINE: Final = re.compile(r"podgate ready api=(\S+) kubeconfig=(\S+)")
FORWARDING: Final = re.compile(rb"Forwarding from 127\.0\.0\.1:(\d+) ->")


@dataclass(slots=True)
class Held:
    """What `hold_connections` saw: connections whose echo matched, the failures, time."""

    ok: int = 0
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0


class _Barrier:
    """Counts connections that finished their check (or failed); wakes the run when all have."""

    def __init__(self, total: int) -> None:
        self.left = total
        self.everyone = asyncio.Event()  # every connection checked or failed
        self.release = asyncio.Event()  # close now

    def arrive(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.everyone.set()


async def _one(port: int, gate: asyncio.Semaphore, barrier: _Barrier, held: Held) -> None:
    arrived = False
    try:
        async with gate:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            payload = os.urandom(PAYLOAD_BYTES)
            writer.write(payload)
            echoed = await reader.readexactly(len(payload))
            if hashlib.sha256(echoed).digest() != hashlib.sha256(payload).digest():
                raise AssertionError("echo differs from the payload")
            held.ok += 1
            arrived = True
            barrier.arrive()
            await barrier.release.wait()  # held open until every connection is checked
        finally:
            writer.close()
    except Exception as exc:  # every failure is counted and shown
        held.failures.append(f"{type(exc).__name__}: {exc}")
        if not arrived:
            barrier.arrive()


async def hold_connections(ports: Sequence[int], per_port: int, timeout: float) -> list[Held]:
    """`per_port` connections to each local port, all open at once, each echo sha256-checked;
    closed only after every one has been checked (or has failed)."""
    results = [Held() for _ in ports]
    barrier = _Barrier(len(ports) * per_port)
    started = time.monotonic()
    tasks = []
    for held, port in zip(results, ports, strict=True):
        gate = asyncio.Semaphore(CONNECTS_IN_FLIGHT)
        tasks += [asyncio.create_task(_one(port, gate, barrier, held)) for _ in range(per_port)]
    try:
        async with asyncio.timeout(timeout):
            await barrier.everyone.wait()
    except TimeoutError:
        for held in results:
            held.failures.append(f"not all checked within {timeout:g} s")
    elapsed = time.monotonic() - started
    barrier.release.set()
    for task in tasks:
        if not barrier.everyone.is_set():
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for held in results:
        held.seconds = elapsed
    return results


def raise_nofile(limit: int = NOFILE) -> None:
    """Raise this process's descriptor limit (children inherit it); root may raise the hard
    limit too."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(soft, limit)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(hard, want)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process in KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields.get("VmRSS", 0), fields.get("VmHWM", 0)


def write_pod(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    spec = {
        "pod": {
            "metadata": {"name": "echo", "namespace": "default", "uid": "bench-echo"},
            "hostname": "echo",
        },
        "containers": [
            {
                "name": "echo",
                "ports": [ECHO_PORT],
                "command": ["python3", "-c", ECHO_SERVER.replace("PORT", str(ECHO_PORT))],
            }
        ],
    }
    (directory / "echo.json").write_text(json.dumps(spec, indent=2))


def policy(users: Sequence[str], pod: str, port: int) -> str:
    """The admin group's rule and one allowing `users` to port-forward to `pod`'s `port`."""
    quoted = ", ".join(f'"{u}"' for u in users)
    return (
        '[[rule]]\ngroups = ["system:masters"]\nnamespaces = ["*"]\npods = ["*"]\n'
        'verbs = ["*"]\n\n'
        f'[[rule]]\nusers = [{quoted}]\nnamespaces = ["default"]\npods = ["{pod}"]\n'
        f'verbs = ["get", "portforward"]\nports = [{port}]\n'
    )


def add_users(node_dir: Path, server: str, names: Sequence[str]) -> list[Path]:
    """A token per user in the gateway's token file, and a kubeconfig each."""
    from podgate.node.pki import write_kubeconfig

    kubeconfigs = []
    with open(node_dir / "tokens.csv", "a") as tokens:
        for name in names:
            token = secrets.token_urlsafe(24)
            tokens.write(f'{token},{name},{name},""\n')
            path = node_dir / f"kubeconfig-{name}"
            write_kubeconfig(path, server, node_dir / "pki" / "ca.crt", user=name, token=token)
            kubeconfigs.append(path)
    return kubeconfigs


def forward_port(child: Child, deadline: float) -> int:
    """The local port kubectl port-forward listens on, once it says so."""
    while time.monotonic() < deadline and child.proc.poll() is None:
        if m := FORWARDING.search(child.out_path.read_bytes()):
            return int(m[1])
        time.sleep(0.05)
    raise ChildError(f"{child.name}: port-forward not ready: {child.stderr_tail()}")


def wait_for_echo(port: int, timeout: float = READY_TIMEOUT_SECONDS) -> None:
    """Until one connection through `port` echoes: the pod's server may still be starting
    after `podgate up` says it is ready (kubectl then resets the connection)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
                conn.sendall(b"ping")
                if conn.recv(4) == b"ping":
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise ChildError(f"no echo through port {port} within {timeout:g} s")
        time.sleep(0.2)


def run_manyforwards(
    kubectl_path: str | None,
    progress: Callable[[str], None],
    users: int = USERS,
    per_user: int = PER_USER,
) -> dict[str, Any] | None:
    kubectl = find_kubectl(kubectl_path)
    if kubectl is None:
        progress("manyforwards: no kubectl 1.33, part skipped")
        return None
    if os.geteuid() != 0:
        progress("manyforwards: podgate up runs pods: needs root, part skipped")
        return None
    raise_nofile()
    root = Path(tempfile.mkdtemp(prefix="pgmf", dir="/tmp"))  # short: unix socket paths
    names = [f"forwarder{i}" for i in range(users)]
    try:
        with ProcessSet() as procs:
            write_pod(root / "ex")
            argv = [sys.executable, "-m", "podgate", "up", "--state-dir", str(root / "s")]
            argv += ["--port", "0", "--examples", str(root / "ex")]
            argv += ["--max-forwards-per-session", str(per_user)]
            up = procs.start("up", argv)
            server = up.wait_for(READY_LINE.pattern, timeout=READY_TIMEOUT_SECONDS)[0][1]
            node_dir = root / "s" / "node"
            kubeconfigs = add_users(node_dir, server, names)
            tmp = node_dir / ".policy.toml.new"
            tmp.write_text(policy(names, "echo", ECHO_PORT))
            os.replace(tmp, node_dir / "policy.toml")
            home = root / "home"
            home.mkdir()
            env = {**os.environ, "HOME": str(home)}
            forwarders = [
                procs.start(
                    name,
                    [kubectl, "--kubeconfig", str(kc), "port-forward", "pod/echo", f":{ECHO_PORT}"],
                    env,
                )
                for name, kc in zip(names, kubeconfigs, strict=True)
            ]
            deadline = time.monotonic() + FORWARD_READY_SECONDS
            ports = [forward_port(f, deadline) for f in forwarders]
            wait_for_echo(ports[0])
            idle_rss = rss_kib(up.pid)[0]
            progress(f"manyforwards: {users} x {per_user} connections through kubectl")
            sampled: dict[str, int] = {}

            async def main() -> list[Held]:
                run = asyncio.create_task(hold_connections(ports, per_user, HOLD_TIMEOUT_SECONDS))
                while not run.done():  # the peak while everything is open
                    rss = rss_kib(up.pid)[0]
                    kube = sum(rss_kib(f.pid)[0] for f in forwarders)
                    sampled["up"] = max(sampled.get("up", 0), rss)
                    sampled["kubectl"] = max(sampled.get("kubectl", 0), kube)
                    await asyncio.sleep(0.2)
                return await run

            held = asyncio.run(main())
            alive = all(f.proc.poll() is None for f in forwarders)
            up_hwm = rss_kib(up.pid)[1]
            # What the processes said, when something failed.
            logs = (
                {c.name: c.stderr_tail() for c in [up, *forwarders]}
                if any(h.failures for h in held) or not alive
                else {}
            )
            for forwarder in forwarders:
                forwarder.stop()
            # `podgate up` removes its pod on SIGTERM: give it the time (a kill would leave
            # the pod's processes and mounts behind).
            up.proc.send_signal(signal.SIGTERM)
            try:
                up.proc.wait(UP_STOP_SECONDS)
            except subprocess.TimeoutExpired:
                progress(f"manyforwards: podgate up did not stop within {UP_STOP_SECONDS:g} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "users": users,
        "per_user": per_user,
        "ok": sum(h.ok for h in held),
        "per_user_ok": [h.ok for h in held],
        "failures": [f for h in held for f in h.failures[:3]],
        "seconds": max(h.seconds for h in held),
        "up_rss_idle_kib": idle_rss,
        "up_rss_peak_kib": sampled.get("up", 0),
        "up_hwm_kib": up_hwm,
        "kubectl_rss_peak_kib": sampled.get("kubectl", 0),
        "kubectl_alive": alive,
        "logs": logs,
    }


def failed(data: dict[str, Any]) -> bool:
    return data["ok"] != data["users"] * data["per_user"] or not data["kubectl_alive"]


def _tables(data: dict[str, Any]) -> SectionTables:
    total = data["users"] * data["per_user"]
    rows = [
        [
            f"{data['users']} x {data['per_user']}",
            f"{data['ok']}/{total}",
            f"{data['seconds']:.1f}",
            f"{data['ok'] / data['seconds']:.0f}",
            f"{data['up_rss_idle_kib'] / 1024:.0f}",
            f"{data['up_rss_peak_kib'] / 1024:.0f}",
            f"{data['kubectl_rss_peak_kib'] / 1024:.0f}",
        ]
    ]
    return [
        (
            "Concurrent forwards to one pod through the gateway",
            "One kubectl 1.33 port-forward per user; every connection echoes its own random "
            "payload (sha256-checked) and stays open until all are checked. RSS of `podgate up` "
            "(gateway and runtime in one process) idle and at its peak with all open; kubectl: "
            "the four processes summed.",
            ("users x conns", "ok", "s", "conns/s", "up MiB idle", "up MiB peak", "kubectl MiB"),
            rows,
        )
    ]


def print_report(data: dict[str, Any], console: Console) -> None:
    print_tables(_tables(data), [], console)


def markdown(data: dict[str, Any]) -> str:
    return markdown_tables(_tables(data), [])
