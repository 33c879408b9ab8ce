"""`podgate proxy` in front of containerd 1.6: what the proxy costs a unary CRI call, and what
its port-forward (through containerd's Exec, for pods containerd cannot port-forward into)
moves compared with containerd's own port-forward into a plain pod, in the same run.

    python -m bench.proxy [--calls 2000] [--size 64M] [--runs 3]
    python -m bench --proxy ...   (as a section of `make bench`)

Everything runs against a private containerd (tests/e2e/containerd_support.py: its own root,
state and socket under /tmp, a local busybox image, host-network pods), which needs root. The
unary figures interleave direct and proxied calls one by one, in a shuffled order, so load on
the machine hits all alike, in one round per run (medians of the rounds are reported).
Throughput is an echo: each byte goes to the pod and back, sha256-checked.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.common import format_size, parse_size
from bench.procs import run_seconds
from bench.report import REPORT_WIDTH, markdown_tables, print_tables

REPO = Path(__file__).resolve().parents[1]
# The private containerd and the pod helpers are the tests' (one implementation of each).
TEST_HELPERS = ("tests", "tests/e2e", "tests/proxy")

# Calls per path for the latency figures (at --size 1G; fewer for a quick run, never fewer than
# MIN_CALLS), and one echo's chunk.
DEFAULT_CALLS = 2000
MIN_CALLS = 100
DEFAULT_SIZE = 64 * 1024 * 1024
CHUNK_BYTES = 256 * 1024
# Calls made before measuring (connections, first-call paths warmed).
WARMUP_CALLS = 50
# The unary calls' order over the paths is shuffled with this seed (the same in every run).
ORDER_SEED = 1
# One echo run may take this long (a loaded 2-core machine, two SPDY hops and a forwarder).
RUN_TIMEOUT_SECONDS = 300.0
# The goal: the proxy adds at most this much to a unary call's median.
GOAL_ADDED_P50_US = 100.0
ANNOTATION = ("podgate.bench/forward", "exec")
# Both data planes are measured; the first carries the port-forward runs.
DATA_PLANES = ("relay", "grpc")

Progress = Callable[[str], None]


def default_calls(size: int) -> int:
    return max(MIN_CALLS, int(DEFAULT_CALLS * min(1.0, size / (1 << 30))))


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def unary_calls(calls: int, rounds: int) -> int:
    """Calls unary_latency makes on each path (both methods, the warm-up included)."""
    return 2 * (WARMUP_CALLS + calls * rounds)


def unary_latency(
    sockets: dict[str, Path], calls: int, sandbox_id: str, rounds: int = 1
) -> list[dict[str, Any]]:
    """p50/p99 of Version and PodSandboxStatus on each socket ("direct" first), interleaved
    call by call in a shuffled order, in `rounds` rounds of `calls` calls per path: the median
    of the rounds' figures, and of each round's p50 less direct's in the same round."""
    import grpc

    from podgate.cri import api_pb2 as pb

    requests = {  # unary_calls counts these
        "Version": pb.VersionRequest(version="v1").SerializeToString(),
        "PodSandboxStatus": pb.PodSandboxStatusRequest(
            pod_sandbox_id=sandbox_id
        ).SerializeToString(),
    }
    channels = {path: grpc.insecure_channel(f"unix://{sock}") for path, sock in sockets.items()}
    rows = []
    try:
        for method, body in requests.items():
            name = f"/runtime.v1.RuntimeService/{method}"
            stubs = {path: channel.unary_unary(name) for path, channel in channels.items()}
            per_round: dict[str, list[tuple[float, float, float]]] = {p: [] for p in stubs}
            order = list(stubs)
            shuffle = random.Random(ORDER_SEED).shuffle
            for round_ in range(rounds):
                samples: dict[str, list[float]] = {path: [] for path in stubs}
                warmup = WARMUP_CALLS if round_ == 0 else 0
                for i in range(warmup + calls):
                    # A new order each time: a call costs more after a slow one on another path
                    # (caches, idle CPUs), so no path may mostly follow the same other.
                    shuffle(order)
                    for path in order:
                        stub = stubs[path]
                        start = time.perf_counter()
                        stub(body, timeout=30)
                        if i >= warmup:
                            samples[path].append(time.perf_counter() - start)
                direct_p50 = percentile(samples["direct"], 0.5) * 1e6
                for path, values in samples.items():
                    p50 = percentile(values, 0.5) * 1e6
                    p99 = percentile(values, 0.99) * 1e6
                    per_round[path].append((p50, p99, p50 - direct_p50))
            for path, figures in per_round.items():
                rows.append(
                    {
                        "method": method,
                        "path": path,
                        "calls": calls,
                        "rounds": rounds,
                        "p50_us": statistics.median(f[0] for f in figures),
                        "p99_us": statistics.median(f[1] for f in figures),
                        "added_p50_us": statistics.median(f[2] for f in figures),
                        "p50_rounds_us": [round(f[0]) for f in figures],
                    }
                )
    finally:
        for channel in channels.values():
            channel.close()
    return rows


