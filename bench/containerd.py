"""podgate against containerd 1.6 + runc, live in the same run: the same clients, the same pod
server, interleaved run by run, every podgate figure as a ratio to containerd's of its round.

The driver starts a `podgate runtime` daemon with a plain pod (netns backend) and a private
containerd (tests/e2e/containerd_support.py) with a host-network pod of the locally built
busybox image. Both containers run the bench target (`python -m bench.target`): in the
containerd pod from this interpreter and checkout, bind-mounted read-only together with /usr,
the library directories and the interpreter's installation prefix. Per round, for each runtime:

    bulk     CRI PortForward -> SPDY/3.1 -> the runtime -> target, download and upload,
             byte-checked (bench.runtime's client): GB/s and CPU-s/GB of runtime + shim
    conn     new forwarded connections one after the other on one open session, each timed
             to the echo of one byte (bench.runtime's client): p50 and p99
    session  a new session per connection: the CRI PortForward RPC, the upgrade, one stream,
             the echo of one byte (this module's client): p50 and p99, and the RPC's p50
    flood    CRI Exec of `busybox timeout S busybox sh -c 'while true; do echo a; done'`, stdout
             counted and checked by this module's client: MB/s and CPU-s/MB of runtime + shim

Runtime CPU is the daemon's own (all its threads; not its children, which include the
payload): podgate's `podgate runtime`; containerd's daemon plus the pod's
containerd-shim-runc-v2 (the shim copies exec output into containerd's FIFOs). The clients:

    python -m bench.containerd sessions --cri SOCK --pod ID --port P --count N --budget S
    python -m bench.containerd flood --cri SOCK --container ID --seconds S --watch NAME=own:PID
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rich.console import Console

from bench import runtime as bench_runtime
from bench.common import LOOP_CHOICES, format_size, resolve_loop, run_on
from bench.portforward import CLIENT_STARTUP_SECONDS, GB, REPO_ROOT, Options, _spread
from bench.procs import ProcessSet
from bench.report import _fmt, markdown_tables, print_tables
from bench.runtime import (
    CRI_TIMEOUT_SECONDS,
    OWN,
    PEER,
    PLAIN,
    RUNTIME_PATHS,
    ForwardMeter,
    RuntimeBench,
    _parent,
    _percentile,
    wait_target_ports,
)
from podgate.aio.streams import ByteStream
from podgate.streaming.client import Endpoint, PortForwardSession, exec_spdy

_SUPPORT = REPO_ROOT / "tests" / "e2e"
if str(_SUPPORT) not in sys.path:
    sys.path.insert(0, str(_SUPPORT))

import containerd_support  # noqa: E402

RUNTIMES = ("podgate", "containerd")
DIRECTIONS = ("download", "upload")
# 10^6 bytes: the unit of the exec flood figures (as in the shared docs' performance notes).
MB = 1e6
# The same binary in both pods: static busybox (the containerd image's, the host's for podgate,
# whose containers see the host's root).
BUSYBOX = "/bin/busybox"
ECHO_LOOP = "while true; do echo a; done"
# Host directories the containerd pod needs to run this interpreter (read-only binds; the
# interpreter's own installation prefix and this checkout are added).
HOST_MOUNTS = ("/usr", "/lib", "/lib64", "/etc/ld.so.cache")
POD_NAME = "bench-versus"
# Beyond the flood's own length: exec setup, the drain, the exit status.
FLOOD_GRACE_SECONDS = 30.0


@dataclass(slots=True)
class Side:
    """One runtime's pod with the target in it, and whose CPU its runs count."""

    name: str
    cri_socket: str
    pod_id: str
    container_id: str
    bulk_port: int
    echo_port: int
    watch: dict[str, int]  # name -> pid, each counted alone (not its children)

    def watch_args(self) -> list[str]:
        return [a for n, p in self.watch.items() for a in ("--watch", f"{n}={OWN}{p}")]


def unavailable() -> str | None:
    why = bench_runtime.unavailable()
    if why is not None:
        return why
    tools, why = containerd_support.missing_tools()
    return None if tools is not None else why


def _podgate_side(rt: RuntimeBench) -> Side:
    assert rt.cri is not None and rt.daemon is not None
    pod = rt.pods[PLAIN]
    pb = rt.cri.pb
    listed = rt.cri.stub.ListContainers(
        pb.ListContainersRequest(filter=pb.ContainerFilter(pod_sandbox_id=pod.pod_id)),
        timeout=CRI_TIMEOUT_SECONDS,
    )
    socket_path = rt.daemon.wait_for(bench_runtime.READY_LINE)[0][1]
    return Side(
        "podgate",
        socket_path,
        pod.pod_id,
        str(listed.containers[0].id),
        pod.bulk_port,
        pod.echo_port,
        {"runtime": rt.daemon.pid},
    )


