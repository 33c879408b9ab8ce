"""`podgate port-forward` against `kubectl port-forward` (1.33), through one gateway.

The driver starts what bench.gateway starts (a `podgate runtime` daemon, a pod running the
bench target, `podgate node` in front of the daemon's CRI socket with its own state directory
and admin kubeconfig), plus a UDP echo server in the pod's network namespace, and one long
running forwarder per path, each forwarding the target's bulk and echo ports:

    direct-in-netns   client inside the pod's netns -> target (the loopback limit in the pod;
                      every ratio's peer)
    podgate-pf        client -> `podgate port-forward` (default transport: WebSocket tunnel)
                      -> TLS -> podgate node -> runtime -> target; also the UDP echo (/udp)
    kubectl-pf        client -> `kubectl port-forward` 1.33 (default: WebSocket tunnel) -> same
    podgate-pf-spdy   `podgate port-forward --transport spdy` (only when named in --forward-paths)
    kubectl-pf-spdy   kubectl with KUBECTL_PORT_FORWARD_WEBSOCKETS=false (likewise)

Three measurements, runs interleaved round by round as in the other parts:

    throughput  bench.client moves --size byte-checked bytes up and down the bulk port
    setup       bench.client makes --conns sequential connections to the echo port, each one a
                connect and a 1-byte echo (latency = connect to echo back)
    udp         a windowed echo client (this module) sends numbered datagrams, at most
                --udp-window in flight, and checks each one that comes back; a datagram not
                back within UDP_LOSS_SECONDS of the last reply is lost (kubectl has no UDP,
                so only direct-in-netns and podgate-pf)

The UDP parts are this module:

    python -m bench.forward udp-echo                 (under nsenter, in the pod's netns)
    python -m bench.forward udp --port P --count N --window W --watch name=pid
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import struct
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console

from bench.client import Meter, _parse_watch, latency_summary
from bench.common import format_size
from bench.gateway import (
    GATEWAY_PATHS,
    KUBECTL_FORWARDING_LINE,
    GatewayBench,
)
from bench.gateway import unavailable as gateway_unavailable
from bench.portforward import (
    CLIENT_STARTUP_SECONDS,
    REPO_ROOT,
    Options,
    _spread,
    _watch_args,
    run_client,
)
from bench.procs import Child, ChildError, ProcessSet
from bench.report import _fmt, _fmt_ratio, _median, markdown_tables, print_tables
from bench.runtime import NSENTER, PEER, PLAIN, POD_NAME, POD_NAMESPACE, RUNTIME_PATHS

# 10^6 bytes: the unit of the throughput figures here.
MB = 1e6
# Payload of every UDP datagram: DNS-sized (a query with EDNS is 40-100 bytes).
UDP_PAYLOAD_BYTES = 100
# Numbered datagrams sent per UDP run at the default --size (1 GiB); smaller sizes send
# proportionally fewer, at least UDP_MIN_DATAGRAMS.
UDP_DATAGRAMS = 100_000
UDP_MIN_DATAGRAMS = 2_000
# Datagrams in flight at once: a window keeps the sender from overrunning any socket buffer,
# so every datagram that does not come back was lost on the way, not dropped at our socket.
UDP_WINDOW = 64
# With datagrams in flight and none back for this long, the run ends; the rest are lost.
UDP_LOSS_SECONDS = 2.0
# Largest datagram read back (the echo only ever returns what was sent).
UDP_READ_BYTES = 65536
# `podgate port-forward --json` prints one "listening" line per local listener.
LISTENING_LINE = r'^\{.*"event": ?"listening".*\}$'

_HEADER = struct.Struct(">Q")
_FILLER = bytes(range(256)) * (UDP_PAYLOAD_BYTES // 256 + 1)


@dataclass(frozen=True, slots=True)
class ForwardPath:
    name: str
    tool: str  # "podgate" or "kubectl"; "" for the in-netns peer
    description: str
    websocket: bool = True  # the tool's default: the WebSocket tunnel
    default: bool = True

    @property
    def udp(self) -> bool:
        return self.tool in ("", "podgate")


FORWARD_PATHS: tuple[ForwardPath, ...] = (
    ForwardPath(PEER, "", "client in the pod's netns -> target (the loopback limit in the pod)"),
    ForwardPath(
        "podgate-pf",
        "podgate",
        "podgate port-forward (WebSocket tunnel) -> TLS -> podgate node -> runtime -> pod",
    ),
    ForwardPath(
        "kubectl-pf",
        "kubectl",
        "kubectl 1.33 port-forward (WebSocket tunnel) -> TLS -> podgate node -> runtime -> pod",
    ),
    ForwardPath(
        "podgate-pf-spdy",
        "podgate",
        "podgate port-forward --transport spdy",
        websocket=False,
        default=False,
    ),
    ForwardPath(
        "kubectl-pf-spdy",
        "kubectl",
        "kubectl with KUBECTL_PORT_FORWARD_WEBSOCKETS=false (SPDY)",
        websocket=False,
        default=False,
    ),
)
FORWARD_PATH_NAMES = tuple(p.name for p in FORWARD_PATHS)
DEFAULT_FORWARD_PATHS = tuple(p.name for p in FORWARD_PATHS if p.default)

TCP_HEADERS = (
    "path",
    "dir",
    "MB/s (min–max)",
    "× in-netns (min–max)",
    "forwarder s/GB",
    "gateway s/GB",
    "runtime s/GB",
    "client s/GB",
    "verified",
)
TCP_NOTE = (
    "Bulk TCP through each local forwarder, then podgate node (TLS) and podgate runtime into "
    "the pod. MB = 10^6 bytes. × in-netns = against a client inside the pod's netns in the "
    "same round. CPU seconds per GB (10^9 bytes) moved: forwarder = podgate port-forward or "
    "kubectl, gateway = podgate node, runtime = the runtime daemon."
)
CONN_HEADERS = (
    "path",
    "conns",
    "p50 ms (min–max)",
    "p99 ms (min–max)",
    "conns/s (min–max)",
    "× in-netns",
    "forwarder µs/conn",
    "gateway µs/conn",
)
CONN_NOTE = (
    "New TCP connections one after the other to the pod's echo port through each forwarder; "
    "latency = connect to the 1-byte echo back. Median over runs (min–max)."
)
UDP_HEADERS = (
    "path",
    "datagrams",
    "lost",
    "datagrams/s (min–max)",
    "× in-netns",
    "RTT p50 µs",
    "RTT p99 µs",
    "forwarder µs/dgram",
    "gateway µs/dgram",
    "runtime µs/dgram",
)
UDP_NOTE = (
    f"{UDP_PAYLOAD_BYTES}-byte datagrams to a UDP echo in the pod's netns, at most "
    f"{UDP_WINDOW} in flight; datagrams/s counts echoes back (checked byte for byte); "
    f"lost = not back within {UDP_LOSS_SECONDS:g} s of the last reply (must be 0). kubectl has "
    "no UDP. CPU µs per echoed datagram."
)


def default_udp_datagrams(size: int) -> int:
    """UDP_DATAGRAMS at 1 GiB per throughput run, proportionally fewer for smaller runs."""
    return max(UDP_MIN_DATAGRAMS, min(UDP_DATAGRAMS, UDP_DATAGRAMS * size // (1 << 30)))


# --------------------------------------------------------------------------- driver


@dataclass(slots=True)
class Forwarder:
    """One running forwarder and its local ports."""

    child: Child
    bulk_port: int
    echo_port: int
    udp_port: int = 0


class ForwardBench:
    """The gateway stack of bench.gateway, a UDP echo in the pod, and one forwarder per path."""

    def __init__(self, procs: ProcessSet, options: Options, section: dict[str, Any]) -> None:
        self.procs = procs
        self.options = options
        self.section = section
        self.py = sys.executable
        self.gateway = GatewayBench(procs, options, section)
        self.forwarders: dict[str, Forwarder] = {}
        self.udp_echo_port = 0
        self.udp_echo_pid = 0

    @property
    def netns(self) -> str:
        return self.gateway.runtime.netns

    def start(self, paths: Sequence[ForwardPath]) -> list[ForwardPath]:
        gw = self.gateway
        gw.start([p for p in GATEWAY_PATHS if p.name == PEER])  # runtime, pod, node
        assert gw.node is not None
        pod = gw.runtime.pods[PLAIN]
        echo = self.procs.start(
            "udp-echo", [NSENTER, f"--net={pod.netns}", self.py, "-m", "bench.forward", "udp-echo"]
        )
        self.udp_echo_port = int(echo.wait_for_json()["udp_port"])
        self.udp_echo_pid = echo.pid
        meta = self.section["meta"]
        meta["pids"]["udp_echo"] = echo.pid
        meta["udp_echo_port"] = self.udp_echo_port
        usable = []
        for spec in paths:
            if spec.tool == "podgate":
                self.forwarders[spec.name] = self._start_podgate(spec, pod.bulk_port, pod.echo_port)
            elif spec.tool == "kubectl":
                self.forwarders[spec.name] = self._start_kubectl(spec, pod.bulk_port, pod.echo_port)
            usable.append(spec)
        meta["forwarder_pids"] = {name: f.child.pid for name, f in self.forwarders.items()}
        return usable

    def _start_podgate(self, spec: ForwardPath, bulk: int, echo: int) -> Forwarder:
        argv = [self.py, "-m", "podgate", "port-forward", f"pod/{POD_NAME}", "-n", POD_NAMESPACE]
        argv += [f":{bulk}", f":{echo}", f":{self.udp_echo_port}/udp"]
        argv += ["--kubeconfig", self.gateway.kubeconfig, "--json"]
        if not spec.websocket:
            argv += ["--transport", "spdy"]
        child = self.procs.start(spec.name, argv)
        ports: dict[tuple[int, str], int] = {}
        for match in child.wait_for(LISTENING_LINE, count=3):
            event = json.loads(match.group(0))
            ports[(int(event["remote"]), str(event["protocol"]))] = int(
                str(event["local"]).rpartition(":")[2]
            )
        try:
            return Forwarder(
                child,
                ports[(bulk, "tcp")],
                ports[(echo, "tcp")],
                ports[(self.udp_echo_port, "udp")],
            )
        except KeyError as exc:
            raise ChildError(f"{spec.name}: no listener for {exc} in {ports}") from None

    def _start_kubectl(self, spec: ForwardPath, bulk: int, echo: int) -> Forwarder:
        env = self.gateway._env(spec.name, "KUBECTL_PORT_FORWARD_WEBSOCKETS", spec.websocket)
        argv = [self.gateway.kubectl, "port-forward", "--namespace", POD_NAMESPACE]
        argv += ["--address", "127.0.0.1", f"pod/{POD_NAME}", f":{bulk}", f":{echo}"]
        child = self.procs.start(spec.name, argv, env)
        local = {int(m[2]): int(m[1]) for m in child.wait_for(KUBECTL_FORWARDING_LINE, count=2)}
        return Forwarder(child, local[bulk], local[echo])

    def _watch(self, spec: ForwardPath) -> dict[str, int]:
        gw = self.gateway
        assert gw.node is not None
        watch = {"gateway": gw.node.pid, "runtime": gw.runtime.watch["runtime"]}
        watch["target"] = gw.runtime.watch["target"]
        if spec.tool:
            watch["forwarder"] = self.forwarders[spec.name].child.pid
        return watch

    def run_throughput(self, spec: ForwardPath, direction: str, run: int) -> dict[str, Any]:
        row: dict[str, Any] = {"path": spec.name, "direction": direction, "run": run}
        o = self.options
        if not spec.tool:
            peer = next(p for p in RUNTIME_PATHS if p.name == PEER)
            argv = self.gateway.runtime.client_argv(peer, direction)
            return self.procs.run_json(argv, o.run_timeout + CLIENT_STARTUP_SECONDS, row)
        argv = [
            *("throughput", "--via", "tcp", "--port", str(self.forwarders[spec.name].bulk_port)),
            *("--direction", direction, "--size", str(o.size), "--timeout", str(o.run_timeout)),
            *_watch_args(self._watch(spec)),
        ]
        return {**row, **run_client(self.procs, argv, o.run_timeout, o.loop, "tcp")}

    def run_setup(self, spec: ForwardPath, run: int) -> dict[str, Any]:
        row: dict[str, Any] = {"path": spec.name, "run": run}
        o = self.options
        pod = self.gateway.runtime.pods[PLAIN]
        port = self.forwarders[spec.name].echo_port if spec.tool else pod.echo_port
        argv = [
            *(self.py, "-m", "bench.client", "conns", "--via", "tcp", "--kind", "connect"),
            *("--port", str(port), "--count", str(o.conns), "--budget", str(o.conn_budget)),
            *_watch_args(self._watch(spec)),
        ]
        if not spec.tool:
            argv = [NSENTER, f"--net={self.netns}", *argv]
        return self.procs.run_json(argv, o.conn_budget + CLIENT_STARTUP_SECONDS, row)

    def run_udp(self, spec: ForwardPath, count: int, window: int, run: int) -> dict[str, Any]:
        row: dict[str, Any] = {"path": spec.name, "run": run}
        port = self.forwarders[spec.name].udp_port if spec.tool else self.udp_echo_port
        watch = {**self._watch(spec), "echo": self.udp_echo_pid}
        argv = [
            *(self.py, "-m", "bench.forward", "udp", "--port", str(port)),
            *("--count", str(count), "--window", str(window)),
            *("--timeout", str(self.options.run_timeout)),
            *_watch_args(watch),
        ]
        if not spec.tool:
            argv = [NSENTER, f"--net={self.netns}", *argv]
        return self.procs.run_json(argv, self.options.run_timeout + CLIENT_STARTUP_SECONDS, row)

    def stop(self) -> None:
        self.gateway.stop()


def unavailable(options: Options) -> str | None:
    """Why this part cannot run here (None: it can)."""
    return gateway_unavailable(options)


def run_forward(
    options: Options,
    progress: Callable[[str], None] = lambda _: None,
    paths: Sequence[str] = DEFAULT_FORWARD_PATHS,
    udp_datagrams: int | None = None,
    udp_window: int = UDP_WINDOW,
) -> dict[str, Any]:
    """Run the port-forward client benchmark; returns its section of the results."""
    if udp_datagrams is None:
        udp_datagrams = default_udp_datagrams(options.size)
    section: dict[str, Any] = {
        "meta": {
            "size": options.size,
            "runs": options.runs,
            "conns": options.conns,
            "udp_datagrams": udp_datagrams,
            "udp_window": udp_window,
            "udp_payload_bytes": UDP_PAYLOAD_BYTES,
            "pids": {},
        },
        "skipped": {},
        "error": None,
        "throughput": [],
        "setup": [],
        "udp": [],
    }
    reason = unavailable(options)
    if reason is not None:
        section["skipped"]["forward"] = reason
        section["summary"] = {"throughput": [], "setup": [], "udp": []}
        return section
    wanted = [PEER, *(p for p in paths if p != PEER)]
    specs = [p for p in FORWARD_PATHS if p.name in wanted]
    with ProcessSet(cwd=REPO_ROOT, prefix="pgfw-") as procs:
        bench = ForwardBench(procs, options, section)
        phases = section["meta"]["phase_seconds"] = {}
        t0 = time.monotonic()
        try:
            progress("forward: starting podgate runtime, the pod, podgate node and the forwarders")
            specs = bench.start(specs)
            phases["start"], t0 = time.monotonic() - t0, time.monotonic()
            for run in range(1, options.runs + 1):
                if options.throughput:
                    for spec in specs:
                        for direction in options.directions:
                            progress(f"forward run {run}/{options.runs}: {spec.name} {direction}")
                            section["throughput"].append(bench.run_throughput(spec, direction, run))
                if options.conns > 0:
                    for spec in specs:
                        progress(f"forward run {run}/{options.runs}: {spec.name} connections")
                        section["setup"].append(bench.run_setup(spec, run))
                if udp_datagrams > 0:
                    for spec in specs:
                        if spec.udp:
                            progress(f"forward run {run}/{options.runs}: {spec.name} UDP")
                            section["udp"].append(
                                bench.run_udp(spec, udp_datagrams, udp_window, run)
                            )
            phases["runs"] = time.monotonic() - t0
        except Exception as exc:  # ChildError, grpc.RpcError, ...: this part failed, not the bench
            section["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            progress("forward: stopping the forwarders, the gateway, the pod and the daemon")
            bench.stop()
    section["summary"] = {
        "throughput": summarize_throughput(section["throughput"]),
        "setup": summarize_setup(section["setup"]),
        "udp": summarize_udp(section["udp"]),
    }
    return section


# --------------------------------------------------------------------------- summary, report


def _ok(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if not r.get("error")]


def _errors(rows: list[dict[str, Any]]) -> list[str]:
    return sorted({str(r["error"]) for r in rows if r.get("error")})


def _peer_ratios(
    ok: list[dict[str, Any]],
    peer: dict[Any, float],
    key: Callable[[dict[str, Any]], Any],
    rate: Callable[[dict[str, Any]], float],
) -> dict[str, float] | None:
    return _spread([rate(r) / peer[key(r)] for r in ok if key(r) in peer and peer[key(r)]])


def summarize_throughput(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per path and direction: MB/s, ratio to direct-in-netns of the same round, CPU s/GB."""
    good = [r for r in rows if not r.get("error") and r.get("verified")]
    peer = {
        (r["direction"], r["run"]): r["bytes"] / r["seconds"] for r in good if r["path"] == PEER
    }
    out = []
    for path, direction in dict.fromkeys((r["path"], r["direction"]) for r in rows):
        group = [r for r in rows if r["path"] == path and r["direction"] == direction]
        ok = [r for r in group if r in good]

        def per_gb(name: str, ok: list[dict[str, Any]] = ok) -> dict[str, float] | None:
            return _spread(
                [r["cpu"][name] / (r["bytes"] / 1e9) for r in ok if name in r.get("cpu", {})]
            )

        out.append(
            {
                "path": path,
                "direction": direction,
                "runs": len(group),
                "ok_runs": len(ok),
                "errors": _errors(group),
                "verified_bytes": [r["bytes"] for r in ok],
                "mb_per_s": _spread([r["bytes"] / r["seconds"] / MB for r in ok]),
                "ratio": _peer_ratios(
                    ok,
                    peer,
                    lambda r: (r["direction"], r["run"]),
                    lambda r: r["bytes"] / r["seconds"],
                ),
                "forwarder_cpu_s_per_gb": per_gb("forwarder"),
                "gateway_cpu_s_per_gb": per_gb("gateway"),
                "runtime_cpu_s_per_gb": per_gb("runtime"),
                "client_cpu_s_per_gb": _spread([r["client_cpu"] / (r["bytes"] / 1e9) for r in ok]),
            }
        )
    return out