async def echo(socket_path: Path, pod: Any, port: int, size: int) -> tuple[float, bool]:
    """Seconds to echo `size` bytes through the CRI runtime at `socket_path`'s port-forward,
    and whether the bytes came back intact."""
    from podgate.node.cri_client import CriClient
    from podgate.node.upstream import CriTarget
    from podgate.streaming.target import PodRef

    client = CriClient(str(socket_path))
    target = CriTarget(client)
    block = os.urandom(CHUNK_BYTES)
    sent, received = hashlib.sha256(), hashlib.sha256()
    try:
        start = time.perf_counter()
        stream = await target.open_port(PodRef("default", pod.name, pod.uid, pod.sandbox_id), port)
        count = 0

        async def upload() -> None:
            left = size
            while left:
                chunk = block[: min(CHUNK_BYTES, left)]
                sent.update(chunk)
                await stream.send(chunk)
                left -= len(chunk)

        try:
            async with asyncio.timeout(RUN_TIMEOUT_SECONDS), asyncio.TaskGroup() as tasks:
                tasks.create_task(upload())
                while count < size:
                    chunk = await stream.receive(CHUNK_BYTES)
                    if not chunk:
                        break
                    received.update(chunk)
                    count += len(chunk)
        finally:
            await stream.aclose()
        seconds = time.perf_counter() - start
    finally:
        await target.aclose()
        await client.close()
    return seconds, count == size and sent.digest() == received.digest()


SOCAT_PATH = "socat relay (floor)"
# How long socat may take to create its listening socket.
SOCAT_START_SECONDS = 10.0


