"""Port-forward into a real pod through `podgate runtime`, against the limit inside the pod.

The driver starts a `podgate runtime` daemon with its own state directory, runs a pod through
CRI whose container is the bench target (bound to 127.0.0.1 inside the pod's network namespace,
which has nothing but loopback), and moves the same byte-checked pattern along each path:

    direct-in-netns   client inside the pod's netns (nsenter) -> target    (the limit there)
    socat-into-netns  client -> host socat (fork) -> nsenter socat -> target
                      (how runtimes forwarded before CRI streaming servers)
    runtime-spdy      CRI PortForward URL -> PortForwardSession (SPDY/3.1) -> runtime -> target
    runtime-tunnel    the same, SPDY inside WebSocket (what kubectl 1.31+ speaks)
    runtime-ws        the same URL with portforward_websocket (v4.channel.k8s.io)

Every URL from CRI PortForward is single-use, so each runtime-* run asks for a new one and its
client process gets it on the command line. That client is this module:

    python -m bench.runtime --via spdy --url URL --remote-port P --direction upload --size N

Runs are interleaved as in bench.portforward, and every ratio compares a path with the
direct-in-netns run of the same round and direction. The pod is removed (CRI
RemovePodSandbox) before the daemon is stopped, on errors and Ctrl-C too: the daemon leaves
pods running when it stops.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rich.console import Console
from rich.table import Table

from bench.client import Closer, Meter, _download_error, _parse_watch, _read_line
from bench.common import (
    IO_CHUNK_BYTES,
    LOOP_CHOICES,
    Pattern,
    Verifier,
    download_request,
    format_size,
    parse_sink_reply,
    resolve_loop,
    run_on,
    upload_request,
)
from bench.portforward import (
    CLIENT_STARTUP_SECONDS,
    GB,
    REPO_ROOT,
    SOCAT_READY_SECONDS,
    Options,
    _free_port,
    _spread,
    _wait_listening,
)
from bench.procs import Child, ChildError, ProcessSet
from bench.report import _fmt, _fmt_ratio, _median
from podgate.aio.streams import ByteStream
from podgate.streaming.client import Endpoint, PortForwardSession, portforward_websocket

NSENTER = "nsenter"
# How long one CRI call may take (RunPodSandbox starts an interpreter for the holder).
CRI_TIMEOUT_SECONDS = 30.0
# How long the target in the pod may take to print its ports into the container log.
TARGET_READY_SECONDS = 30.0
# Container-log polling period.
POLL_SECONDS = 0.05
# The daemon's ready line (podgate.runtime.daemon.run_daemon).
READY_LINE = r"^podgate runtime ready cri=unix://(\S+) streaming=(\S+)"
POD_NAME = "bench-runtime"
POD_NAMESPACE = "default"
CONTAINER_NAME = "target"
CONTAINER_LOG = "target.log"
PEER = "direct-in-netns"


@dataclass(frozen=True, slots=True)
class RuntimePath:
    name: str
    via: str  # tcp (bench.client), or spdy / tunnel / ws (this module's client)
    description: str
    relay: str | None = None


RUNTIME_PATHS: tuple[RuntimePath, ...] = (
    RuntimePath(PEER, "tcp", "client in the pod's netns -> target (the limit inside the pod)"),
    RuntimePath(
        "socat-into-netns",
        "tcp",
        "client -> host socat fork -> nsenter socat -> target (8 KiB blocks)",
        relay="socat",
    ),
    RuntimePath("runtime-spdy", "spdy", "CRI PortForward: SPDY -> podgate runtime -> target"),
    RuntimePath(
        "runtime-tunnel", "tunnel", "CRI PortForward: SPDY in WebSocket -> podgate runtime"
    ),
    RuntimePath("runtime-ws", "ws", "CRI PortForward: WebSocket v4 channels -> podgate runtime"),
)
RUNTIME_PATH_NAMES = tuple(p.name for p in RUNTIME_PATHS)

HEADERS = (
    "path",
    "dir",
    "GB/s (min–max)",
    "× in-netns (min–max)",
    "runtime s/GB",
    "client s/GB",
    "relay s/GB",
    "verified",
)
NOTE = (
    "Into a pod through `podgate runtime`. × in-netns = against a client inside the pod's "
    "netns in the same round. CPU seconds per GB moved: runtime = the daemon process (it "
    "relays), client = the client process, relay = socat with its forks and nsenter children."
)


def unavailable() -> str | None:
    """Why this part cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and nsenter)"
    if shutil.which(NSENTER) is None:
        return "nsenter is not installed (apt-get install util-linux)"
    return None


