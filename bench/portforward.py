"""The port-forward benchmark: start the peers, run every path interleaved, summarise.

Paths (each moves the same bytes through a different relay to the same target process):

    direct          client -> target                         (the loopback limit)
    socat           client -> socat (fork, 8 KiB blocks) -> target
    podgate-spdy    PortForwardSession (SPDY/3.1) -> podgate API server -> target
    podgate-tunnel  the same, SPDY inside WebSocket (what kubectl 1.31+ speaks)
    podgate-ws      portforward_websocket (v4.channel.k8s.io, the Python client's protocol)
    kubectl-tunnel  socket -> kubectl 1.33 port-forward (default: tunnel) -> podgate -> target
    kubectl-spdy    the same with KUBECTL_PORT_FORWARD_WEBSOCKETS=false (SPDY)

Runs are interleaved (run 1 of every path, then run 2, ...), so drift on a shared machine hits
every path alike, and each ratio compares a path with the direct run next to it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import (
    BULK_REMOTE_PORT,
    ECHO_REMOTE_PORT,
    POD_NAME,
    POD_NAMESPACE,
    resolve_loop,
)
from bench.procs import Child, ChildError, ProcessSet
from podgate.cli.demo import write_kubeconfig

REPO_ROOT = Path(__file__).resolve().parent.parent
KUBECTL_VERSION_FILE = "kubectl.1.33"
# 10^9 bytes: the unit of every GB/s and CPU-s/GB figure.
GB = 1e9
# Extra time a client process gets beyond its run's own limit (start-up, session setup).
CLIENT_STARTUP_SECONDS = 30.0
# How long socat gets to start listening.
SOCAT_READY_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class PathSpec:
    name: str
    via: str  # the client: tcp, spdy, tunnel or ws
    description: str
    relay: str | None = None  # the non-podgate relay process (socat, kubectl), if any
    podgate: bool = False  # a podgate server carries the bytes
    stream_conns: bool = False  # supports new streams on one open session
    session_conns: bool = False  # measure new sessions (upgrade + one stream)


PATHS: tuple[PathSpec, ...] = (
    PathSpec("direct", "tcp", "client -> target (loopback limit)"),
    PathSpec("socat", "tcp", "client -> socat fork -> target", relay="socat"),
    PathSpec(
        "podgate-spdy",
        "spdy",
        "podgate client (SPDY) -> podgate server -> target",
        podgate=True,
        stream_conns=True,
        session_conns=True,
    ),
    PathSpec(
        "podgate-tunnel",
        "tunnel",
        "podgate client (SPDY in WebSocket) -> podgate server -> target",
        podgate=True,
        stream_conns=True,
        session_conns=True,
    ),
    PathSpec(
        "podgate-ws",
        "ws",
        "podgate client (WebSocket v4 channels) -> podgate server -> target",
        podgate=True,
        session_conns=True,
    ),
    PathSpec(
        "kubectl-tunnel",
        "tcp",
        "client -> kubectl 1.33 port-forward (tunnel) -> podgate server -> target",
        relay="kubectl",
        podgate=True,
    ),
    PathSpec(
        "kubectl-spdy",
        "tcp",
        "client -> kubectl 1.33 port-forward (SPDY) -> podgate server -> target",
        relay="kubectl",
        podgate=True,
    ),
)
PATH_NAMES = tuple(p.name for p in PATHS)
DIRECTIONS = ("upload", "download")


@dataclass(slots=True)
class Options:
    size: int
    runs: int
    paths: Sequence[str] = PATH_NAMES
    directions: Sequence[str] = DIRECTIONS
    conns: int = 2000
    sessions: int = 200
    conn_budget: float = 20.0
    run_timeout: float = 120.0
    throughput: bool = True
    loop: str = "podgate"  # event loop of the podgate servers and clients (LOOP_CHOICES)
    kubectl: str | None = None
    profile_dir: Path | None = None


@dataclass(slots=True)
class Peer:
    """Where a path's client connects, and which processes' CPU its runs attribute."""

    bulk_port: int
    echo_port: int
    watch: dict[str, int] = field(default_factory=dict)
    # For the echo port, when other processes carry it (socat runs one relay per port).
    echo_watch: dict[str, int] | None = None


@dataclass(slots=True)
class Results:
    meta: dict[str, Any] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    throughput: list[dict[str, Any]] = field(default_factory=list)
    conns: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "meta": self.meta,
            "skipped": self.skipped,
            "throughput": self.throughput,
            "conns": self.conns,
            "summary": {
                "throughput": summarize_throughput(self.throughput),
                "conns": summarize_conns(self.conns),
            },
        }


# --------------------------------------------------------------------------- peers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(child: Child, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return
        except OSError:
            if child.proc.poll() is not None:
                raise ChildError(f"{child.name} exited: {child.stderr_tail()}") from None
            if time.monotonic() > deadline:
                raise ChildError(f"{child.name} is not listening on {port}") from None
            time.sleep(0.05)


def find_kubectl(explicit: str | None) -> str | None:
    """kubectl 1.33 next to the `kubectl` on PATH (where the SDK keeps its versions)."""
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    candidate = Path(os.path.realpath(kubectl)).parent / KUBECTL_VERSION_FILE
    return str(candidate) if os.access(candidate, os.X_OK) else None


class Peers:
    """Starts the target, the relays and the podgate servers a run needs."""

    def __init__(self, procs: ProcessSet, options: Options, results: Results) -> None:
        self.procs = procs
        self.options = options
        self.results = results
        self.py = sys.executable
        self.by_path: dict[str, Peer] = {}
        self.target: Child | None = None

    def start(self, paths: Sequence[PathSpec]) -> list[PathSpec]:
        """Start what `paths` need; returns the paths that could be set up."""
        target = self.procs.start("target", [self.py, "-m", "bench.target"])
        ready = target.wait_for_json()
        self.target = target
        bulk, echo = int(ready["bulk_port"]), int(ready["echo_port"])
        self.results.meta["target_loop"] = ready["loop"]
        servers = {}
        for spec in paths:  # start every server first: they import in parallel
            if spec.podgate:
                servers[spec.name] = self._start_server(spec.name, bulk, echo)
        usable = []
        for spec in paths:
            watch = {"target": target.pid}
            if spec.name == "direct":
                peer: Peer | None = Peer(bulk, echo, watch)
            elif spec.name == "socat":
                peer = self._start_socat(bulk, echo, watch)
            else:
                server = servers[spec.name]
                info = server.wait_for_json()
                self.results.meta["server_loop"] = info["loop"]
                watch["server"] = server.pid
                if spec.relay == "kubectl":
                    peer = self._start_kubectl(spec.name, int(info["port"]), watch)
                else:
                    port = int(info["port"])
                    peer = Peer(port, port, watch)
            if peer is not None:
                self.by_path[spec.name] = peer
                usable.append(spec)
        return usable

    def _start_server(self, name: str, bulk: int, echo: int) -> Child:
        argv = [self.py, "-m", "bench.server", "--bulk-port", str(bulk), "--echo-port", str(echo)]
        argv += ["--loop", self.options.loop]
        if self.options.profile_dir is not None:
            self.options.profile_dir.mkdir(parents=True, exist_ok=True)
            argv += ["--profile", str(self.options.profile_dir / f"server-{name}.prof")]
        return self.procs.start(f"server-{name}", argv)

    def _start_socat(self, bulk: int, echo: int, watch: dict[str, int]) -> Peer | None:
        socat = shutil.which("socat")
        if socat is None:
            self.results.skipped["socat"] = "socat is not installed (apt-get install socat)"
            return None
        ports = []
        echo_watch = dict(watch)
        for name, upstream in (("socat", bulk), ("socat-echo", echo)):
            port = _free_port()
            child = self.procs.start(
                name,
                [
                    socat,
                    f"TCP-LISTEN:{port},bind=127.0.0.1,reuseaddr,fork,backlog=1024",
                    f"TCP:127.0.0.1:{upstream}",
                ],
            )
            _wait_listening(child, port, SOCAT_READY_SECONDS)
            ports.append(port)
            (watch if name == "socat" else echo_watch)["socat"] = child.pid
        version = subprocess.run(
            [socat, "-V"], capture_output=True, text=True, check=False
        ).stdout.splitlines()
        self.results.meta["socat"] = next((v for v in version if "version" in v), "?").strip()
        return Peer(ports[0], ports[1], watch, echo_watch)

    def _start_kubectl(self, name: str, api_port: int, watch: dict[str, int]) -> Peer | None:
        kubectl = find_kubectl(self.options.kubectl)
        if kubectl is None:
            self.results.skipped[name] = f"{KUBECTL_VERSION_FILE} not found next to kubectl"
            return None
        home = self.procs.workdir / f"home-{name}"
        home.mkdir()
        kubeconfig = home / "kubeconfig"
        write_kubeconfig(str(kubeconfig), "127.0.0.1", api_port)
        env = dict(os.environ, HOME=str(home), KUBECONFIG=str(kubeconfig))
        env.pop("KUBECTL_PORT_FORWARD_WEBSOCKETS", None)
        if name == "kubectl-spdy":
            env["KUBECTL_PORT_FORWARD_WEBSOCKETS"] = "false"
        version = self.procs.run([kubectl, "version", "--client", "-o", "json"], 30, env)
        try:
            self.results.meta["kubectl"] = json.loads(version.stdout)["clientVersion"]["gitVersion"]
        except (ValueError, KeyError):
            self.results.meta["kubectl"] = "?"
        child = self.procs.start(
            name,
            [
                kubectl,
                "port-forward",
                "--namespace",
                POD_NAMESPACE,
                "--address",
                "127.0.0.1",
                f"pod/{POD_NAME}",
                f":{BULK_REMOTE_PORT}",
                f":{ECHO_REMOTE_PORT}",
            ],
            env,
        )
        matches = child.wait_for(r"^Forwarding from 127\.0\.0\.1:(\d+) -> (\d+)$", count=2)
        local = {int(m[2]): int(m[1]) for m in matches}
        watch["kubectl"] = child.pid
        return Peer(local[BULK_REMOTE_PORT], local[ECHO_REMOTE_PORT], watch)


# --------------------------------------------------------------------------- runs


def _watch_args(watch: dict[str, int]) -> list[str]:
    out = []
    for name, pid in watch.items():
        out += ["--watch", f"{name}={pid}"]
    return out


def run_client(
    procs: ProcessSet, argv: list[str], timeout: float, loop: str, via: str
) -> dict[str, Any]:
    argv = [sys.executable, "-m", "bench.client", *argv]
    if via != "tcp":
        argv += ["--loop", loop]
    try:
        done = procs.run(argv, timeout + CLIENT_STARTUP_SECONDS)
    except subprocess.TimeoutExpired:
        return {"error": f"client did not finish within {timeout + CLIENT_STARTUP_SECONDS:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = done.stderr.strip().splitlines()[-3:]
        return {"error": f"client exited {done.returncode}: {' / '.join(tail)}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def run_throughput(
    procs: ProcessSet,
    spec: PathSpec,
    peer: Peer,
    direction: str,
    run: int,
    options: Options,
) -> dict[str, Any]:
    argv = [
        "throughput",
        "--via",
        spec.via,
        "--port",
        str(peer.bulk_port),
        "--direction",
        direction,
        "--size",
        str(options.size),
        "--timeout",
        str(options.run_timeout),
        *_watch_args(peer.watch),
    ]
    result = run_client(procs, argv, options.run_timeout, options.loop, spec.via)
    return {"path": spec.name, "direction": direction, "run": run, **result}


def run_conns(
    procs: ProcessSet, spec: PathSpec, peer: Peer, kind: str, count: int, run: int, o: Options
) -> dict[str, Any]:
    argv = [
        "conns",
        "--via",
        spec.via,
        "--kind",
        kind,
        "--port",
        str(peer.echo_port),
        "--count",
        str(count),
        "--budget",
        str(o.conn_budget),
        *_watch_args(peer.echo_watch if peer.echo_watch is not None else peer.watch),
    ]
    result = run_client(procs, argv, o.conn_budget, o.loop, spec.via)
    return {"path": spec.name, "kind": kind, "run": run, **result}


def conn_jobs(specs: Sequence[PathSpec], options: Options) -> list[tuple[PathSpec, str, int]]:
    jobs = []
    for spec in specs:
        if options.conns > 0:
            if spec.via == "tcp":
                jobs.append((spec, "connect", options.conns))
            elif spec.stream_conns:
                jobs.append((spec, "stream", options.conns))
    for spec in specs:
        if options.sessions > 0 and spec.session_conns:
            jobs.append((spec, "session", options.sessions))
    return jobs


def run_all(options: Options, progress: Callable[[str], None] = lambda _: None) -> Results:
    results = Results()
    results.meta.update(
        machine_info(),
        size=options.size,
        runs=options.runs,
        podgate_loop=resolve_loop(options.loop),
    )
    specs = [p for p in PATHS if p.name in options.paths]
    with ProcessSet(cwd=REPO_ROOT) as procs:
        peers = Peers(procs, options, results)
        progress("starting the target, relays and podgate servers")
        specs = peers.start(specs)
        for run in range(1, options.runs + 1):
            if options.throughput:
                for spec in specs:
                    for direction in options.directions:
                        progress(f"run {run}/{options.runs}: {spec.name} {direction}")
                        results.throughput.append(
                            run_throughput(
                                procs, spec, peers.by_path[spec.name], direction, run, options
                            )
                        )
            for spec, kind, count in conn_jobs(specs, options):
                progress(f"run {run}/{options.runs}: {spec.name} new {kind} x{count}")
                results.conns.append(
                    run_conns(procs, spec, peers.by_path[spec.name], kind, count, run, options)
                )
        progress("stopping")
    return results


def machine_info() -> dict[str, Any]:
    model = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "kernel": os.uname().release,
        "python": sys.version.split()[0],
    }


# --------------------------------------------------------------------------- summaries


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize_throughput(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per path and direction: GB/s, ratio to the direct run of the same round, CPU s/GB."""
    direct = {
        (r["direction"], r["run"]): r["bytes"] / r["seconds"]
        for r in rows
        if r["path"] == "direct" and not r.get("error")
    }
    out = []
    keys = dict.fromkeys((r["path"], r["direction"]) for r in rows)
    for path, direction in keys:
        group = [r for r in rows if r["path"] == path and r["direction"] == direction]
        ok = [r for r in group if not r.get("error") and r.get("verified")]
        rates = [r["bytes"] / r["seconds"] for r in ok]
        ratios = [
            r["bytes"] / r["seconds"] / direct[(direction, r["run"])]
            for r in ok
            if (direction, r["run"]) in direct
        ]

        def per_gb(name: str, ok: list[dict[str, Any]] = ok) -> dict[str, float] | None:
            vals = [r["cpu"][name] / (r["bytes"] / GB) for r in ok if name in r.get("cpu", {})]
            return _spread(vals)

        relay = next((p.relay for p in PATHS if p.name == path), None)
        out.append(
            {
                "path": path,
                "direction": direction,
                "runs": len(group),
                "ok_runs": len(ok),
                "errors": sorted({str(r["error"]) for r in group if r.get("error")}),
                "verified_bytes": [r["bytes"] for r in ok],
                "gbps": _spread([x / GB for x in rates]),
                "ratio": _spread(ratios),
                "server_cpu_s_per_gb": per_gb("server"),
                "relay_cpu_s_per_gb": per_gb(relay) if relay else None,
                "target_cpu_s_per_gb": per_gb("target"),
                "client_cpu_s_per_gb": _spread([r["client_cpu"] / (r["bytes"] / GB) for r in ok]),
            }
        )
    return out