def start_socat(listen: Path, upstream: Path, log: Path) -> subprocess.Popen[bytes]:
    """`socat` relaying every connection to `listen` to the unix socket `upstream`."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["socat", f"UNIX-LISTEN:{listen},fork", f"UNIX-CONNECT:{upstream}"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + SOCAT_START_SECONDS
    while not listen.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"socat did not listen on {listen}: {log.read_text()}")
        time.sleep(0.01)
    return proc


def run_proxy(
    calls: int, size: int, runs: int, progress: Progress, relay_sources: Sequence[Path] = ()
) -> dict[str, Any]:
    """The section; each of `relay_sources` (another checkout's `src`) adds a relay proxy run
    from that code to the unary figures, for a before/after in one run."""
    for where in TEST_HELPERS:
        if str(REPO / where) not in sys.path:
            sys.path.append(str(REPO / where))
    from containerd_support import missing_tools, private_containerd
    from e2e_support import free_port, stop_process
    from proxy_support import PROXY_READY, echo_command, run_pod, start_process, wait_listening

    section: dict[str, Any] = {
        "meta": {"calls": calls, "size": size, "runs": runs},
        "unary": [],
        "cpu_us_per_call": {},
        "throughput": [],
        "error": None,
    }
    if os.geteuid() != 0:
        section["error"] = "containerd and runc need root"
        return section
    tools, why = missing_tools()
    if tools is None:
        section["error"] = why
        return section
    work = Path(tempfile.mkdtemp(prefix="pgpb", dir="/tmp"))
    try:
        with private_containerd(tools) as ctrd:
            progress("proxy: pods in a private containerd")
            plain_port, proxied_port = free_port(), free_port()
            plain = run_pod(
                ctrd, ctrd.runtime, "plain", echo_command(plain_port), host_network=True
            )
            proxied = run_pod(
                ctrd,
                ctrd.runtime,
                "proxied",
                echo_command(proxied_port),
                host_network=True,
                annotations=dict([ANNOTATION]),
            )
            wait_listening(plain_port)
            wait_listening(proxied_port)
            proxies = []
            floors: list[subprocess.Popen[bytes]] = []
            pids: dict[str, int] = {}  # the process each path but direct runs through
            sockets = {"direct": ctrd.socket}
            planes = [(p, f"proxy ({p})", None) for p in DATA_PLANES] + [
                ("relay", f"proxy (relay, {src})", src) for src in relay_sources
            ]
            for n, (plane, label, src) in enumerate(planes):
                sock = work / f"proxy-{n}.sock"
                env = None if src is None else dict(os.environ, PYTHONPATH=str(Path(src).resolve()))
                process, _ = start_process(
                    [
                        "proxy",
                        *("--listen", str(sock)),
                        *("--upstream", f"unix://{ctrd.socket}"),
                        *("--select-annotation", "=".join(ANNOTATION)),
                        *("--data-plane", plane),
                    ],
                    work / f"proxy-{n}.log",
                    PROXY_READY,
                    env,
                )
                proxies.append(process)
                sockets[label] = sock
                pids[label] = process.proc.pid
            proxy_sock = sockets[f"proxy ({DATA_PLANES[0]})"]
            # The floor of any relay: socat copying bytes between the two sockets in C, one
            # more hop and nothing else.
            if shutil.which("socat"):
                floor = work / "socat.sock"
                floors.append(start_socat(floor, ctrd.socket, work / "socat.log"))
                sockets[SOCAT_PATH] = floor
                pids[SOCAT_PATH] = floors[-1].pid
            try:
                progress(f"proxy: {calls} unary calls per method and path")
                before = {path: run_seconds(pid) for path, pid in pids.items()}
                section["unary"] = unary_latency(sockets, calls, plain.sandbox_id, runs)
                # Each process's CPU (socat's forks included) over the calls through it.
                section["cpu_us_per_call"] = {
                    path: (run_seconds(pid) - before[path]) / unary_calls(calls, runs) * 1e6
                    for path, pid in pids.items()
                }
                for run in range(runs):
                    progress(f"proxy: echo {format_size(size)}, run {run + 1}/{runs}")
                    for path, sock, pod, port in (
                        ("containerd port-forward, plain pod", ctrd.socket, plain, plain_port),
                        (
                            "proxy port-forward (exec), selected pod",
                            proxy_sock,
                            proxied,
                            proxied_port,
                        ),
                    ):
                        seconds, ok = asyncio.run(echo(sock, pod, port, size))
                        section["throughput"].append(
                            {"path": path, "run": run, "seconds": seconds, "verified": ok}
                        )
            finally:
                for process in proxies:
                    stop_process(process.proc)
                for floor_process in floors:
                    stop_process(floor_process)
    except Exception as exc:  # reported in the section; the rest of the bench goes on
        section["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return section


def _mb_s(size: int, seconds: float) -> float:
    return 2 * size / seconds / 1e6  # both directions of the echo


def _tables(section: dict[str, Any]) -> list[tuple[str, str, tuple[str, ...], list[list[str]]]]:
    meta = section["meta"]
    cpu = section.get("cpu_us_per_call", {})
    unary_rows = [
        [
            r["method"],
            r["path"],
            f"{r['p50_us']:.0f}",
            "–" if r["path"] == "direct" else f"{r['added_p50_us']:+.0f}",
            f"{r['p99_us']:.0f}",
            f"{cpu[r['path']]:.0f}" if r["path"] in cpu else "–",
        ]
        for r in section["unary"]
    ]
    size = meta["size"]
    by_path: dict[str, list[dict[str, Any]]] = {}
    for r in section["throughput"]:
        by_path.setdefault(r["path"], []).append(r)
    medians = {
        p: statistics.median(_mb_s(size, r["seconds"]) for r in rs) for p, rs in by_path.items()
    }
    reference = next(iter(medians.values()), None)
    tp_rows = [
        [
            path,
            f"{medians[path]:.0f}",
            f"{medians[path] / reference:.2f}" if reference else "–",
            f"{sum(r['verified'] for r in rs)}/{len(rs)}",
        ]
        for path, rs in by_path.items()
    ]
    return [
        (
            f"podgate proxy: unary CRI calls, {meta['calls']} per method and path, median of "
            f"{meta['runs']} round(s) (µs)",
            "Calls interleaved over the paths from one client; added = p50 − direct p50 of the "
            f"same round (goal ≤ {GOAL_ADDED_P50_US:.0f} µs); CPU/call = the path's process "
            "(user + system), over every call through it, both methods.",
            ("method", "path", "p50", "added p50", "p99", "CPU/call"),
            unary_rows,
        ),
        (
            f"podgate proxy: port-forward echo, {format_size(size)} each way, median of "
            f"{meta['runs']} run(s)",
            "MB/s = 10^6 bytes per second, both directions counted; ratio against containerd's "
            "own port-forward in the same run; sha256-checked.",
            ("path", "MB/s", "× containerd", "verified"),
            tp_rows,
        ),
    ]


def _notes(section: dict[str, Any]) -> list[str]:
    return [f"proxy section failed: {section['error']}"] if section["error"] else []


def print_report(section: dict[str, Any], console: Console) -> None:
    print_tables(_tables(section), _notes(section), console, label_columns=1)


def markdown(section: dict[str, Any]) -> str:
    return markdown_tables(_tables(section), _notes(section))


def failed(section: dict[str, Any]) -> bool:
    return bool(section["error"]) or not all(r["verified"] for r in section["throughput"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.proxy", description=__doc__)
    parser.add_argument("--calls", type=int, default=DEFAULT_CALLS)
    parser.add_argument("--size", type=parse_size, default=DEFAULT_SIZE)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the section as JSON here")
    parser.add_argument(
        "--relay-src",
        type=Path,
        action="append",
        default=[],
        help="also time a relay proxy run from this source directory (another checkout's src), "
        "for a before/after in one run; may be repeated",
    )
    args = parser.parse_args(argv)
    err = Console(stderr=True)
    section = run_proxy(
        args.calls,
        args.size,
        args.runs,
        lambda m: err.print(f"[dim]{m}[/dim]"),
        args.relay_src,
    )
    console = Console() if sys.stdout.isatty() else Console(width=REPORT_WIDTH)
    print_report(section, console)
    if args.json:
        args.json.write_text(json.dumps(section, indent=1) + "\n")
    return 1 if failed(section) else 0


if __name__ == "__main__":
    sys.exit(main())