# --------------------------------------------------------------------------- CRI


class Cri:
    """The few CRI calls the benchmark needs, synchronous, each with a deadline."""

    def __init__(self, socket_path: str) -> None:
        import grpc

        from podgate.runtime.cri import api_pb2, api_pb2_grpc

        self.pb = api_pb2
        self.channel = grpc.insecure_channel(f"unix://{socket_path}")
        grpc.channel_ready_future(self.channel).result(timeout=CRI_TIMEOUT_SECONDS)
        self.stub = api_pb2_grpc.RuntimeServiceStub(self.channel)

    def run_pod(self, log_directory: str) -> tuple[str, Any]:
        pb = self.pb
        config = pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(
                name=POD_NAME, namespace=POD_NAMESPACE, uid=secrets.token_hex(8)
            ),
            hostname=POD_NAME,
            log_directory=log_directory,
        )
        reply = self.stub.RunPodSandbox(
            pb.RunPodSandboxRequest(config=config), timeout=CRI_TIMEOUT_SECONDS
        )
        return str(reply.pod_sandbox_id), config

    def start_container(self, pod_id: str, pod_config: Any, argv: Sequence[str]) -> str:
        pb = self.pb
        config = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name=CONTAINER_NAME),
            command=list(argv),
            working_dir=str(REPO_ROOT),
            log_path=CONTAINER_LOG,
        )
        request = pb.CreateContainerRequest(
            pod_sandbox_id=pod_id, config=config, sandbox_config=pod_config
        )
        container_id = str(
            self.stub.CreateContainer(request, timeout=CRI_TIMEOUT_SECONDS).container_id
        )
        self.stub.StartContainer(
            pb.StartContainerRequest(container_id=container_id), timeout=CRI_TIMEOUT_SECONDS
        )
        return container_id

    def pod_info(self, pod_id: str) -> dict[str, Any]:
        reply = self.stub.PodSandboxStatus(
            self.pb.PodSandboxStatusRequest(pod_sandbox_id=pod_id, verbose=True),
            timeout=CRI_TIMEOUT_SECONDS,
        )
        info: dict[str, Any] = json.loads(reply.info["info"])
        return info

    def container_info(self, container_id: str) -> dict[str, Any]:
        reply = self.stub.ContainerStatus(
            self.pb.ContainerStatusRequest(container_id=container_id, verbose=True),
            timeout=CRI_TIMEOUT_SECONDS,
        )
        info: dict[str, Any] = json.loads(reply.info["info"])
        return info

    def port_forward(self, pod_id: str, port: int) -> str:
        reply = self.stub.PortForward(
            self.pb.PortForwardRequest(pod_sandbox_id=pod_id, port=[port]),
            timeout=CRI_TIMEOUT_SECONDS,
        )
        return str(reply.url)

    def remove_pod(self, pod_id: str) -> None:
        self.stub.RemovePodSandbox(
            self.pb.RemovePodSandboxRequest(pod_sandbox_id=pod_id), timeout=CRI_TIMEOUT_SECONDS
        )

    def close(self) -> None:
        self.channel.close()


