"""kubectl through the node gateway: kubectl -> `podgate node` (TLS) -> `podgate runtime` -> pod.

The driver starts a `podgate runtime` daemon and a pod running the bench target (as
bench.runtime does), then `podgate node` pointed at the daemon's CRI socket with its own state
directory, and kubectl 1.33 with the node's generated admin kubeconfig and a fresh HOME.

Port-forward, byte-checked, interleaved with its peers:

    direct-in-netns  client inside the pod's netns -> target (the limit there; every ratio's peer)
    gateway-tunnel   client -> kubectl port-forward (WebSocket tunnel, kubectl's default)
                     -> TLS -> podgate node -> SPDY -> runtime streaming server -> netns -> target
    gateway-spdy     the same with KUBECTL_PORT_FORWARD_WEBSOCKETS=false
    demo-tunnel      client -> kubectl port-forward -> podgate demo API server (plain HTTP, no
    demo-spdy        runtime, no TLS) -> a target on the host: the one-hop kubectl path (only
                     when named in --gateway-paths: the loopback part measures the same)

Exec output floods (kubernetes #64006), counted and checked by a client process that runs
kubectl and reads its stdout; each exec is bounded inside the pod by `timeout`:

    echo  `sh -c 'while true; do echo a; done'` (2-byte writes), over kubectl's default
          (WebSocket v5) and over SPDY (KUBECTL_REMOTE_COMMAND_WEBSOCKETS=false)
    bulk  `dd if=/dev/zero bs=1M` (1 MiB writes), `--size` bytes or the time limit, both ways

That client is this module:

    python -m bench.gateway flood --kind echo --watch gateway=PID --watch-own runtime=PID \
        -- kubectl exec ...

Last, a probe checks whether an exec outlives its client: a flood whose kubectl is killed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from bench import runtime as bench_runtime
from bench.common import BULK_REMOTE_PORT, format_size
from bench.common import POD_NAME as DEMO_POD_NAME
from bench.portforward import (
    CLIENT_STARTUP_SECONDS,
    GB,
    KUBECTL_VERSION_FILE,
    PATHS,
    REPO_ROOT,
    Options,
    Peers,
    Results,
    _spread,
    _watch_args,
    find_kubectl,
    run_client,
)
from bench.procs import (
    CLOCK_TICKS_PER_SECOND,
    Child,
    ChildError,
    ProcessSet,
    _die_with_parent,
    _live_children,
    cpu_seconds,
)
from bench.report import _fmt, _fmt_ratio, _median, markdown_tables, print_tables
from bench.runtime import PEER, PLAIN, RUNTIME_PATHS, RuntimeBench, RuntimePath

# 10^6 bytes: the unit of the exec flood figures (as in docs/performance.md).
MB = 1e6
# How long each timed exec flood writes at the default --size; smaller sizes shorten it.
FLOOD_SECONDS = 10.0
# The shortest default flood (a smoke run at a few MiB): still thousands of reads.
MIN_FLOOD_SECONDS = 1.0
# The --size at which floods get the full FLOOD_SECONDS.
FULL_FLOOD_SIZE = 1 << 30
# The reference: containerd 1.6 under the echo flood (docs/performance.md), runtime + shim.
CONTAINERD_FLOOD_MB_PER_S = 0.87
CONTAINERD_FLOOD_CPU_S_PER_MB = 1.19
# Largest read of kubectl's stdout: big reads keep the counting client cheap.
READ_BYTES = 1024 * 1024
# Extra time a flood client waits for EOF beyond the pod's own time limit (exec setup, drain).
FLOOD_GRACE_SECONDS = 30.0
# How long kubectl may take to exit after its stdout ended (the exit status comes last).
KUBECTL_EXIT_SECONDS = 10.0
# After the probe kills kubectl, how long the exec gets to stop before it counts as left over.
DISCONNECT_WAIT_SECONDS = 3.0
# The CPU the runtime and gateway keep spending is sampled over this long after that wait.
DISCONNECT_SAMPLE_SECONDS = 1.0
# The probe's exec stops by itself after this long in any case (`timeout` in the pod).
PROBE_LIMIT_SECONDS = 60.0
# How long the probe reads before it kills kubectl.
PROBE_READ_SECONDS = 1.0
# `timeout`'s exit status when it had to stop the command.
TIMEOUT_EXIT_CODE = 124
NODE_READY_LINE = r"^podgate node ready api=(\S+) runtime=(.*) kubeconfig=(\S+)$"
UP_READY_LINE = r"^podgate ready api=(\S+) kubeconfig=(\S+) cri=unix://(\S+)$"
KUBECTL_FORWARDING_LINE = r"^Forwarding from 127\.0\.0\.1:(\d+) -> (\d+)$"
ECHO_LOOP = "while true; do echo a; done"
# What the echo flood's stdout must consist of; odd-length slices start on either byte.
_ECHO_PATTERN = b"a\n" * (READ_BYTES // 2 + 1)
_ZEROS = bytes(READ_BYTES)


@dataclass(frozen=True, slots=True)
class GatewayPath:
    name: str
    description: str
    websocket: bool = True  # kubectl's default protocol (for port-forward: the tunnel)
    demo: bool = False  # kubectl to the demo API server instead of the node gateway
    up: bool = False  # kubectl to `podgate up` (gateway and runtime in one process)
    tls_demo: bool = False  # kubectl to the one-hop API server (DemoApi) over TLS
    peer: str = ""  # the path its "× peer" ratio is taken against, in the same round


GATEWAY_PATHS: tuple[GatewayPath, ...] = (
    GatewayPath(PEER, "client in the pod's netns -> target (the limit inside the pod)"),
    GatewayPath(
        "gateway-tunnel",
        "kubectl 1.33 port-forward (WebSocket tunnel) -> TLS -> podgate node -> runtime -> pod",
    ),
    GatewayPath(
        "gateway-spdy",
        "the same with KUBECTL_PORT_FORWARD_WEBSOCKETS=false (SPDY)",
        websocket=False,
    ),
    GatewayPath(
        "up-tunnel",
        "kubectl 1.33 port-forward (tunnel) -> TLS -> podgate up (gateway handing the stream "
        "to its runtime in-process) -> pod",
        up=True,
        peer="tls-tunnel",
    ),
    GatewayPath(
        "up-spdy",
        "the same with KUBECTL_PORT_FORWARD_WEBSOCKETS=false (SPDY)",
        websocket=False,
        up=True,
        peer="tls-spdy",
    ),
    GatewayPath(
        "tls-tunnel",
        "kubectl 1.33 port-forward (tunnel) -> TLS -> podgate's one-hop API server (DemoApi, "
        "client certificates) -> host target: the peer of up-tunnel",
        tls_demo=True,
    ),
    GatewayPath(
        "tls-spdy",
        "the same with KUBECTL_PORT_FORWARD_WEBSOCKETS=false (SPDY): the peer of up-spdy",
        websocket=False,
        tls_demo=True,
    ),
    GatewayPath(
        "demo-tunnel",
        "kubectl 1.33 port-forward (tunnel) -> podgate demo API server (plain HTTP) -> host target",
        demo=True,
    ),
    GatewayPath(
        "demo-spdy",
        "the same with KUBECTL_PORT_FORWARD_WEBSOCKETS=false (SPDY)",
        websocket=False,
        demo=True,
    ),
)
GATEWAY_PATH_NAMES = tuple(p.name for p in GATEWAY_PATHS)
_PEER_OF = {p.name: p.peer for p in GATEWAY_PATHS if p.peer}
# The demo-* paths repeat the loopback part's kubectl-* paths, so they run only when asked for.
DEFAULT_GATEWAY_PATHS = tuple(p.name for p in GATEWAY_PATHS if not p.demo)
# The loopback benchmark's kubectl paths, which the demo-* paths reuse.
_DEMO_SPECS = {"demo-tunnel": "kubectl-tunnel", "demo-spdy": "kubectl-spdy"}


@dataclass(frozen=True, slots=True)
class Flood:
    name: str
    kind: str  # echo or bulk
    websocket: bool  # kubectl exec's default (WebSocket v5); False: SPDY


FLOODS: tuple[Flood, ...] = (
    Flood("echo", "echo", websocket=True),
    Flood("echo", "echo", websocket=False),
    Flood("bulk", "bulk", websocket=True),
    Flood("bulk", "bulk", websocket=False),
)

PF_HEADERS = (
    "path",
    "dir",
    "GB/s (min–max)",
    "× in-netns (min–max)",
    "× peer (min–max)",
    "gateway s/GB",
    "runtime s/GB",
    "gw+rt s/GB",
    "kubectl s/GB",
    "client s/GB",
    "verified",
)
PF_NOTE = (
    "kubectl port-forward through podgate node (TLS) and podgate runtime into the pod. "
    "× in-netns = against a client inside the pod's netns in the same round (demo-*: their "
    "target is on the host's loopback). CPU seconds per GB moved: gateway = podgate node "
    "(demo-*, tls-*: the one-hop API server; up-*: podgate up, gateway and runtime in one "
    "process), runtime = the runtime daemon, kubectl = kubectl. × peer: up-* against tls-* "
    "(kubectl -> TLS -> podgate's one-hop server) of the same round and protocol."
)
FLOOD_HEADERS = (
    "exec",
    "kubectl ↔ gateway",
    "MB/s (min–max)",
    "MB delivered",
    "gateway s/MB",
    "runtime s/MB",
    "gw+rt s/MB",
    "× containerd MB/s; CPU/MB",
    "kubectl s/MB",
    "B/read",
    "checked",
)
FLOOD_NOTE = (
    "kubectl exec through podgate node into the pod; MB = 10^6 bytes of stdout counted at "
    "kubectl. CPU seconds per MB: gateway = podgate node, runtime = the daemon's own threads "
    "(it relays the exec's pipes; the writer itself not counted), kubectl = kubectl. "
    "B/read = mean bytes per read of kubectl's stdout. "
    f"containerd 1.6, echo flood: {CONTAINERD_FLOOD_MB_PER_S} MB/s at "
    f"{CONTAINERD_FLOOD_CPU_S_PER_MB} CPU-s/MB (runtime + shim)."
)


def default_flood_seconds(size: int) -> float:
    """FLOOD_SECONDS at 1 GiB per port-forward run, proportionally less for smaller runs."""
    return max(MIN_FLOOD_SECONDS, min(FLOOD_SECONDS, FLOOD_SECONDS * size / FULL_FLOOD_SIZE))


def unavailable(options: Options) -> str | None:
    """Why this part cannot run here (None: it can)."""
    reason = bench_runtime.unavailable()
    if reason is not None:
        return reason
    if find_kubectl(options.kubectl) is None:
        return f"{KUBECTL_VERSION_FILE} not found next to kubectl"
    return None


def own_cpu_seconds(pid: int) -> float:
    """User+system CPU of one process's own threads: not its children, such as the exec'd
    commands the runtime daemon runs (0 if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()
    # fields[0] is field 3 (state); utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_SECOND


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    todo = _live_children(pid)
    while todo:
        child = todo.pop()
        out.append(child)
        todo += _live_children(child)
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


# --------------------------------------------------------------------------- driver


class GatewayBench:
    """The runtime and its pod, the node gateway, the kubectl relays, and the runs."""

    def __init__(self, procs: ProcessSet, options: Options, section: dict[str, Any]) -> None:
        self.procs = procs
        self.options = options
        self.section = section
        self.py = sys.executable
        self.runtime = RuntimeBench(procs, options, section)
        self.kubectl = find_kubectl(options.kubectl) or ""
        self.node: Child | None = None
        self.kubeconfig = ""
        self.ports: dict[str, int] = {}  # path -> local port of its kubectl port-forward
        self.watch: dict[str, dict[str, int]] = {}  # path -> processes whose CPU its runs count
        self.demo: Peers | None = None
        self.up: UpRuntime | None = None  # `podgate up` and its bench pod (up-* paths)
        self.up_section: dict[str, Any] = {"meta": {}, "skipped": {}}
        self.up_kubeconfig = ""
        self.host_target: Child | None = None  # tls-* paths: the target on the host
        self.tls_server: Child | None = None
        self.tls_kubeconfig = ""

    # -- start

    def start(self, paths: Sequence[GatewayPath]) -> list[GatewayPath]:
        rt = self.runtime
        rt.start([p for p in RUNTIME_PATHS if p.name == PEER])
        assert rt.daemon is not None
        cri_socket = rt.daemon.wait_for(bench_runtime.READY_LINE)[0][1]
        argv = [self.py, "-m", "podgate", "node", "--state-dir", str(self.procs.workdir / "node")]
        argv += ["--cri-socket", cri_socket, "--port", "0"]
        if self.options.profile_dir is not None:
            profile = self.options.profile_dir / "node-gateway.prof"
            argv[1:2] = ["-m", "cProfile", "-o", str(profile), "-m"]
        self.node = self.procs.start("node", argv)
        ready = self.node.wait_for(NODE_READY_LINE)[0]
        self.kubeconfig = ready[3]
        meta = self.section["meta"]
        meta["node_api"] = ready[1]
        meta["runtime_version"] = ready[2].strip()
        meta["pids"]["gateway"] = self.node.pid
        meta["kubectl"] = self._kubectl_version()
        target = rt.watch["target"]
        usable = []
        if any(p.up for p in paths):
            self._start_up()
        if any(p.tls_demo for p in paths):
            self._start_tls_server()
        for spec in paths:
            if spec.name == PEER:
                usable.append(spec)
            elif spec.up:
                assert self.up is not None and self.up.daemon is not None
                self.ports[spec.name] = self._start_port_forward(
                    spec, self.up.bulk_port, self.up_kubeconfig
                )
                # One process: its CPU is the gateway's and the runtime's together.
                self.watch[spec.name] = {
                    "gateway": self.up.daemon.pid,
                    "target": self.up.watch["target"],
                    "kubectl": self._kubectl_pid(spec.name),
                }
                usable.append(spec)
            elif spec.tls_demo:
                assert self.tls_server is not None and self.host_target is not None
                self.ports[spec.name] = self._start_port_forward(
                    spec, BULK_REMOTE_PORT, self.tls_kubeconfig, DEMO_POD_NAME
                )
                self.watch[spec.name] = {
                    "server": self.tls_server.pid,
                    "target": self.host_target.pid,
                    "kubectl": self._kubectl_pid(spec.name),
                }
                usable.append(spec)
            elif not spec.demo:
                self.ports[spec.name] = self._start_port_forward(spec, rt.bulk_port)
                self.watch[spec.name] = {
                    "gateway": self.node.pid,
                    "runtime": rt.watch["runtime"],
                    "target": target,
                    "kubectl": self._kubectl_pid(spec.name),
                }
                usable.append(spec)
        demo = [p for p in paths if p.demo]
        if demo:
            usable += self._start_demo(demo)
        return usable

    def _start_up(self) -> None:
        """`podgate up` with no sample pods and the bench pod in its runtime."""
        self.up = UpRuntime(self.procs, self.options, self.up_section)
        self.up.start([p for p in RUNTIME_PATHS if p.name == PEER])
        if PLAIN not in self.up.pods:
            raise ChildError(f"no bench pod in podgate up: {self.up_section['skipped']}")
        self.up_kubeconfig = self.up.kubeconfig
        assert self.up.daemon is not None
        self.section["meta"]["pids"]["up"] = self.up.daemon.pid

    def _start_tls_server(self) -> None:
        """The host target and podgate's one-hop API server over TLS in front of it."""
        self.host_target = self.procs.start("host-target", [self.py, "-m", "bench.target"])
        ports = self.host_target.wait_for_json()
        argv = [self.py, "-m", "bench.server", "--bulk-port", str(ports["bulk_port"])]
        argv += ["--echo-port", str(ports["echo_port"]), "--loop", self.options.loop]
        argv += ["--tls-dir", str(self.procs.workdir / "tls-server")]
        if self.options.profile_dir is not None:
            argv += ["--profile", str(self.options.profile_dir / "tls-server.prof")]
        self.tls_server = self.procs.start("tls-server", argv)
        self.tls_kubeconfig = str(self.tls_server.wait_for_json()["kubeconfig"])
        self.section["meta"]["pids"]["tls_server"] = self.tls_server.pid

    def _env(
        self, name: str, websocket_var: str, websocket: bool, kubeconfig: str = ""
    ) -> dict[str, str]:
        home = self.procs.workdir / f"home-{name}"
        home.mkdir(exist_ok=True)
        env = dict(os.environ, HOME=str(home), KUBECONFIG=kubeconfig or self.kubeconfig)
        for var in ("KUBECTL_PORT_FORWARD_WEBSOCKETS", "KUBECTL_REMOTE_COMMAND_WEBSOCKETS"):
            env.pop(var, None)
        if not websocket:
            env[websocket_var] = "false"
        return env

    def _kubectl_version(self) -> str:
        env = self._env("version", "", True)
        done = self.procs.run([self.kubectl, "version", "--client", "-o", "json"], 30, env)
        try:
            return str(json.loads(done.stdout)["clientVersion"]["gitVersion"])
        except (ValueError, KeyError):
            return "?"

    def _start_port_forward(
        self,
        spec: GatewayPath,
        remote: int,
        kubeconfig: str = "",
        pod: str = bench_runtime.POD_NAME,
    ) -> int:
        env = self._env(spec.name, "KUBECTL_PORT_FORWARD_WEBSOCKETS", spec.websocket, kubeconfig)
        child = self.procs.start(
            f"kubectl-{spec.name}",
            [
                *(self.kubectl, "port-forward", "--namespace", bench_runtime.POD_NAMESPACE),
                *("--address", "127.0.0.1", f"pod/{pod}", f":{remote}"),
            ],
            env,
        )
        match = child.wait_for(KUBECTL_FORWARDING_LINE)[0]
        if int(match[2]) != remote:
            raise ChildError(f"kubectl forwards to {match[2]}, not {remote}")
        return int(match[1])

    def _kubectl_pid(self, name: str) -> int:
        return next(c.pid for c in self.procs.children if c.name == f"kubectl-{name}")

    def _start_demo(self, paths: Sequence[GatewayPath]) -> list[GatewayPath]:
        results = Results()
        # Their profiles (if any) go beside the node's, not over the loopback part's.
        self.demo = Peers(self.procs, self.options, results)
        specs = [p for p in PATHS if p.name in {_DEMO_SPECS[s.name] for s in paths}]
        started = {s.name for s in self.demo.start(specs)}
        self.section["skipped"].update({k: v for k, v in results.skipped.items() if k != "socat"})
        usable = []
        for spec in paths:
            if _DEMO_SPECS[spec.name] in started:
                peer = self.demo.by_path[_DEMO_SPECS[spec.name]]
                self.ports[spec.name] = peer.bulk_port
                self.watch[spec.name] = dict(peer.watch)
                usable.append(spec)
        return usable

    # -- port-forward runs

    def run_forward(self, spec: GatewayPath, direction: str, run: int) -> dict[str, Any]:
        row: dict[str, Any] = {"path": spec.name, "direction": direction, "run": run}
        if spec.name == PEER:
            argv = self.runtime.client_argv(
                next(p for p in RUNTIME_PATHS if p.name == PEER), direction
            )
            limit = self.options.run_timeout + CLIENT_STARTUP_SECONDS
            return self.procs.run_json(argv, limit, row)
        o = self.options
        argv = [
            *("throughput", "--via", "tcp", "--port", str(self.ports[spec.name])),
            *("--direction", direction, "--size", str(o.size), "--timeout", str(o.run_timeout)),
            *_watch_args(self.watch[spec.name]),
        ]
        return {**row, **run_client(self.procs, argv, o.run_timeout, o.loop, "tcp")}

    # -- exec floods

    def exec_argv(self, command: Sequence[str]) -> list[str]:
        return [
            *(self.kubectl, "exec", "--namespace", bench_runtime.POD_NAMESPACE),
            *(bench_runtime.POD_NAME, "-c", bench_runtime.CONTAINER_NAME, "--", *command),
        ]

    def flood_command(self, flood: Flood, seconds: float) -> list[str]:
        limit = f"{seconds:g}"
        if flood.kind == "echo":
            return ["timeout", limit, "sh", "-c", ECHO_LOOP]
        dd = ["dd", "if=/dev/zero", "bs=1M", f"count={self.options.size}", "iflag=count_bytes"]
        return ["timeout", limit, *dd, "status=none"]

    def run_flood(self, flood: Flood, seconds: float, run: int) -> dict[str, Any]:
        assert self.node is not None
        protocol = "WebSocket v5" if flood.websocket else "SPDY"
        row: dict[str, Any] = {"flood": flood.name, "protocol": protocol, "run": run}
        env = self._env(f"exec-{flood.name}", "KUBECTL_REMOTE_COMMAND_WEBSOCKETS", flood.websocket)
        argv = [
            *(self.py, "-m", "bench.gateway", "flood", "--kind", flood.kind),
            *("--seconds", f"{seconds:g}", "--size", str(self.options.size)),
            *("--watch", f"gateway={self.node.pid}"),
            *("--watch-own", f"runtime={self.runtime.watch['runtime']}"),
            "--",
            *self.exec_argv(self.flood_command(flood, seconds)),
        ]
        limit = seconds + FLOOD_GRACE_SECONDS + CLIENT_STARTUP_SECONDS
        try:
            done = self.procs.run(argv, limit, env)
        except subprocess.TimeoutExpired:
            return {**row, "error": f"flood client did not finish within {limit:.0f} s"}
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if not lines:
            tail = done.stderr.strip().splitlines()[-3:]
            return {**row, "error": f"flood client exited {done.returncode}: {' / '.join(tail)}"}
        result: dict[str, Any] = json.loads(lines[-1])
        return {**row, **result}

    def probe_disconnect(self) -> dict[str, Any]:
        """Kill kubectl in the middle of an echo flood: does the exec (and the relaying) stop?"""
        assert self.node is not None
        daemon = self.runtime.watch["runtime"]
        marker = f"podgate-bench-probe-{os.getpid()}"
        command = ["timeout", f"{PROBE_LIMIT_SECONDS:g}", "sh", "-c", ECHO_LOOP, marker]
        env = self._env("probe", "KUBECTL_REMOTE_COMMAND_WEBSOCKETS", True)
        out: dict[str, Any] = {"wait_seconds": DISCONNECT_WAIT_SECONDS, "marker": marker}
        child = self.procs.start("kubectl-probe", self.exec_argv(command), env)
        try:
            deadline = time.monotonic() + CLIENT_STARTUP_SECONDS
            while child.out_path.stat().st_size == 0:
                if child.proc.poll() is not None or time.monotonic() > deadline:
                    out["error"] = f"the probe's exec produced no output: {child.stderr_tail()}"
                    return out
                time.sleep(0.05)
            time.sleep(PROBE_READ_SECONDS)
        finally:
            child.stop()
        out["bytes_before_kill"] = child.out_path.stat().st_size
        time.sleep(DISCONNECT_WAIT_SECONDS)
        left = [p for p in _descendants(daemon) if marker.encode() in _cmdline(p)]
        out["exec_left_running"] = bool(left)
        # What the daemon and the gateway keep spending on an exec nobody reads any more.
        t0, rt0, gw0 = time.monotonic(), own_cpu_seconds(daemon), cpu_seconds(self.node.pid)
        time.sleep(DISCONNECT_SAMPLE_SECONDS)
        elapsed = time.monotonic() - t0
        out["runtime_cpu_per_s"] = (own_cpu_seconds(daemon) - rt0) / elapsed
        out["gateway_cpu_per_s"] = (cpu_seconds(self.node.pid) - gw0) / elapsed
        for pid in left:  # the probe's own exec: stopped by its id
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        return out

    def stop(self) -> None:
        if self.up is not None:
            self.up.stop()
        self.runtime.stop()


class UpRuntime(RuntimeBench):
    """`podgate up` in place of `podgate runtime`: the same bench pod, made through its CRI
    socket, behind the gateway of the same process."""

    kubeconfig = ""
    logs_prefix = "up-"

    def start(self, paths: Sequence[RuntimePath]) -> list[RuntimePath]:
        state = self.procs.workdir / "u"  # short: sockets live under it
        argv = [self.py, "-m", "podgate", "up", "--state-dir", str(state), "--port", "0"]
        argv += ["--examples", "", "--no-nri"]
        if self.options.profile_dir is not None:
            self.options.profile_dir.mkdir(parents=True, exist_ok=True)
            profile = self.options.profile_dir / "podgate-up.prof"
            argv[1:2] = ["-m", "cProfile", "-o", str(profile), "-m"]
        self.daemon = self.procs.start("up", argv)
        ready = self.daemon.wait_for(UP_READY_LINE)[0]
        self.kubeconfig = ready[2]
        self.cri = bench_runtime.Cri(ready[3])
        self.section["meta"]["pods"] = {}
        return [p for p in paths if self._start_pod(p.handler)]


def run_gateway(
    options: Options,
    progress: Callable[[str], None] = lambda _: None,
    flood_seconds: float | None = None,
    paths: Sequence[str] = DEFAULT_GATEWAY_PATHS,
) -> dict[str, Any]:
    """Run the node gateway benchmark; returns its section of the results (JSON-ready)."""
    if flood_seconds is None:
        flood_seconds = default_flood_seconds(options.size)
    section: dict[str, Any] = {
        "meta": {"size": options.size, "runs": options.runs, "flood_seconds": flood_seconds},
        "skipped": {},
        "error": None,
        "throughput": [],
        "floods": [],
        "disconnect": None,
    }
    reason = unavailable(options)
    if reason is not None:
        section["skipped"]["gateway"] = reason
        section["summary"] = {"throughput": [], "floods": []}
        return section
    if options.profile_dir is not None:
        # Profiles of this part's daemon and servers go to a directory of their own.
        profile_dir = options.profile_dir / "gateway"
        profile_dir.mkdir(parents=True, exist_ok=True)
        options = replace(options, profile_dir=profile_dir)
    wanted = [PEER, *(p for p in paths if p != PEER)]
    specs = [p for p in GATEWAY_PATHS if p.name in wanted]
    with ProcessSet(cwd=REPO_ROOT, prefix="pggw-") as procs:
        bench = GatewayBench(procs, options, section)
        phases = section["meta"]["phase_seconds"] = {}
        t0 = time.monotonic()
        try:
            progress("gateway: starting podgate runtime, the pod, podgate node and kubectl")
            specs = bench.start(specs)
            phases["start"], t0 = time.monotonic() - t0, time.monotonic()
            for run in range(1, options.runs + 1):
                for spec in specs:
                    for direction in options.directions:
                        progress(f"gateway run {run}/{options.runs}: {spec.name} {direction}")
                        section["throughput"].append(bench.run_forward(spec, direction, run))
            phases["port_forward"], t0 = time.monotonic() - t0, time.monotonic()
            for run in range(1, options.runs + 1):
                for flood in FLOODS:
                    protocol = "WebSocket" if flood.websocket else "SPDY"
                    progress(f"gateway run {run}/{options.runs}: exec {flood.name} ({protocol})")
                    section["floods"].append(bench.run_flood(flood, flood_seconds, run))
            phases["floods"], t0 = time.monotonic() - t0, time.monotonic()
            progress("gateway: killing kubectl in the middle of an exec flood")
            section["disconnect"] = bench.probe_disconnect()
            phases["probe"] = time.monotonic() - t0
        except Exception as exc:  # ChildError, grpc.RpcError, ...: this part failed, not the bench
            section["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            progress("gateway: removing the pod, stopping the node gateway and the daemon")
            bench.stop()
    section["summary"] = {
        "throughput": summarize_forward(section["throughput"]),
        "floods": summarize_floods(section["floods"]),
    }
    return section


# --------------------------------------------------------------------------- summary, report


def summarize_forward(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per path and direction: GB/s, ratio to direct-in-netns of the same round, CPU s/GB."""
    peer = {
        (r["direction"], r["run"]): r["bytes"] / r["seconds"]
        for r in rows
        if r["path"] == PEER and not r.get("error") and r.get("verified")
    }
    rates = {
        (r["path"], r["direction"], r["run"]): r["bytes"] / r["seconds"]
        for r in rows
        if not r.get("error") and r.get("verified")
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
        # up-*: against its own peer path (tls-*) of the same round.
        of = _PEER_OF.get(path, "")
        peer_ratios = [
            r["bytes"] / r["seconds"] / rates[(of, direction, r["run"])]
            for r in ok
            if (of, direction, r["run"]) in rates
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
                "runs": len(group),
                "ok_runs": len(ok),
                "errors": sorted({str(r["error"]) for r in group if r.get("error")}),
                "verified_bytes": [r["bytes"] for r in ok],
                "gbps": _spread([r["bytes"] / r["seconds"] / GB for r in ok]),
                "ratio": _spread(ratios),
                "peer": of,
                "peer_ratio": _spread(peer_ratios),
                # The front process and the runtime together (podgate up: one process).
                "gw_rt_cpu_s_per_gb": _spread(
                    [
                        sum(r["cpu"].get(n, 0.0) for n in ("gateway", "server", "runtime"))
                        / (r["bytes"] / GB)
                        for r in ok
                    ]
                ),
                # demo-*: the demo API server stands where the gateway does
                "gateway_cpu_s_per_gb": per_gb("gateway", "server"),
                "runtime_cpu_s_per_gb": per_gb("runtime"),
                "kubectl_cpu_s_per_gb": per_gb("kubectl"),
                "target_cpu_s_per_gb": per_gb("target"),
                "client_cpu_s_per_gb": _spread([r["client_cpu"] / (r["bytes"] / GB) for r in ok]),
            }
        )
    return out


def summarize_floods(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per flood and protocol: MB/s of stdout and CPU seconds per MB of each process."""
    out = []
    for flood, protocol in dict.fromkeys((r["flood"], r["protocol"]) for r in rows):
        group = [r for r in rows if r["flood"] == flood and r["protocol"] == protocol]
        ok = [r for r in group if not r.get("error") and r.get("verified") and r["bytes"]]

        def per_mb(*names: str, ok: list[dict[str, Any]] = ok) -> dict[str, float] | None:
            vals = [sum(r["cpu"].get(n, 0.0) for n in names) / (r["bytes"] / MB) for r in ok]
            return _spread(vals)

        both = per_mb("gateway", "runtime")
        out.append(
            {
                "flood": flood,
                "protocol": protocol,
                "runs": len(group),
                "ok_runs": len(ok),
                "errors": sorted({str(r["error"]) for r in group if r.get("error")}),
                "bytes": _spread([float(r["bytes"]) for r in ok]),
                "mb_per_s": _spread([r["bytes"] / r["seconds"] / MB for r in ok]),
                "gateway_cpu_s_per_mb": per_mb("gateway"),
                "runtime_cpu_s_per_mb": per_mb("runtime"),
                "gateway_runtime_cpu_s_per_mb": both,
                "vs_containerd": _vs_containerd(flood, ok, both),
                "bytes_per_read": _spread([r["bytes"] / r["reads"] for r in ok if r.get("reads")]),
                "kubectl_cpu_s_per_mb": per_mb("kubectl"),
                "client_cpu_s_per_mb": _spread([r["client_cpu"] / (r["bytes"] / MB) for r in ok]),
            }
        )
    return out


def _vs_containerd(
    flood: str, ok: list[dict[str, Any]], cpu_per_mb: dict[str, float] | None
) -> dict[str, float] | None:
    """Medians against containerd's echo flood figures (only the echo flood is comparable)."""
    if flood != "echo" or cpu_per_mb is None:
        return None
    rates = sorted(r["bytes"] / r["seconds"] / MB for r in ok)
    return {
        "mb_per_s": statistics.median(rates) / CONTAINERD_FLOOD_MB_PER_S,
        "cpu_s_per_mb": cpu_per_mb["median"] / CONTAINERD_FLOOD_CPU_S_PER_MB,
    }


def _sig(spread: dict[str, float] | None, median_only: bool = False) -> str:
    """Three significant digits: CPU per MB spans 10^-4 (bulk) to 1 (containerd's echo)."""
    if spread is None:
        return "–"
    med, lo, hi = (f"{spread[k]:.3g}" for k in ("median", "min", "max"))
    return med if median_only or lo == hi else f"{med} ({lo}–{hi})"


def forward_rows(section: dict[str, Any]) -> list[list[str]]:
    out = []
    for s in section["summary"]["throughput"]:
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
                _fmt_ratio(s["peer_ratio"]) if s.get("peer") else "–",
                _median(s["gateway_cpu_s_per_gb"]),
                _median(s["runtime_cpu_s_per_gb"]),
                _median(s.get("gw_rt_cpu_s_per_gb")),
                _median(s["kubectl_cpu_s_per_gb"]),
                _median(s["client_cpu_s_per_gb"]),
                verified,
            ]
        )
    return out


def flood_rows(section: dict[str, Any]) -> list[list[str]]:
    out = []
    for s in section["summary"]["floods"]:
        if s["ok_runs"]:
            checked = f"{s['ok_runs']}/{s['runs']}"
        else:
            checked = "FAILED: " + "; ".join(s["errors"])[:120]
        bytes_, vs = s["bytes"], s["vs_containerd"]
        out.append(
            [
                s["flood"],
                s["protocol"],
                _sig(s["mb_per_s"]),
                "–" if bytes_ is None else f"{bytes_['median'] / MB:.1f}",
                _sig(s["gateway_cpu_s_per_mb"], True),
                _sig(s["runtime_cpu_s_per_mb"], True),
                _sig(s["gateway_runtime_cpu_s_per_mb"]),
                "–" if vs is None else f"{vs['mb_per_s']:.2f}×; {vs['cpu_s_per_mb']:.2f}×",
                _sig(s["kubectl_cpu_s_per_mb"], True),
                _median(s["bytes_per_read"], 0),
                checked,
            ]
        )
    return out


def title(section: dict[str, Any]) -> str:
    meta = section["meta"]
    return (
        f"through the node gateway (podgate node, TLS) into a pod of podgate runtime, "
        f"{format_size(meta['size'])} per port-forward run, exec floods of "
        f"{meta['flood_seconds']:g} s, median of {meta['runs']} run(s) (min–max); "
        f"kubectl {meta.get('kubectl', '?')}"
    )


def _notes(section: dict[str, Any]) -> list[str]:
    notes = [f"skipped {name}: {reason}" for name, reason in section["skipped"].items()]
    if section["meta"].get("warning"):
        notes.append(f"warning: {section['meta']['warning']}")
    probe = section.get("disconnect")
    if probe:
        if probe.get("error"):
            notes.append(f"disconnect probe failed: {probe['error']}")
        elif probe["exec_left_running"]:
            notes.append(
                f"exec outlives its client: {probe['wait_seconds']:g} s after kubectl was "
                f"killed, the echo flood still ran; runtime kept spending "
                f"{probe['runtime_cpu_per_s']:.2f} and the gateway "
                f"{probe['gateway_cpu_per_s']:.2f} CPU-s per second on it"
            )
        else:
            notes.append(
                f"disconnect probe: the exec stopped within {probe['wait_seconds']:g} s of "
                "kubectl being killed"
            )
    if section["error"]:
        notes.append(f"gateway benchmark failed: {section['error']}")
    return notes


def _tables(section: dict[str, Any]) -> list[tuple[str, str, tuple[str, ...], list[list[str]]]]:
    return [
        (title(section), PF_NOTE, PF_HEADERS, forward_rows(section)),
        (
            "exec output floods through the node gateway",
            FLOOD_NOTE,
            FLOOD_HEADERS,
            flood_rows(section),
        ),
    ]


def print_report(section: dict[str, Any], console: Console) -> None:
    print_tables(_tables(section), _notes(section), console, label_columns=2)


def markdown(section: dict[str, Any]) -> str:
    return markdown_tables(_tables(section), _notes(section))


def failed(section: dict[str, Any]) -> bool:
    summary = section["summary"]
    return bool(section["error"]) or any(
        s["errors"] for s in summary["throughput"] + summary["floods"]
    )


# --------------------------------------------------------------------------- flood client


class _Check:
    """Whether a flood's stdout is what its command writes, without keeping it."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.received = 0
        self.first_bad: int | None = None

    def feed(self, data: bytes) -> None:
        """`data` is at most READ_BYTES: one memcmp; only a failing read is searched."""
        if self.first_bad is None:
            start = self.received % 2 if self.kind == "echo" else 0
            expected = _ECHO_PATTERN if self.kind == "echo" else _ZEROS
            if not expected.startswith(data, start):
                bad = next(i for i, b in enumerate(data) if b != expected[start + i])
                self.first_bad = self.received + bad
        self.received += len(data)


def _parse_pids(values: Sequence[str]) -> dict[str, int]:
    out = {}
    for value in values:
        name, _, pid = value.partition("=")
        out[name] = int(pid)
    return out


def flood(
    kind: str,
    seconds: float,
    size: int,
    watch: dict[str, int],
    own: dict[str, int],
    argv: Sequence[str],
) -> dict[str, Any]:
    """Run kubectl, count and check its stdout until EOF; CPU from the first byte to EOF."""
    result: dict[str, Any] = {"bytes": 0, "seconds": 0.0, "verified": False, "error": None}
    check = _Check(kind)
    with tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - this client has no threads
        )
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + seconds + FLOOD_GRACE_SECONDS + CLIENT_STARTUP_SECONDS
        t0 = c0 = 0.0
        w0: dict[str, float] = {}
        end_state = "eof"
        reads = 0
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    end_state = "deadline"
                    break
                data = os.read(fd, READ_BYTES)
                if not t0:  # the clock and CPU start at the first byte: exec setup excluded
                    w0 = {n: cpu_seconds(p) for n, p in watch.items()}
                    w0 |= {n: own_cpu_seconds(p) for n, p in own.items()}
                    w0["kubectl"] = cpu_seconds(proc.pid)
                    c0, t0 = time.process_time(), time.perf_counter()
                if not data:
                    break
                check.feed(data)
                reads += 1
            if t0:
                result["seconds"] = time.perf_counter() - t0
                result["client_cpu"] = time.process_time() - c0
                now = {n: cpu_seconds(p) for n, p in watch.items()}
                now |= {n: own_cpu_seconds(p) for n, p in own.items()}
                now["kubectl"] = cpu_seconds(proc.pid)  # before it is reaped
                result["cpu"] = {n: now[n] - w0[n] for n in w0}
            try:
                code = proc.wait(KUBECTL_EXIT_SECONDS)
            except subprocess.TimeoutExpired:
                code = None
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        stderr.seek(0)
        err_text = stderr.read().decode(errors="replace").strip()
    result["bytes"] = check.received
    result["reads"] = reads  # of kubectl's stdout: how finely the output arrives
    result["exit_code"] = code
    expected_code = {TIMEOUT_EXIT_CODE} if kind == "echo" else {0, TIMEOUT_EXIT_CODE}
    if end_state == "deadline":
        result["error"] = f"no end of output within {seconds + FLOOD_GRACE_SECONDS:.0f} s"
    elif check.first_bad is not None:
        result["error"] = f"unexpected output at byte {check.first_bad}"
    elif code not in expected_code:
        result["error"] = f"kubectl exited {code}: {err_text[-300:]}"
    elif kind == "echo" and check.received % 2:
        result["error"] = "output ended inside a line (each `echo a` is one 2-byte write)"
    elif kind == "bulk" and code == 0 and check.received != size:
        result["error"] = f"dd finished after {check.received} of {size} bytes"
    elif not check.received:
        result["error"] = "no output"
    result["verified"] = result["error"] is None
    return result


def client_main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gateway", usage="%(prog)s flood [options] -- kubectl exec ..."
    )
    parser.add_argument("mode", choices=("flood",))
    parser.add_argument("--kind", choices=("echo", "bulk"), required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--watch", action="append", default=[], metavar="NAME=PID")
    parser.add_argument("--watch-own", action="append", default=[], metavar="NAME=PID")
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    command = argv[split + 1 :]
    if not command:
        parser.error("the kubectl command goes after --")
    try:
        result = flood(
            args.kind,
            args.seconds,
            args.size,
            _parse_pids(args.watch),
            _parse_pids(args.watch_own),
            command,
        )
    except Exception as exc:  # any failure is this run's result, not a crash of the bench
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    client_main()