def _containerd_side(ctrd: containerd_support.Containerd) -> Side:
    pb = containerd_support.pb
    mounts = [
        pb.Mount(container_path=p, host_path=p, readonly=True)
        for p in (*HOST_MOUNTS, sys.base_prefix, str(REPO_ROOT))
        if Path(p).exists()
    ]
    pod = ctrd.run_pod(
        POD_NAME,
        "default",
        [sys.executable, "-m", "bench.target"],
        container="target",
        mounts=mounts,
        working_dir=str(REPO_ROOT),
    )
    ctrd.wait_running(pod.container_id)
    ports = wait_target_ports(ctrd.base / "logs" / POD_NAME / "target.log")
    info = json.loads(
        ctrd.runtime.ContainerStatus(
            pb.ContainerStatusRequest(container_id=pod.container_id, verbose=True),
            timeout=CRI_TIMEOUT_SECONDS,
        ).info["info"]
    )
    assert ctrd.proc is not None
    shim = _parent(int(info["pid"]))
    return Side(
        "containerd",
        str(ctrd.socket),
        pod.sandbox_id,
        pod.container_id,
        int(ports["bulk_port"]),
        int(ports["echo_port"]),
        {"runtime": ctrd.proc.pid, "shim": shim},
    )


class Versus:
    """The runs of one invocation against both sides."""

    def __init__(self, procs: ProcessSet, options: Options, flood_seconds: float) -> None:
        self.procs = procs
        self.options = options
        self.flood_seconds = flood_seconds
        self.py = sys.executable

    def _port_forward_url(self, side: Side, port: int) -> str:
        cri = bench_runtime.Cri(side.cri_socket)
        try:
            return cri.port_forward(side.pod_id, port)
        finally:
            cri.close()

    def bulk(self, side: Side, direction: str) -> dict[str, Any]:
        o = self.options
        url = self._port_forward_url(side, side.bulk_port)
        argv = [
            *(self.py, "-m", "bench.runtime", "--via", "spdy", "--url", url),
            *("--remote-port", str(side.bulk_port), "--loop", o.loop),
            *("--direction", direction, "--size", str(o.size), "--timeout", str(o.run_timeout)),
            *side.watch_args(),
        ]
        return self.procs.run_json(argv, o.run_timeout + CLIENT_STARTUP_SECONDS, {})

    def conn(self, side: Side) -> dict[str, Any]:
        o = self.options
        url = self._port_forward_url(side, side.echo_port)
        argv = [
            *(self.py, "-m", "bench.runtime", "--via", "spdy", "--url", url),
            *("--remote-port", str(side.echo_port), "--loop", o.loop),
            *("--conns", str(o.conns), "--budget", str(o.conn_budget)),
        ]
        limit = o.conn_budget + CLIENT_STARTUP_SECONDS + CRI_TIMEOUT_SECONDS
        return self.procs.run_json(argv, limit, {})

    def session(self, side: Side) -> dict[str, Any]:
        o = self.options
        argv = [
            *(self.py, "-m", "bench.containerd", "sessions", "--cri", side.cri_socket),
            *("--pod", side.pod_id, "--port", str(side.echo_port), "--loop", o.loop),
            *("--count", str(o.sessions), "--budget", str(o.conn_budget)),
        ]
        limit = o.conn_budget + CLIENT_STARTUP_SECONDS + CRI_TIMEOUT_SECONDS
        return self.procs.run_json(argv, limit, {})

    def flood(self, side: Side) -> dict[str, Any]:
        argv = [
            *(self.py, "-m", "bench.containerd", "flood", "--cri", side.cri_socket),
            *("--container", side.container_id, "--seconds", f"{self.flood_seconds:g}"),
            *("--loop", self.options.loop),
            *side.watch_args(),
        ]
        limit = self.flood_seconds + FLOOD_GRACE_SECONDS + CLIENT_STARTUP_SECONDS
        return self.procs.run_json(argv, limit, {})


@contextlib.contextmanager
def _containerd(section: dict[str, Any]) -> Iterator[containerd_support.Containerd]:
    tools, why = containerd_support.missing_tools()
    if tools is None:
        raise RuntimeError(why)
    with containerd_support.private_containerd(tools) as ctrd:
        version = subprocess_version(tools.containerd)
        section["meta"]["containerd"] = version
        try:
            yield ctrd
        finally:
            for error in ctrd.remove_pods():
                section["meta"].setdefault("teardown", []).append(error)


