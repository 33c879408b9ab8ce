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

One daemon serves three pods, one per port-forward backend (`--backend` chains per handler):

    netns   a plain pod (the runtime-* paths above): the daemon connects inside the pod's netns
    agent   a `sandboxed` pod: daemon -> in-guest agent -> target (the sandbox shim sets the
            connection up and hands the agent's dial-back socket to the daemon)
            (direct-in-guest: client in the guest netns, the limit there; agent-spdy)
    exec    a plain pod of handler `bench-exec`, forced to exec: one forwarder process run in
            the container per connection (exec-spdy, at most EXEC_MAX_SIZE per run)

and per backend, connection setup: sequential new forwarded connections on one SPDY session,
each echoing one byte (conn-netns, conn-agent, conn-exec).

Every URL from CRI PortForward is single-use, so each runtime-* run asks for a new one and its
client process gets it on the command line. That client is this module:

    python -m bench.runtime --via spdy --url URL --remote-port P --direction upload --size N
    python -m bench.runtime --via spdy --url URL --remote-port ECHO --conns N --budget S

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
import statistics
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

from bench.client import Closer, Meter, _download_error, _read_line
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
from bench.procs import Child, ChildError, ProcessSet, _live_children, cpu_seconds
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
GUEST_PEER = "direct-in-guest"
# The pods, by runtime handler: "" (netns backend), a plain one forced to exec, sandboxed.
PLAIN = ""
EXEC_HANDLER = "bench-exec"
SANDBOXED = "sandboxed"
POD_BACKENDS = {PLAIN: "netns", EXEC_HANDLER: "exec", SANDBOXED: "agent"}
DAEMON_BACKEND_ARGS = ("--backend", f"{EXEC_HANDLER}=exec", "--backend", f"{SANDBOXED}=agent")
# Per exec run: its forwarder copies through pipes at a few hundred MB/s, 1 GiB x 3 would
# dominate the whole benchmark.
EXEC_MAX_SIZE = 256 * 1024 * 1024
# New forwarded connections per connection-setup run (each also bounded by --conn-budget).
SETUP_CONNS = 500
# The daemon's own CPU (its threads, not its children: holders, shims and forwarders are
# watched on their own).
OWN = "own:"
# A watch on the processes the daemon starts for one connection (exec's forwarder).
NEW_CHILDREN = "new:"


@dataclass(frozen=True, slots=True)
class RuntimePath:
    name: str
    via: str  # tcp (bench.client), or spdy / tunnel / ws (this module's client)
    description: str
    relay: str | None = None
    handler: str = PLAIN  # which pod
    peer: str = PEER  # the in-netns run this path's ratio is against


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
    RuntimePath(
        GUEST_PEER,
        "tcp",
        "client in the sandboxed pod's guest netns -> target (the limit inside the guest)",
        handler=SANDBOXED,
        peer=GUEST_PEER,
    ),
    RuntimePath(
        "agent-spdy",
        "spdy",
        "CRI PortForward: SPDY -> podgate runtime -> in-guest agent -> target (shim hands over)",
        handler=SANDBOXED,
        peer=GUEST_PEER,
    ),
    RuntimePath(
        "exec-spdy",
        "spdy",
        "CRI PortForward: SPDY -> podgate runtime -> forwarder run in the container -> target",
        handler=EXEC_HANDLER,
    ),
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
    "netns in the same round (direct-in-guest for the sandboxed pod). CPU seconds per GB "
    "moved: runtime = the daemon process alone (it relays), client = the client process, "
    "relay = socat with its forks and nsenter children, the sandbox shim (with the muxer in "
    "it) and its in-guest agent (agent-spdy), or the forwarder process in the container "
    "(exec-spdy)."
)
CONN_HEADERS = ("backend", "conns", "p50 ms", "p99 ms", "conns/s", "errors")
CONN_NOTE = (
    "Connection setup: new port-forward connections one after the other on one SPDY session, "
    "each timed from opening its stream pair to the echo of one byte; conns/s includes the "
    "close (EOF both ways). Median over runs."
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

        from podgate.cri import api_pb2, api_pb2_grpc

        self.pb = api_pb2
        self.channel = grpc.insecure_channel(f"unix://{socket_path}")
        grpc.channel_ready_future(self.channel).result(timeout=CRI_TIMEOUT_SECONDS)
        self.stub = api_pb2_grpc.RuntimeServiceStub(self.channel)

    def run_pod(self, log_directory: str, handler: str = PLAIN) -> tuple[str, Any]:
        pb = self.pb
        name = f"{POD_NAME}-{handler}" if handler else POD_NAME
        config = pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(
                name=name, namespace=POD_NAMESPACE, uid=secrets.token_hex(8)
            ),
            hostname=name,
            log_directory=log_directory,
        )
        reply = self.stub.RunPodSandbox(
            pb.RunPodSandboxRequest(config=config, runtime_handler=handler),
            timeout=CRI_TIMEOUT_SECONDS,
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


@dataclass(slots=True)
class BenchPod:
    """One pod with the bench target in it."""

    handler: str
    pod_id: str
    netns: str  # where direct-in-netns clients run (the guest's netns for a sandboxed pod)
    bulk_port: int
    echo_port: int
    watch: dict[str, int]  # CPU watches of its runs: name -> pid (OWN/NEW_CHILDREN prefixed)


class RuntimeBench:
    """The daemon, the pods and the relays of one invocation, and the runs against them."""

    # Where its pods' logs go, under the workdir: runtimes of one invocation keep apart.
    logs_prefix = ""

    def __init__(self, procs: ProcessSet, options: Options, section: dict[str, Any]) -> None:
        self.procs = procs
        self.options = options
        self.section = section
        self.py = sys.executable
        self.cri: Cri | None = None
        self.daemon: Child | None = None
        self.pods: dict[str, BenchPod] = {}
        self.failed_pods: set[str] = set()
        self.pod_ids: list[str] = []  # every pod made, removed by stop()
        self.socat_port = 0
        self.socat_pid = 0
        self.pod_pids: list[int] = []  # the pods' processes: the last resort if removal fails

    def start(self, paths: Sequence[RuntimePath]) -> list[RuntimePath]:
        # Short: the sandbox's unix sockets live under <state>/run/<64-hex pod id>/.
        state = self.procs.workdir / "s"
        argv = [self.py, "-m", "podgate", "runtime", "--state-dir", str(state), "--no-nri"]
        argv += DAEMON_BACKEND_ARGS
        if self.options.profile_dir is not None:
            self.options.profile_dir.mkdir(parents=True, exist_ok=True)
            profile = self.options.profile_dir / "runtime-daemon.prof"
            argv[1:2] = ["-m", "cProfile", "-o", str(profile), "-m"]
        self.daemon = self.procs.start("runtime", argv)
        ready = self.daemon.wait_for(READY_LINE)[0]
        self.section["meta"]["runtime_loop"] = resolve_loop("podgate")
        self.section["meta"]["backends"] = POD_BACKENDS
        self.cri = Cri(ready[1])
        self.section["meta"]["pods"] = {}
        usable = []
        for spec in paths:
            if spec.handler in self.failed_pods or (
                spec.handler not in self.pods and not self._start_pod(spec.handler)
            ):
                self.failed_pods.add(spec.handler)
                continue
            if spec.relay == "socat" and not self._start_socat():
                continue
            usable.append(spec)
        return usable

    # The plain pod's, for bench.gateway (which runs kubectl against that pod).
    @property
    def watch(self) -> dict[str, int]:
        return dict(self.pods[PLAIN].watch)

    @property
    def bulk_port(self) -> int:
        return self.pods[PLAIN].bulk_port

    @property
    def netns(self) -> str:
        return self.pods[PLAIN].netns

    def _start_pod(self, handler: str) -> bool:
        """A pod of `handler` with the target in it; False (and why in "skipped") if it fails:
        the other backends are still measured."""
        assert self.cri is not None and self.daemon is not None
        logs = self.procs.workdir / f"{self.logs_prefix}logs-{handler or 'plain'}"
        try:
            pod_id, pod_config = self.cri.run_pod(str(logs), handler)
            self.pod_ids.append(pod_id)
            pod = self.cri.pod_info(pod_id)
            self.pod_pids += [int(pod["holderPid"]), int(pod["pid"])]
            watch = {"runtime": self.daemon.pid}
            extra = pod.get("extra", {})
            netns_pid = int(pod["pid"])
            if handler == SANDBOXED:
                netns_pid = int(extra["guest_ns_pid"])
                # The shim (the muxer runs in it) with its live child, the in-guest agent.
                watch["relay"] = int(extra["sandbox_shim"]["pid"])
                self.pod_pids += [int(extra["sandbox_shim"]["pid"]), netns_pid]
            container_id = self.cri.start_container(
                pod_id, pod_config, [self.py, "-m", "bench.target"]
            )
            target_pid = int(self.cri.container_info(container_id)["pid"])
            self.pod_pids.append(target_pid)
            ports = wait_target_ports(logs / CONTAINER_LOG)
        except Exception as exc:  # grpc.RpcError, ChildError, KeyError: this pod only
            self.section["skipped"][f"pod {handler}"] = f"{type(exc).__name__}: {exc}"[:300]
            return False
        watch["target"] = target_pid
        netns = f"/proc/{netns_pid}/ns/net"
        self.pods[handler] = BenchPod(
            handler, pod_id, netns, int(ports["bulk_port"]), int(ports["echo_port"]), watch
        )
        pids = {**watch, "holder": int(pod["holderPid"])}
        self.section["meta"]["pods"][POD_BACKENDS[handler]] = {**pids, "netns": netns_pid}
        if handler == PLAIN:
            self.section["meta"]["pids"] = pids
        self._check_isolated(self.pods[handler])
        return True

    def _check_isolated(self, pod: BenchPod) -> None:
        """The target must be unreachable from the host: else the pod has no netns of its own
        and "direct-in-netns" would not be what it says."""
        with socket.socket() as sock:
            sock.settimeout(1.0)
            if sock.connect_ex(("127.0.0.1", pod.bulk_port)) == 0:
                self.section["meta"]["warning"] = (
                    f"port {pod.bulk_port} answers on the host too: is the pod's netns shared?"
                )

    def _start_socat(self) -> bool:
        socat = shutil.which("socat")
        if socat is None:
            self.section["skipped"]["socat-into-netns"] = "socat is not installed"
            return False
        pod = self.pods[PLAIN]
        self.socat_port = _free_port()
        inner = f"{NSENTER} --net={pod.netns} socat STDIO TCP:127.0.0.1:{pod.bulk_port}"
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

    def size(self, spec: RuntimePath) -> int:
        if spec.handler == EXEC_HANDLER:
            return min(self.options.size, EXEC_MAX_SIZE)
        return self.options.size

    def client_argv(self, spec: RuntimePath, direction: str) -> list[str]:
        o = self.options
        pod = self.pods[spec.handler]
        size = str(self.size(spec))
        common = ["--direction", direction, "--size", size, "--timeout", str(o.run_timeout)]
        tcp = [self.py, "-m", "bench.client", "throughput", "--via", "tcp", *common]
        if spec.via == "tcp":
            watch = {"runtime": pod.watch["runtime"], "target": pod.watch["target"]}
            if spec.relay == "socat":
                watch["socat"] = self.socat_pid
            tcp += [arg for name, pid in watch.items() for arg in ("--watch", f"{name}={pid}")]
            if spec.relay == "socat":
                return [*tcp, "--port", str(self.socat_port)]
            return [NSENTER, f"--net={pod.netns}", *tcp, "--port", str(pod.bulk_port)]
        specs = {name: str(pid) for name, pid in pod.watch.items()}
        specs["runtime"] = OWN + specs["runtime"]
        if spec.handler == EXEC_HANDLER:
            specs["relay"] = NEW_CHILDREN + str(pod.watch["runtime"])
        return [
            *self._forward_argv(spec.via, pod, pod.bulk_port),
            *common,
            *(arg for name, pid in specs.items() for arg in ("--watch", f"{name}={pid}")),
        ]

    def _forward_argv(self, via: str, pod: BenchPod, port: int) -> list[str]:
        assert self.cri is not None
        url = self.cri.port_forward(pod.pod_id, port)
        return [
            *(self.py, "-m", "bench.runtime", "--via", via, "--url", url),
            *("--remote-port", str(port), "--loop", self.options.loop),
        ]

    def run_once(self, spec: RuntimePath, direction: str, run: int) -> dict[str, Any]:
        row: dict[str, Any] = {
            "path": spec.name,
            "direction": direction,
            "run": run,
            "peer": spec.peer,
            "backend": None if spec.via == "tcp" else POD_BACKENDS[spec.handler],
        }
        limit = self.options.run_timeout + CLIENT_STARTUP_SECONDS
        return self.procs.run_json(self.client_argv(spec, direction), limit, row)

    def run_setup(self, handler: str, run: int) -> dict[str, Any]:
        """SETUP_CONNS sequential forwarded connections to the echo port on one session."""
        pod = self.pods[handler]
        row: dict[str, Any] = {"backend": POD_BACKENDS[handler], "run": run}
        budget = self.options.conn_budget
        argv = [
            *self._forward_argv("spdy", pod, pod.echo_port),
            *("--conns", str(SETUP_CONNS), "--budget", str(budget)),
        ]
        return self.procs.run_json(argv, budget + CLIENT_STARTUP_SECONDS + CRI_TIMEOUT_SECONDS, row)

    def stop(self) -> None:
        """Remove the pods (the daemon would leave them running), then close the CRI channel."""
        if self.cri is None:
            return
        errors = []
        for pod_id in self.pod_ids:
            try:
                self.cri.remove_pod(pod_id)
            except Exception as exc:
                errors.append(f"RemovePodSandbox {pod_id[:12]} failed: {exc}")
        self.pod_ids.clear()
        if errors:
            # The daemon cannot remove them: stop the pods' own processes by their ids.
            self.section["error"] = "; ".join(errors)
            for pid in self.pod_pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        self.cri.close()


def run_runtime(
    options: Options,
    paths: Sequence[str] = RUNTIME_PATH_NAMES,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Run the runtime benchmark; returns its section of the results (JSON-ready)."""
    section: dict[str, Any] = {
        "meta": {
            "size": options.size,
            "exec_size": min(options.size, EXEC_MAX_SIZE),
            "runs": options.runs,
            "setup_conns": SETUP_CONNS,
            "setup_budget": options.conn_budget,
        },
        "skipped": {},
        "error": None,
        "throughput": [],
        "setup": [],
    }
    reason = unavailable()
    if reason is not None:
        section["skipped"]["runtime"] = reason
        section["summary"] = []
        section["setup_summary"] = []
        return section
    wanted = {*paths, *(p.peer for p in RUNTIME_PATHS if p.name in paths)}  # ratios need peers
    specs = [p for p in RUNTIME_PATHS if p.name in wanted]
    with ProcessSet(cwd=REPO_ROOT, prefix="pgr") as procs:
        bench = RuntimeBench(procs, options, section)
        try:
            progress("runtime: starting podgate runtime, the pods and the relays")
            specs = bench.start(specs)
            setups = [h for h in POD_BACKENDS if any(s.handler == h for s in specs)]
            for run in range(1, options.runs + 1):
                for spec in specs:
                    for direction in options.directions:
                        progress(f"runtime run {run}/{options.runs}: {spec.name} {direction}")
                        section["throughput"].append(bench.run_once(spec, direction, run))
                for handler in setups:
                    backend = POD_BACKENDS[handler]
                    progress(f"runtime run {run}/{options.runs}: connection setup {backend}")
                    section["setup"].append(bench.run_setup(handler, run))
        except Exception as exc:  # ChildError, grpc.RpcError, ...: this part failed, not the bench
            section["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            progress("runtime: removing the pods, stopping the daemon")
            bench.stop()
    section["summary"] = summarize(section["throughput"])
    section["setup_summary"] = summarize_setup(section["setup"])
    return section


# --------------------------------------------------------------------------- summary, report


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per path and direction: GB/s, ratio to its in-netns peer of the same round, CPU s/GB."""
    peer = {
        (r["path"], r["direction"], r["run"]): r["bytes"] / r["seconds"]
        for r in rows
        if r["path"] in (PEER, GUEST_PEER) and not r.get("error") and r.get("verified")
    }
    out = []
    for path, direction in dict.fromkeys((r["path"], r["direction"]) for r in rows):
        group = [r for r in rows if r["path"] == path and r["direction"] == direction]
        ok = [r for r in group if not r.get("error") and r.get("verified")]
        ratios = [
            r["bytes"] / r["seconds"] / peer[key]
            for r in ok
            if (key := (r.get("peer", PEER), direction, r["run"])) in peer
        ]

        def per_gb(*names: str, ok: list[dict[str, Any]] = ok) -> dict[str, float] | None:
            vals = [
                r["cpu"][name] / (r["bytes"] / GB)
                for r in ok
                for name in names
                if name in r.get("cpu", {})
            ]
            return _spread(vals)

        out.append(
            {
                "path": path,
                "direction": direction,
                "backend": group[0].get("backend"),
                "runs": len(group),
                "ok_runs": len(ok),
                "errors": sorted({str(r["error"]) for r in group if r.get("error")}),
                "verified_bytes": [r["bytes"] for r in ok],
                "gbps": _spread([r["bytes"] / r["seconds"] / GB for r in ok]),
                "ratio": _spread(ratios),
                "runtime_cpu_s_per_gb": per_gb("runtime"),
                "relay_cpu_s_per_gb": per_gb("socat", "relay"),
                "target_cpu_s_per_gb": per_gb("target"),
                "client_cpu_s_per_gb": _spread([r["client_cpu"] / (r["bytes"] / GB) for r in ok]),
            }
        )
    return out


def summarize_setup(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per backend: connections made, p50/p99 setup latency and conns/s (median over runs)."""
    out = []
    for backend in dict.fromkeys(r["backend"] for r in rows):
        group = [r for r in rows if r["backend"] == backend]
        ok = [r for r in group if not r.get("error") and r.get("conns")]
        out.append(
            {
                "backend": backend,
                "runs": len(group),
                "ok_runs": len(ok),
                "errors": sorted({str(r["error"]) for r in group if r.get("error")}),
                "conns": [r["conns"] for r in ok],
                "p50_ms": _spread([r["p50_ms"] for r in ok]),
                "p99_ms": _spread([r["p99_ms"] for r in ok]),
                "conns_per_s": _spread([r["conns_per_s"] for r in ok]),
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
                "1" if s["path"] in (PEER, GUEST_PEER) else _fmt_ratio(s["ratio"]),
                _median(s["runtime_cpu_s_per_gb"]),
                _median(s["client_cpu_s_per_gb"]),
                _median(s["relay_cpu_s_per_gb"]),
                verified,
            ]
        )
    return out


def setup_rows(section: dict[str, Any]) -> list[list[str]]:
    out = []
    for s in section.get("setup_summary", []):
        conns = "/".join(str(n) for n in s["conns"]) or "0"
        out.append(
            [
                s["backend"],
                conns,
                _fmt(s["p50_ms"], 2),
                _fmt(s["p99_ms"], 2),
                _fmt(s["conns_per_s"], 0),
                "; ".join(s["errors"])[:120],
            ]
        )
    return out


def setup_title(section: dict[str, Any]) -> str:
    meta = section["meta"]
    return (
        f"connection setup into a pod through podgate runtime: up to {meta['setup_conns']} "
        f"connections or {meta['setup_budget']:g} s per run, {meta['runs']} run(s)"
    )


def title(section: dict[str, Any]) -> str:
    meta = section["meta"]
    return (
        f"port-forward into a pod through podgate runtime, {format_size(meta['size'])} per run, "
        f"(exec-spdy {format_size(meta.get('exec_size', meta['size']))}), "
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
    table_rows = setup_rows(section)
    if table_rows:
        table = Table(title=setup_title(section), title_justify="left", caption=CONN_NOTE)
        table.caption_justify = "left"
        for i, header in enumerate(CONN_HEADERS):
            table.add_column(header, justify="left" if i in (0, 5) else "right", overflow="fold")
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
    table_rows = setup_rows(section)
    if table_rows:
        lines += [setup_title(section), "", CONN_NOTE, ""]
        lines.append("| " + " | ".join(CONN_HEADERS) + " |")
        lines.append("|" + "|".join("---" for _ in CONN_HEADERS) + "|")
        lines += ["| " + " | ".join(row) + " |" for row in table_rows]
        lines.append("")
    lines += _notes(section)
    return "\n".join(lines) + "\n"


def failed(section: dict[str, Any]) -> bool:
    return (
        bool(section["error"])
        or any(s["errors"] for s in section["summary"])
        or any(s["errors"] for s in section.get("setup_summary", []))
    )


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
    session = await PortForwardSession.connect(
        endpoint, parts.path, websocket=via == "tunnel", udp=True
    )
    try:
        forwarded = await session.open(remote)
    except BaseException:
        await session.aclose()
        raise
    return forwarded.data, session.aclose


# How long the daemon may take to start the forwarder of one exec connection, seconds.
FORWARDER_WAIT_SECONDS = 10.0
# Marks the forwarder among the daemon's children (`python -m podgate agent forward PORT`,
# socat, busybox nc or python3 -c): the probe shell before it is none of these.
FORWARDER_WORDS = ("forward", "socat", "nc", "python3")


def own_cpu_seconds(pid: int) -> float:
    """User+system CPU of one process (all its threads), without any of its children."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _descendants(pid: int) -> set[int]:
    found: set[int] = set()
    todo = [pid]
    while todo:
        children = _live_children(todo.pop())
        found.update(children)
        todo += children
    return found


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return ""


class ForwardMeter(Meter):
    """Meter with two more kinds of watch: OWN+PID (the process alone, not its children) and
    NEW_CHILDREN+PID (what PID started for this connection, found after the connection opened
    and before the clock starts)."""

    def __init__(self, specs: Sequence[str]) -> None:
        plain: dict[str, int] = {}
        self.own: dict[str, int] = {}
        self.new: dict[str, int] = {}
        for spec in specs:
            name, _, value = spec.partition("=")
            if value.startswith(OWN):
                self.own[name] = int(value.removeprefix(OWN))
            elif value.startswith(NEW_CHILDREN):
                self.new[name] = int(value.removeprefix(NEW_CHILDREN))
            else:
                plain[name] = int(value)
        super().__init__(plain)
        self._known = {name: _descendants(pid) for name, pid in self.new.items()}
        self._new_pids: dict[str, list[int]] = {}
        self._extra0: dict[str, float] = {}

    async def find_new(self) -> None:
        """Wait for the process(es) the connection started (exec: its forwarder)."""
        deadline = time.monotonic() + FORWARDER_WAIT_SECONDS
        for name, pid in self.new.items():
            while True:
                pids = sorted(_descendants(pid) - self._known[name])
                lines = [_cmdline(p) for p in pids]
                if any(w in line for line in lines for w in FORWARDER_WORDS):
                    break
                if time.monotonic() > deadline:
                    raise ChildError(f"no forwarder appeared under pid {pid}: {lines}")
                await asyncio.sleep(POLL_SECONDS)
            # Only the top-most new processes: cpu_seconds counts their children.
            self._new_pids[name] = [p for p in pids if _parent(p) not in pids]

    def _extra(self) -> dict[str, float]:
        values = {name: own_cpu_seconds(pid) for name, pid in self.own.items()}
        for name, pids in self._new_pids.items():
            values[name] = sum(cpu_seconds(p) for p in pids)
        return values

    def start(self) -> None:
        self._extra0 = self._extra()
        super().start()

    def stop(self) -> None:
        super().stop()
        for name, value in self._extra().items():
            self.cpu[name] = value - self._extra0[name]


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


async def forward_throughput(
    via: str, url: str, remote: int, direction: str, size: int, timeout: float, meter: ForwardMeter
) -> str | None:
    """One byte-checked transfer; None when every byte arrived intact, else what went wrong."""
    pattern = Pattern()
    stream, close = await open_forward(via, url, remote)
    try:
        async with asyncio.timeout(timeout):
            if meter.new:
                # The forwarder starts when the first bytes arrive (or the stream opens).
                await stream.send(upload_request(size) if direction == "upload" else b"")
                await meter.find_new()
            meter.start()
            if direction == "upload":
                if not meter.new:
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


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


async def forward_setup(url: str, remote: int, count: int, budget: float) -> dict[str, Any]:
    """`count` sequential forwarded connections on one session (stopping after `budget`
    seconds), each timed from its stream pair's open to the echo of one byte, then closed."""
    parts = urlsplit(url)
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"unexpected streaming URL {url!r}")
    session = await PortForwardSession.connect(
        Endpoint(parts.hostname, parts.port), parts.path, udp=True
    )
    latencies: list[float] = []
    error = None
    try:
        t0 = time.perf_counter()
        async with asyncio.timeout(budget + CRI_TIMEOUT_SECONDS):
            while len(latencies) < count and time.perf_counter() - t0 < budget:
                started = time.perf_counter()
                forwarded = await session.open(remote)
                await forwarded.data.send(b"x")
                echo = await forwarded.data.receive()
                latencies.append(time.perf_counter() - started)
                await forwarded.data.send_eof()
                while await forwarded.data.receive():
                    pass
                text = await forwarded.error()
                await forwarded.data.aclose()
                await forwarded.error_stream.aclose()
                if echo != b"x" or text:
                    error = f"connection {len(latencies)}: echo {echo!r}, error {text!r}"
                    break
        seconds = time.perf_counter() - t0
    finally:
        await session.aclose()
    if not latencies:
        return {"error": error or "no connection made", "conns": 0}
    return {
        "conns": len(latencies),
        "seconds": seconds,
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": _percentile(latencies, 0.99) * 1000,
        "conns_per_s": len(latencies) / seconds,
        "error": error,
    }


def client_main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.runtime")
    parser.add_argument("--via", choices=("spdy", "tunnel", "ws"), required=True)
    parser.add_argument("--url", required=True, help="the URL CRI PortForward returned")
    parser.add_argument("--remote-port", type=int, required=True)
    parser.add_argument("--direction", choices=("upload", "download"))
    parser.add_argument("--size", type=int)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument(
        "--watch",
        action="append",
        default=[],
        metavar="NAME=PID",
        help=f"PID with its children, {OWN}PID alone, {NEW_CHILDREN}PID what it starts",
    )
    parser.add_argument("--loop", choices=LOOP_CHOICES, default="podgate")
    parser.add_argument("--conns", type=int, help="connection setup instead: this many (spdy)")
    parser.add_argument("--budget", type=float, default=20.0, help="seconds for --conns")
    args = parser.parse_args(argv)
    if args.conns is None and (args.direction is None or args.size is None):
        parser.error("--direction and --size, or --conns")
    loop = resolve_loop(args.loop)
    result: dict[str, Any] = {"loop": loop}
    try:
        if args.conns is not None:
            result.update(
                run_on(loop, forward_setup(args.url, args.remote_port, args.conns, args.budget))
            )
        else:
            meter = ForwardMeter(args.watch)
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