def summarize_setup(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per path: connections, p50/p99 latency, conns/s (ratio to direct-in-netns), CPU/conn."""
    good = [r for r in _ok(rows) if r.get("count")]
    peer = {r["run"]: r["count"] / r["seconds"] for r in good if r["path"] == PEER}
    out = []
    for path in dict.fromkeys(r["path"] for r in rows):
        group = [r for r in rows if r["path"] == path]
        ok = [r for r in group if r in good]

        def per_conn(name: str, ok: list[dict[str, Any]] = ok) -> dict[str, float] | None:
            return _spread(
                [r["cpu"][name] / r["count"] * 1e6 for r in ok if name in r.get("cpu", {})]
            )

        out.append(
            {
                "path": path,
                "runs": len(group),
                "ok_runs": len(ok),
                "errors": _errors(group),
                "conns": [r["count"] for r in ok],
                "p50_ms": _spread([r["p50_us"] / 1e3 for r in ok]),
                "p99_ms": _spread([r["p99_us"] / 1e3 for r in ok]),
                "conns_per_s": _spread([r["count"] / r["seconds"] for r in ok]),
                "ratio": _peer_ratios(
                    ok, peer, lambda r: r["run"], lambda r: r["count"] / r["seconds"]
                ),
                "forwarder_us_per_conn": per_conn("forwarder"),
                "gateway_us_per_conn": per_conn("gateway"),
            }
        )
    return out


def summarize_udp(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per path: echoed datagrams per second, loss, RTT and CPU per datagram."""
    good = [r for r in _ok(rows) if r.get("echoed")]
    peer = {r["run"]: r["echoed"] / r["seconds"] for r in good if r["path"] == PEER}
    out = []
    for path in dict.fromkeys(r["path"] for r in rows):
        group = [r for r in rows if r["path"] == path]
        ok = [r for r in group if r in good]

        def per_dgram(name: str, ok: list[dict[str, Any]] = ok) -> dict[str, float] | None:
            return _spread(
                [r["cpu"][name] / r["echoed"] * 1e6 for r in ok if name in r.get("cpu", {})]
            )

        out.append(
            {
                "path": path,
                "runs": len(group),
                "ok_runs": len(ok),
                "errors": _errors(group),
                "sent": [r["sent"] for r in ok],
                "lost": sum(r.get("lost", 0) for r in group),
                "dgrams_per_s": _spread([r["echoed"] / r["seconds"] for r in ok]),
                "ratio": _peer_ratios(
                    ok, peer, lambda r: r["run"], lambda r: r["echoed"] / r["seconds"]
                ),
                "rtt_p50_us": _spread([r["p50_us"] for r in ok]),
                "rtt_p99_us": _spread([r["p99_us"] for r in ok]),
                "forwarder_us_per_dgram": per_dgram("forwarder"),
                "gateway_us_per_dgram": per_dgram("gateway"),
                "runtime_us_per_dgram": per_dgram("runtime"),
            }
        )
    return out


def _failed_note(s: dict[str, Any]) -> str:
    return "FAILED: " + "; ".join(s["errors"])[:120]


def tcp_rows(section: dict[str, Any]) -> list[list[str]]:
    out = []
    for s in section["summary"]["throughput"]:
        ok = s["ok_runs"]
        verified = (
            f"{ok}/{s['runs']} × {format_size(s['verified_bytes'][0])}" if ok else _failed_note(s)
        )
        out.append(
            [
                s["path"],
                s["direction"],
                _fmt(s["mb_per_s"], 0),
                "1" if s["path"] == PEER else _fmt_ratio(s["ratio"]),
                _median(s["forwarder_cpu_s_per_gb"]),
                _median(s["gateway_cpu_s_per_gb"]),
                _median(s["runtime_cpu_s_per_gb"]),
                _median(s["client_cpu_s_per_gb"]),
                verified,
            ]
        )
    return out


def setup_rows(section: dict[str, Any]) -> list[list[str]]:
    out = []
    for s in section["summary"]["setup"]:
        if not s["ok_runs"]:
            out.append([s["path"], _failed_note(s), *("–" * 6)])
            continue
        out.append(
            [
                s["path"],
                "/".join(str(n) for n in s["conns"]),
                _fmt(s["p50_ms"], 3),
                _fmt(s["p99_ms"], 3),
                _fmt(s["conns_per_s"], 0),
                "1" if s["path"] == PEER else _fmt_ratio(s["ratio"]),
                _median(s["forwarder_us_per_conn"], 0),
                _median(s["gateway_us_per_conn"], 0),
            ]
        )
    return out


def udp_rows(section: dict[str, Any]) -> list[list[str]]:
    out = []
    for s in section["summary"]["udp"]:
        if not s["ok_runs"]:
            out.append([s["path"], _failed_note(s), str(s["lost"]), *("–" * 7)])
            continue
        out.append(
            [
                s["path"],
                "/".join(str(n) for n in s["sent"]),
                str(s["lost"]),
                _fmt(s["dgrams_per_s"], 0),
                "1" if s["path"] == PEER else _fmt_ratio(s["ratio"]),
                _median(s["rtt_p50_us"], 0),
                _median(s["rtt_p99_us"], 0),
                _median(s["forwarder_us_per_dgram"], 1),
                _median(s["gateway_us_per_dgram"], 1),
                _median(s["runtime_us_per_dgram"], 1),
            ]
        )
    return out


def title(section: dict[str, Any]) -> str:
    meta = section["meta"]
    return (
        "podgate port-forward vs kubectl port-forward through podgate node into a pod, "
        f"{format_size(meta['size'])} per throughput run, median of {meta['runs']} run(s) "
        f"(min–max); kubectl {meta.get('kubectl', '?')}"
    )


def _tables(section: dict[str, Any]) -> list[tuple[str, str, tuple[str, ...], list[list[str]]]]:
    meta = section["meta"]
    return [
        (title(section), TCP_NOTE, TCP_HEADERS, tcp_rows(section)),
        (
            f"connection setup through the forwarders, up to {meta['conns']} per run",
            CONN_NOTE,
            CONN_HEADERS,
            setup_rows(section),
        ),
        (
            f"UDP through podgate port-forward, {meta['udp_datagrams']} datagrams per run",
            UDP_NOTE,
            UDP_HEADERS,
            udp_rows(section),
        ),
    ]


def _notes(section: dict[str, Any]) -> list[str]:
    notes = [f"skipped {name}: {reason}" for name, reason in section["skipped"].items()]
    if section["meta"].get("warning"):
        notes.append(f"warning: {section['meta']['warning']}")
    if section["error"]:
        notes.append(f"forward benchmark failed: {section['error']}")
    return notes


def print_report(section: dict[str, Any], console: Console) -> None:
    print_tables(_tables(section), _notes(section), console, label_columns=1)


def markdown(section: dict[str, Any]) -> str:
    return markdown_tables(_tables(section), _notes(section))


def failed(section: dict[str, Any]) -> bool:
    summary = section["summary"]
    return bool(section["error"]) or any(
        s["errors"] or s.get("lost")
        for s in summary["throughput"] + summary["setup"] + summary["udp"]
    )


# --------------------------------------------------------------------------- UDP processes


def udp_echo() -> None:
    """Echo every datagram to its sender, on 127.0.0.1 of the netns this runs in."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sys.stdout.write(json.dumps({"udp_port": sock.getsockname()[1]}) + "\n")
        sys.stdout.flush()
        while True:
            data, peer = sock.recvfrom(UDP_READ_BYTES)
            sock.sendto(data, peer)


def datagram(seq: int) -> bytes:
    """Datagram number `seq`: its number, then filler that shifts with it (so a reply carrying
    the wrong bytes for its number is caught)."""
    start = seq % 256
    return _HEADER.pack(seq) + _FILLER[start : start + UDP_PAYLOAD_BYTES - _HEADER.size]


def udp_run(port: int, count: int, window: int, timeout: float, meter: Meter) -> dict[str, Any]:
    """Send `count` numbered datagrams, at most `window` in flight; check every echo."""
    in_flight: dict[int, float] = {}
    rtts: list[float] = []
    bad = 0
    sent = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect(("127.0.0.1", port))
        sock.setblocking(False)
        deadline = time.monotonic() + timeout
        meter.start()
        last = time.monotonic()
        while sent < count or in_flight:
            while sent < count and len(in_flight) < window:
                sock.send(datagram(sent))
                in_flight[sent] = time.perf_counter()
                sent += 1
            now = time.monotonic()
            if now > deadline or now - last > UDP_LOSS_SECONDS:
                break
            if not select.select([sock], [], [], 0.05)[0]:
                continue
            while True:
                try:
                    data = sock.recv(UDP_READ_BYTES)
                except BlockingIOError:
                    break
                last = time.monotonic()
                seq = _HEADER.unpack_from(data)[0] if len(data) >= _HEADER.size else -1
                t0 = in_flight.pop(seq, None)
                if t0 is None or data != datagram(seq):
                    bad += 1
                    continue
                rtts.append(time.perf_counter() - t0)
        meter.stop()
    result: dict[str, Any] = {**meter.as_dict(), **latency_summary(rtts)}
    lost = len(in_flight) + (count - sent)
    result.update(sent=sent, echoed=len(rtts), lost=lost, bad=bad, error=None)
    if lost or bad:
        result["error"] = f"{lost} datagrams lost, {bad} bad replies"
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.forward")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("udp-echo")
    udp = sub.add_parser("udp")
    udp.add_argument("--port", type=int, required=True)
    udp.add_argument("--count", type=int, required=True)
    udp.add_argument("--window", type=int, default=UDP_WINDOW)
    udp.add_argument("--timeout", type=float, default=120.0)
    udp.add_argument("--watch", action="append", default=[], metavar="NAME=PID")
    args = parser.parse_args(argv)
    if args.command == "udp-echo":
        udp_echo()
        return
    try:
        meter = Meter(_parse_watch(args.watch))
        result = udp_run(args.port, args.count, args.window, args.timeout, meter)
    except Exception as exc:  # any failure is this run's result, not a crash of the bench
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