def subprocess_version(binary: str) -> str:
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    return done.stdout.strip()


def run_versus(
    options: Options,
    progress: Callable[[str], None] = lambda _: None,
    flood_seconds: float = 10.0,
) -> dict[str, Any]:
    """Run every figure against both runtimes; returns the section of the results."""
    section: dict[str, Any] = {
        "meta": {
            "size": options.size,
            "runs": options.runs,
            "conns": options.conns,
            "sessions": options.sessions,
            "budget": options.conn_budget,
            "flood_seconds": flood_seconds,
            "pods": {},
        },
        "skipped": {},
        "error": None,
        "rows": [],
    }
    reason = unavailable()
    if reason is not None:
        section["skipped"]["containerd"] = reason
        section["summary"] = []
        return section
    with ProcessSet(cwd=REPO_ROOT, prefix="pgv") as procs:
        rt = RuntimeBench(procs, options, section)
        try:
            progress("containerd: starting podgate runtime with a pod, and a private containerd")
            rt.start([p for p in RUNTIME_PATHS if p.name == PEER])
            if PLAIN not in rt.pods:
                raise RuntimeError(f"the podgate pod did not start: {section['skipped']}")
            with _containerd(section) as ctrd:
                sides = [_podgate_side(rt), _containerd_side(ctrd)]
                section["meta"]["pods"] = {s.name: s.watch for s in sides}
                bench = Versus(procs, options, flood_seconds)
                for run in range(1, options.runs + 1):
                    for side in sides:
                        _runs(bench, side, run, section["rows"], progress)
        except Exception as exc:  # this part failed, not the whole bench
            traceback.print_exc()
            section["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            progress("containerd: removing the pods, stopping the runtimes")
            rt.stop()
    section["summary"] = summarize(section["rows"])
    return section


def _runs(
    bench: Versus,
    side: Side,
    run: int,
    rows: list[dict[str, Any]],
    progress: Callable[[str], None],
) -> None:
    o = bench.options
    tag = f"containerd run {run}/{o.runs}: {side.name}"
    for direction in DIRECTIONS:
        progress(f"{tag} bulk {direction}")
        row = {"figure": f"bulk {direction}", "runtime": side.name, "run": run}
        rows.append({**row, **bench.bulk(side, direction)})
    if o.conns > 0:
        progress(f"{tag} new connections")
        rows.append({"figure": "conn", "runtime": side.name, "run": run, **bench.conn(side)})
    if o.sessions > 0:
        progress(f"{tag} new sessions")
        rows.append({"figure": "session", "runtime": side.name, "run": run, **bench.session(side)})
    progress(f"{tag} exec flood")
    rows.append({"figure": "flood", "runtime": side.name, "run": run, **bench.flood(side)})


# --------------------------------------------------------------------------- summary, report

# figure -> the metrics of its rows: (name with unit, its value in one row, lower is better)
Metric = tuple[str, Callable[[dict[str, Any]], float], bool]


def _cpu(row: dict[str, Any]) -> float:
    return float(sum(row["cpu"].values()))


METRICS: dict[str, tuple[Metric, ...]] = {
    **{
        f"bulk {d}": (
            ("GB/s", lambda r: r["bytes"] / r["seconds"] / GB, False),
            ("CPU-s/GB", lambda r: _cpu(r) / (r["bytes"] / GB), True),
        )
        for d in DIRECTIONS
    },
    "conn": (
        ("p50 µs", lambda r: r["p50_ms"] * 1000, True),
        ("p99 µs", lambda r: r["p99_ms"] * 1000, True),
    ),
    "session": (
        ("p50 µs", lambda r: r["p50_ms"] * 1000, True),
        ("p99 µs", lambda r: r["p99_ms"] * 1000, True),
        ("RPC p50 µs", lambda r: r["rpc_p50_ms"] * 1000, True),
    ),
    "flood": (
        ("MB/s", lambda r: r["bytes"] / r["seconds"] / MB, False),
        ("CPU-s/MB", lambda r: _cpu(r) / (r["bytes"] / MB), True),
    ),
}


def _ok(row: dict[str, Any]) -> bool:
    return not row.get("error") and row.get("verified", True) is not False


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per figure and metric: each runtime's spread and podgate ÷ containerd per round."""
    out = []
    for figure, metrics in METRICS.items():
        mine = [r for r in rows if r["figure"] == figure]
        if not mine:
            continue
        by = {(r["runtime"], r["run"]): r for r in mine if _ok(r)}
        errors = [f"{r['runtime']} run {r['run']}: {r.get('error')}" for r in mine if not _ok(r)]
        for name, value, lower_better in metrics:
            values = {rt: [value(r) for (t, _), r in by.items() if t == rt] for rt in RUNTIMES}
            # A CPU figure below the clock tick is 0 (small smoke runs): no ratio then.
            ratios = [
                value(by[("podgate", run)]) / value(by[("containerd", run)])
                for (t, run) in by
                if t == "podgate" and ("containerd", run) in by and value(by[("containerd", run)])
            ]
            out.append(
                {
                    "figure": figure,
                    "metric": name,
                    "lower_is_better": lower_better,
                    **{rt: _spread(values[rt]) for rt in RUNTIMES},
                    "ratio": _spread(ratios),
                    "errors": errors,
                }
            )
    return out


HEADERS: tuple[str, ...] = (
    "figure",
    "metric",
    "podgate (min–max)",
    "containerd (min–max)",
    "podgate ÷ containerd",
)


def _digits(spread: dict[str, float] | None) -> int:
    if spread is None or spread["median"] == 0:
        return 2
    return 3 if spread["median"] < 1 else (2 if spread["median"] < 100 else 0)


def table_rows(section: dict[str, Any]) -> list[list[str]]:
    return [
        [
            s["figure"],
            s["metric"],
            _fmt(s["podgate"], _digits(s["podgate"])),
            _fmt(s["containerd"], _digits(s["containerd"])),
            _fmt(s["ratio"], 3)
            + ("×" if s["ratio"] else "")
            + (" ✗ " + "; ".join(s["errors"]) if s["errors"] else ""),
        ]
        for s in section["summary"]
    ]


def _title(section: dict[str, Any]) -> str:
    meta = section["meta"]
    return (
        f"Against containerd, live: {format_size(meta['size'])} bulk runs, "
        f"{meta['conns']} conns, {meta['sessions']} sessions, {meta['flood_seconds']:g} s "
        f"floods, {meta['runs']} round(s) ({meta.get('containerd', 'containerd ?')})"
    )


NOTE = (
    "Same clients, same target server, interleaved per round; × = podgate ÷ containerd of the "
    "same round (median, min–max over rounds). CPU = runtime daemon's own threads (+ the pod's "
    "containerd-shim-runc-v2 for containerd). The containerd pod uses the host network, the "
    "podgate pod a netns of its own."
)


def _notes(section: dict[str, Any]) -> list[str]:
    notes = [f"skipped: {k}: {v}" for k, v in section["skipped"].items()]
    if section["error"]:
        notes.append(f"error: {section['error']}")
    return notes


def print_report(section: dict[str, Any], console: Console) -> None:
    tables = [(_title(section), NOTE, HEADERS, table_rows(section))]
    print_tables(tables, _notes(section), console, label_columns=2)


def markdown(section: dict[str, Any]) -> str:
    tables = [("### " + _title(section), NOTE, HEADERS, table_rows(section))]
    return markdown_tables(tables, _notes(section))


def failed(section: dict[str, Any]) -> bool:
    return bool(section["error"]) or any(s["errors"] for s in section["summary"])


# --------------------------------------------------------------------------- clients


def _cri_stub(socket_path: str) -> Any:
    import grpc

    from podgate.cri import api_pb2_grpc

    channel = grpc.insecure_channel(f"unix://{socket_path}")
    grpc.channel_ready_future(channel).result(timeout=CRI_TIMEOUT_SECONDS)
    return api_pb2_grpc.RuntimeServiceStub(channel)


def _endpoint(url: str) -> tuple[Endpoint, str]:
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None or parts.port is None:
        raise ValueError(f"unexpected streaming URL {url!r}")
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    return Endpoint(parts.hostname, parts.port), path


async def sessions(
    socket_path: str, pod_id: str, port: int, count: int, budget: float
) -> dict[str, Any]:
    """`count` new sessions one after the other (stopping after `budget` seconds): the CRI
    PortForward RPC, the upgrade, one stream, the echo of one byte; then the session closes."""
    from podgate.cri import api_pb2 as pb

    stub = _cri_stub(socket_path)
    totals: list[float] = []
    rpcs: list[float] = []
    error = None
    t0 = time.perf_counter()
    async with asyncio.timeout(budget + CRI_TIMEOUT_SECONDS):
        while len(totals) < count and time.perf_counter() - t0 < budget:
            started = time.perf_counter()
            # Blocking, on purpose: the loop has nothing else to do and grpc's own aio driver
            # would add its own costs to both runtimes' figures alike.
            url = stub.PortForward(
                pb.PortForwardRequest(pod_sandbox_id=pod_id, port=[port]),
                timeout=CRI_TIMEOUT_SECONDS,
            ).url
            rpc = time.perf_counter() - started
            endpoint, path = _endpoint(url)
            session = await PortForwardSession.connect(endpoint, path)
            try:
                forwarded = await session.open(port)
                await forwarded.data.send(b"x")
                echo = await forwarded.data.receive()
                totals.append(time.perf_counter() - started)
                rpcs.append(rpc)
                await forwarded.data.send_eof()
                while await forwarded.data.receive():
                    pass
            finally:
                await session.aclose()
            if echo != b"x":
                error = f"session {len(totals)}: echo {echo!r}"
                break
    seconds = time.perf_counter() - t0
    if not totals:
        return {"error": error or "no session made", "sessions": 0}
    return {
        "sessions": len(totals),
        "seconds": seconds,
        "p50_ms": statistics.median(totals) * 1000,
        "p99_ms": _percentile(totals, 0.99) * 1000,
        "rpc_p50_ms": statistics.median(rpcs) * 1000,
        "error": error,
    }


class FloodSink(ByteStream):
    """Counts the echo flood's stdout and checks it is "a\\n" repeated; the meter starts at
    the first byte (exec setup is not part of the rate)."""

    def __init__(self, meter: ForwardMeter) -> None:
        self.meter = meter
        self.bytes = 0
        self.error: str | None = None
        self.started = False

    async def receive(self, max_bytes: int = 0) -> bytes:
        return b""

    async def send(self, data: Any) -> None:
        chunk = bytes(data)
        if not self.started:
            self.started = True
            self.meter.start()
        if self.error is None:
            expected = (b"a\n" * (len(chunk) // 2 + 2))[self.bytes % 2 :][: len(chunk)]
            if chunk != expected:
                at = next(i for i, (a, b) in enumerate(zip(chunk, expected, strict=True)) if a != b)
                self.error = f"unexpected output at byte {self.bytes + at}"
        self.bytes += len(chunk)

    async def send_eof(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


async def flood(socket_path: str, container_id: str, seconds: float, watch: Sequence[str]) -> Any:
    from podgate.cri import api_pb2 as pb

    stub = _cri_stub(socket_path)
    command = [BUSYBOX, "timeout", f"{seconds:g}", BUSYBOX, "sh", "-c", ECHO_LOOP]
    url = stub.Exec(
        pb.ExecRequest(container_id=container_id, cmd=command, stdout=True, stderr=True),
        timeout=CRI_TIMEOUT_SECONDS,
    ).url
    endpoint, path = _endpoint(url)
    meter = ForwardMeter(watch)
    sink = FloodSink(meter)
    async with asyncio.timeout(seconds + FLOOD_GRACE_SECONDS):
        result = await exec_spdy(endpoint, path, stdout=sink, want_stdin=False)
    if not sink.started:
        return {"error": f"no output (exit {result.exit_code}: {result.error})", "bytes": 0}
    meter.stop()
    error = sink.error
    if error is None and sink.bytes % 2:
        error = "output ended inside a line"
    return {**meter.as_dict(), "bytes": sink.bytes, "exit": result.exit_code, "error": error}


def client_main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.containerd")
    parser.add_argument("kind", choices=("sessions", "flood"))
    parser.add_argument("--cri", required=True, help="the runtime's CRI socket path")
    parser.add_argument("--pod")
    parser.add_argument("--port", type=int)
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--budget", type=float, default=20.0)
    parser.add_argument("--container")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--watch", action="append", default=[], metavar="NAME=own:PID")
    parser.add_argument("--loop", choices=LOOP_CHOICES, default="podgate")
    args = parser.parse_args(argv)
    loop = resolve_loop(args.loop)
    result: dict[str, Any] = {"loop": loop}
    try:
        if args.kind == "sessions":
            if args.pod is None or args.port is None:
                parser.error("sessions needs --pod and --port")
            coro = sessions(args.cri, args.pod, args.port, args.count, args.budget)
        else:
            if args.container is None:
                parser.error("flood needs --container")
            coro = flood(args.cri, args.container, args.seconds, args.watch)
        result.update(run_on(loop, coro))
    except Exception as exc:  # any failure is this run's result, not a crash of the bench
        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {exc}"
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    client_main()