def summarize_conns(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per path and kind: p50/p99 latency, connections per second and its ratio to direct."""
    direct = {
        r["run"]: r["count"] / r["seconds"]
        for r in rows
        if r["path"] == "direct" and not r.get("error") and r.get("count")
    }
    out = []
    keys = dict.fromkeys((r["path"], r["kind"]) for r in rows)
    for path, kind in keys:
        group = [r for r in rows if r["path"] == path and r["kind"] == kind]
        ok = [r for r in group if not r.get("error") and r.get("count")]
        rates = [r["count"] / r["seconds"] for r in ok]
        ratios = [r["count"] / r["seconds"] / direct[r["run"]] for r in ok if r["run"] in direct]
        relay = next((p.relay for p in PATHS if p.name == path), None)

        def per_conn_us(name: str | None, ok: list[dict[str, Any]] = ok) -> dict[str, float] | None:
            if name is None:
                return None
            vals = [r["cpu"][name] / r["count"] * 1e6 for r in ok if name in r.get("cpu", {})]
            return _spread(vals)

        out.append(
            {
                "path": path,
                "kind": kind,
                "runs": len(group),
                "ok_runs": len(ok),
                "errors": sorted({str(r["error"]) for r in group if r.get("error")}),
                "count": [r["count"] for r in ok],
                "p50_us": _spread([r["p50_us"] for r in ok]),
                "p99_us": _spread([r["p99_us"] for r in ok]),
                "conns_per_s": _spread(rates),
                "ratio": _spread(ratios),
                "server_cpu_us_per_conn": per_conn_us("server"),
                "relay_cpu_us_per_conn": per_conn_us(relay),
            }
        )
    return out