def wait_target_ports(log_file: Path, timeout: float = TARGET_READY_SECONDS) -> dict[str, Any]:
    """The target's ready line (JSON) from the container's CRI log ("<time> stdout F <line>")."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            text = log_file.read_text(errors="replace")
        for line in text.splitlines():
            parts = line.split(" ", 3)
            if len(parts) == 4 and parts[1] == "stdout" and parts[3].startswith("{"):
                value: dict[str, Any] = json.loads(parts[3])
                return value
        time.sleep(POLL_SECONDS)
    raise ChildError(f"the target in the pod printed no ports in {timeout:.0f} s: {text[-500:]}")


# --------------------------------------------------------------------------- driver


class RuntimeBench:
    """The daemon, the pod and the relays of one invocation, and the runs against them."""

    def __init__(self, procs: ProcessSet, options: Options, section: dict[str, Any]) -> None:
        self.procs = procs
        self.options = options
        self.section = section
        self.py = sys.executable
        self.cri: Cri | None = None
        self.pod_id: str | None = None
        self.daemon: Child | None = None
        self.netns = ""
        self.bulk_port = 0
        self.socat_port = 0
        self.socat_pid = 0
        self.watch: dict[str, int] = {}
        self.pod_pids: list[int] = []  # the pod's processes: the last resort if removal fails

    def start(self, paths: Sequence[RuntimePath]) -> list[RuntimePath]:
        state = self.procs.workdir / "state"
        argv = [self.py, "-m", "podgate", "runtime", "--state-dir", str(state)]
        if self.options.profile_dir is not None:
            self.options.profile_dir.mkdir(parents=True, exist_ok=True)
            profile = self.options.profile_dir / "runtime-daemon.prof"
            argv[1:2] = ["-m", "cProfile", "-o", str(profile), "-m"]
        self.daemon = self.procs.start("runtime", argv)
        ready = self.daemon.wait_for(READY_LINE)[0]
        self.section["meta"]["runtime_loop"] = resolve_loop("podgate")
        self.cri = Cri(ready[1])
        logs = self.procs.workdir / "logs"
        self.pod_id, pod_config = self.cri.run_pod(str(logs))
        pod = self.cri.pod_info(self.pod_id)
        # Holder and the pod's namespace process (its child with a pod PID namespace).
        self.pod_pids += [int(pod["holderPid"]), int(pod["pid"])]
        self.netns = f"/proc/{int(pod['pid'])}/ns/net"
        container_id = self.cri.start_container(
            self.pod_id, pod_config, [self.py, "-m", "bench.target"]
        )
        target_pid = int(self.cri.container_info(container_id)["pid"])
        self.pod_pids.append(target_pid)
        ports = wait_target_ports(logs / CONTAINER_LOG)
        self.bulk_port = int(ports["bulk_port"])
        self.watch = {"runtime": self.daemon.pid, "target": target_pid}
        self.section["meta"]["pids"] = {**self.watch, "holder": int(pod["holderPid"])}
        self._check_isolated()
        usable = []
        for spec in paths:
            if spec.relay == "socat" and not self._start_socat():
                continue
            usable.append(spec)
        return usable

    def _check_isolated(self) -> None:
        """The target must be unreachable from the host: else the pod has no netns of its own
        and "direct-in-netns" would not be what it says."""
        with socket.socket() as sock:
            sock.settimeout(1.0)
            if sock.connect_ex(("127.0.0.1", self.bulk_port)) == 0:
                self.section["meta"]["warning"] = (
                    f"port {self.bulk_port} answers on the host too: is the pod's netns shared?"
                )

    def _start_socat(self) -> bool:
        socat = shutil.which("socat")
        if socat is None:
            self.section["skipped"]["socat-into-netns"] = "socat is not installed"
            return False
        self.socat_port = _free_port()
        inner = f"{NSENTER} --net={self.netns} socat STDIO TCP:127.0.0.1:{self.bulk_port}"
        child = self.procs.start(
            "socat-netns",
            [
                socat,
                f"TCP-LISTEN:{self.socat_port},bind=127.0.0.1,reuseaddr,fork,backlog=1024",
                f"EXEC:'{inner}'",
            ],
        )
        _wait_listening(child, self.socat_port, SOCAT_READY_SECONDS)
        self.socat_pid = child.pid
        version = subprocess.run(
            [socat, "-V"], capture_output=True, text=True, check=False
        ).stdout.splitlines()
        self.section["meta"]["socat"] = next((v for v in version if "version" in v), "?").strip()
        return True

    def client_argv(self, spec: RuntimePath, direction: str) -> list[str]:
        o = self.options
        common = ["--direction", direction, "--size", str(o.size), "--timeout", str(o.run_timeout)]
        watch = dict(self.watch)
        if spec.relay == "socat":
            watch["socat"] = self.socat_pid
        for name, pid in watch.items():
            common += ["--watch", f"{name}={pid}"]
        tcp = [self.py, "-m", "bench.client", "throughput", "--via", "tcp", *common]
        if spec.name == PEER:
            return [NSENTER, f"--net={self.netns}", *tcp, "--port", str(self.bulk_port)]
        if spec.relay == "socat":
            return [*tcp, "--port", str(self.socat_port)]
        assert self.cri is not None and self.pod_id is not None
        url = self.cri.port_forward(self.pod_id, self.bulk_port)
        return [
            *(self.py, "-m", "bench.runtime", "--via", spec.via, "--url", url),
            *("--remote-port", str(self.bulk_port), "--loop", o.loop, *common),
        ]

    def run_once(self, spec: RuntimePath, direction: str, run: int) -> dict[str, Any]:
        row: dict[str, Any] = {"path": spec.name, "direction": direction, "run": run}
        limit = self.options.run_timeout + CLIENT_STARTUP_SECONDS
        try:
            done = self.procs.run(self.client_argv(spec, direction), limit)
        except subprocess.TimeoutExpired:
            return {**row, "error": f"client did not finish within {limit:.0f} s"}
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if not lines:
            tail = done.stderr.strip().splitlines()[-3:]
            return {**row, "error": f"client exited {done.returncode}: {' / '.join(tail)}"}
        result: dict[str, Any] = json.loads(lines[-1])
        return {**row, **result}

    def stop(self) -> None:
        """Remove the pod (the daemon would leave it running), then close the CRI channel."""
        if self.cri is None:
            return
        try:
            if self.pod_id is not None:
                self.cri.remove_pod(self.pod_id)
                self.pod_id = None
        except Exception as exc:
            # The daemon cannot remove it: stop the pod's own processes by their ids.
            self.section["error"] = f"RemovePodSandbox failed: {exc}"
            for pid in self.pod_pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        finally:
            self.cri.close()


def run_runtime(
    options: Options,
    paths: Sequence[str] = RUNTIME_PATH_NAMES,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Run the runtime benchmark; returns its section of the results (JSON-ready)."""
    section: dict[str, Any] = {
        "meta": {"size": options.size, "runs": options.runs},
        "skipped": {},
        "error": None,
        "throughput": [],
    }
    reason = unavailable()
    if reason is not None:
        section["skipped"]["runtime"] = reason
        section["summary"] = []
        return section
    wanted = [PEER, *(p for p in paths if p != PEER)]  # every ratio needs its peer
    specs = [p for p in RUNTIME_PATHS if p.name in wanted]
    with ProcessSet(cwd=REPO_ROOT, prefix="pgrt-") as procs:
        bench = RuntimeBench(procs, options, section)
        try:
            progress("runtime: starting podgate runtime, the pod and the relays")
            specs = bench.start(specs)
            for run in range(1, options.runs + 1):
                for spec in specs:
                    for direction in options.directions:
                        progress(f"runtime run {run}/{options.runs}: {spec.name} {direction}")
                        section["throughput"].append(bench.run_once(spec, direction, run))
        except Exception as exc:  # ChildError, grpc.RpcError, ...: this part failed, not the bench
            section["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            progress("runtime: removing the pod, stopping the daemon")
            bench.stop()
    section["summary"] = summarize(section["throughput"])
    return section


# --------------------------------------------------------------------------- summary, report


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per path and direction: GB/s, ratio to direct-in-netns of the same round, CPU s/GB."""
    peer = {
        (r["direction"], r["run"]): r["bytes"] / r["seconds"]
        for r in rows
        if r["path"] == PEER and not r.get("error") and r.get("verified")
    }
    out = []
    for path, direction in dict.fromkeys((r["path"], r["direction"]) for r in rows):
        group = [r for r in rows if r["path"] == path and r["direction"] == direction]
        ok = [r for r in group if not r.get("error") and r.get("verified")]
        ratios = [
            r["bytes"] / r["seconds"] / peer[(direction, r["run"])]
            for r in ok
            if (direction, r["run"]) in peer
        ]

        def per_gb(name: str, ok: list[dict[str, Any]] = ok) -> dict[str, float] | None:
            vals = [r["cpu"][name] / (r["bytes"] / GB) for r in ok if name in r.get("cpu", {})]
            return _spread(vals)

        out.append(
            {
                "path": path,
                "direction": direction,
                "runs": len(group),
                "ok_runs": len(ok),
                "errors": sorted({str(r["error"]) for r in group if r.get("error")}),
                "verified_bytes": [r["bytes"] for r in ok],
                "gbps": _spread([r["bytes"] / r["seconds"] / GB for r in ok]),
                "ratio": _spread(ratios),
                "runtime_cpu_s_per_gb": per_gb("runtime"),
                "relay_cpu_s_per_gb": per_gb("socat"),
                "target_cpu_s_per_gb": per_gb("target"),
                "client_cpu_s_per_gb": _spread([r["client_cpu"] / (r["bytes"] / GB) for r in ok]),
            }
        )
    return out


def rows(section: dict[str, Any]) -> list[list[str]]:
    out = []
    for s in section["summary"]:
        if s["ok_runs"]:
            verified = f"{s['ok_runs']}/{s['runs']} × {format_size(s['verified_bytes'][0])}"
        else:
            verified = "FAILED: " + "; ".join(s["errors"])[:120]
        out.append(
            [
                s["path"],
                s["direction"],
                _fmt(s["gbps"], 3),
                "1" if s["path"] == PEER else _fmt_ratio(s["ratio"]),
                _median(s["runtime_cpu_s_per_gb"]),
                _median(s["client_cpu_s_per_gb"]),
                _median(s["relay_cpu_s_per_gb"]),
                verified,
            ]
        )
    return out


def title(section: dict[str, Any]) -> str:
    meta = section["meta"]
    return (
        f"port-forward into a pod through podgate runtime, {format_size(meta['size'])} per run, "
        f"median of {meta['runs']} run(s) (min–max); runtime on {meta.get('runtime_loop', '?')}"
    )


def _notes(section: dict[str, Any]) -> list[str]:
    notes = [f"skipped {name}: {reason}" for name, reason in section["skipped"].items()]
    if section["meta"].get("warning"):
        notes.append(f"warning: {section['meta']['warning']}")
    if section["error"]:
        notes.append(f"runtime benchmark failed: {section['error']}")
    return notes


def print_report(section: dict[str, Any], console: Console) -> None:
    table_rows = rows(section)
    if table_rows:
        table = Table(title=title(section), title_justify="left", caption=NOTE)
        table.caption_justify = "left"
        for i, header in enumerate(HEADERS):
            table.add_column(header, justify="left" if i < 2 else "right", overflow="fold")
        for row in table_rows:
            table.add_row(*row)
        console.print(table)
    for note in _notes(section):
        console.print(f"[yellow]{note}[/yellow]", highlight=False)


def markdown(section: dict[str, Any]) -> str:
    lines = [title(section), "", NOTE, ""]
    table_rows = rows(section)
    if table_rows:
        lines.append("| " + " | ".join(HEADERS) + " |")
        lines.append("|" + "|".join("---" for _ in HEADERS) + "|")
        lines += ["| " + " | ".join(row) + " |" for row in table_rows]
        lines.append("")
    lines += _notes(section)
    return "\n".join(lines) + "\n"


def failed(section: dict[str, Any]) -> bool:
    return bool(section["error"]) or any(s["errors"] for s in section["summary"])


# --------------------------------------------------------------------------- client


async def open_forward(via: str, url: str, remote: int) -> tuple[ByteStream, Closer]:
    """Upgrade on the streaming server's one-time URL and open one stream to `remote`."""
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None or parts.port is None:
        raise ValueError(f"unexpected streaming URL {url!r}")
    endpoint = Endpoint(parts.hostname, parts.port)
    if via == "ws":
        channels, streams, reader = await portforward_websocket(endpoint, parts.path, [remote])

        async def close_ws() -> None:
            await channels.aclose()
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

        return streams[remote], close_ws
    session = await PortForwardSession.connect(endpoint, parts.path, websocket=via == "tunnel")
    try:
        forwarded = await session.open(remote)
    except BaseException:
        await session.aclose()
        raise
    return forwarded.data, session.aclose


async def forward_throughput(
    via: str, url: str, remote: int, direction: str, size: int, timeout: float, meter: Meter
) -> str | None:
    """One byte-checked transfer; None when every byte arrived intact, else what went wrong."""
    pattern = Pattern()
    stream, close = await open_forward(via, url, remote)
    try:
        async with asyncio.timeout(timeout):
            meter.start()
            if direction == "upload":
                await stream.send(upload_request(size))
                offset = 0
                while offset < size:
                    n = min(IO_CHUNK_BYTES, size - offset)
                    await stream.send(pattern.chunk(offset, n))
                    offset += n
                error = parse_sink_reply(await _read_line(stream), size)
            else:
                await stream.send(download_request(size))
                verifier = Verifier(pattern, size)
                while not verifier.done:
                    chunk = await stream.receive()
                    if not chunk:
                        break
                    verifier.feed(chunk)
                error = _download_error(verifier)
            meter.stop()
    finally:
        await close()
    return error


def client_main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.runtime")
    parser.add_argument("--via", choices=("spdy", "tunnel", "ws"), required=True)
    parser.add_argument("--url", required=True, help="the URL CRI PortForward returned")
    parser.add_argument("--remote-port", type=int, required=True)
    parser.add_argument("--direction", choices=("upload", "download"), required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--watch", action="append", default=[], metavar="NAME=PID")
    parser.add_argument("--loop", choices=LOOP_CHOICES, default="podgate")
    args = parser.parse_args(argv)
    loop = resolve_loop(args.loop)
    meter = Meter(_parse_watch(args.watch))
    result: dict[str, Any] = {"loop": loop}
    try:
        error = run_on(
            loop,
            forward_throughput(
                args.via,
                args.url,
                args.remote_port,
                args.direction,
                args.size,
                args.timeout,
                meter,
            ),
        )
        result.update(meter.as_dict(), bytes=args.size, verified=error is None, error=error)
    except Exception as exc:  # any failure is this run's result, not a crash of the bench
        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {exc}"
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    client_main()
