"""An anonymous flood against the gateway while a user runs `kubectl exec` (issue: "the
gateway's doors").

`podgate demo` (the gateway with its token, policy, audit log and pre-auth budget, serving
this host as pod `demo`) runs as a child. First `kubectl exec demo -- echo ok` runs back to
back for a quiet period: the peer. Then FLOOD_PROCESSES clients send pipelined anonymous
requests over TLS for the flood period while the same kubectl exec loop runs again. Reported:
the anonymous request rate reached, how much the audit log grew, and kubectl's latency
percentiles in both periods with their ratio. The bound of the issue (p99 under 1 s while
5,000 anonymous requests/s arrive) is checked here and marks the part failed when missed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from rich.console import Console

from bench.portforward import find_kubectl
from bench.procs import Child, ProcessSet
from bench.report import SectionTables, markdown_tables, print_tables

# Seconds of flood, and of the quiet period before it.
FLOOD_SECONDS: Final = 30.0
QUIET_SECONDS: Final = 10.0
# Client processes and the requests each pipelines per write.
FLOOD_PROCESSES: Final = 3
FLOOD_BATCH: Final = 64
# The bounds: the rate to reach, kubectl's p99 under it, the audit log's growth.
TARGET_RATE: Final = 5000.0
# The paced flood's total rate: the issue's rate with a margin, the clients' pace fixed, so
# kubectl's latency is measured under that load rather than under whatever three client
# processes can send (unpaced, they take every cycle the machine has left).
PACED_RATE: Final = 6000.0
P99_BOUND_SECONDS: Final = 1.0
AUDIT_BOUND_BYTES: Final = 1024 * 1024
KUBECTL_TIMEOUT_SECONDS: Final = 60.0

# One flood client: anonymous pipelined requests over TLS until the deadline, as fast as the
# answers come or (with a fifth argument > 0) paced at that many requests per second; prints
# "<answered> <connection failures>".
FLOOD_CLIENT: Final = r"""
import socket, ssl, sys, time
port, seconds, batch, ca = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rate = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
ctx = ssl.create_default_context(cafile=ca)
request = f"GET /api/v1/namespaces/default/pods HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
deadline = time.monotonic() + seconds
answered = refused = 0
due = time.monotonic()
while time.monotonic() < deadline:
    try:
        with ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10),
                             server_hostname="127.0.0.1") as s:
            while time.monotonic() < deadline:
                if rate > 0:
                    due += batch / rate
                    time.sleep(max(0.0, due - time.monotonic()))
                s.sendall(request * batch)
                buffered = b""
                got = 0
                while got < batch:
                    chunk = s.recv(1 << 20)
                    if not chunk:
                        raise ConnectionError("closed")
                    buffered += chunk
                    got = buffered.count(b"HTTP/1.1 401")
                answered += got
    except (OSError, ssl.SSLError):
        refused += 1
print(answered, refused)
"""


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def _exec_loop(kubectl: str, kubeconfig: str, seconds: float) -> tuple[list[float], int]:
    latencies: list[float] = []
    failures = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.monotonic()
        done = subprocess.run(
            [kubectl, "--kubeconfig", kubeconfig, "exec", "demo", "--", "echo", "ok"],
            capture_output=True,
            timeout=KUBECTL_TIMEOUT_SECONDS,
            check=False,
        )
        latencies.append(time.monotonic() - started)
        failures += done.returncode != 0 or done.stdout != b"ok\n"
    return latencies, failures


def _stats(latencies: list[float], failures: int) -> dict[str, Any]:
    return {
        "n": len(latencies),
        "failures": failures,
        "p50": percentile(latencies, 50),
        "p99": percentile(latencies, 99),
        "max": max(latencies),
    }


def _flood(
    procs: ProcessSet,
    demo: Child,
    client: Path,
    kubectl: str,
    state: Path,
    port: int,
    seconds: float,
    rate: float,
) -> dict[str, Any]:
    """One flood period (paced at `rate` in total, or unpaced at 0) with the exec loop."""
    audit = state / "audit.log"
    before = audit.stat().st_size if audit.exists() else 0
    cpu_before = demo.cpu_seconds()
    flood_argv = [
        sys.executable, str(client), str(port), str(seconds), str(FLOOD_BATCH),
        str(state / "pki" / "ca.crt"), str(rate / FLOOD_PROCESSES),
    ]  # fmt: skip
    name = "paced" if rate else "unpaced"
    clients = [procs.start(f"{name}{i}", flood_argv) for i in range(FLOOD_PROCESSES)]
    busy = _stats(*_exec_loop(kubectl, str(state / "kubeconfig-token"), seconds - 1))
    answered = 0
    for c in clients:
        c.proc.wait(seconds + KUBECTL_TIMEOUT_SECONDS)
        answered += int(c.out_path.read_text().split()[0])
    return {
        **busy,
        "paced_at": rate,
        "answered": answered,
        "rate": answered / seconds,
        "audit_growth": audit.stat().st_size - before,
        "server_cpu_seconds": demo.cpu_seconds() - cpu_before,
    }


def run_authflood(
    kubectl_path: str | None,
    progress: Callable[[str], None],
    flood_seconds: float = FLOOD_SECONDS,
) -> dict[str, Any] | None:
    """The quiet period, then a flood paced at PACED_RATE, then an unpaced one, each with
    the same exec loop."""
    kubectl = find_kubectl(kubectl_path) or shutil.which("kubectl")
    if kubectl is None:
        progress("authflood: no kubectl, part skipped")
        return None
    state = Path(tempfile.mkdtemp(prefix="podgate-bench-authflood-"))
    try:
        with ProcessSet() as procs:
            argv = [sys.executable, "-m", "podgate", "demo", "--port", "0"]
            demo = procs.start("demo", [*argv, "--state-dir", str(state)])
            port = int(demo.wait_for(r"podgate demo API on https://127\.0\.0\.1:(\d+)")[0][1])
            kubeconfig = str(state / "kubeconfig-token")
            progress(f"authflood: quiet kubectl exec loop, {QUIET_SECONDS:g} s")
            quiet = _stats(*_exec_loop(kubectl, kubeconfig, QUIET_SECONDS))
            client = state / "flood.py"
            client.write_text(FLOOD_CLIENT)
            floods = []
            for rate in (PACED_RATE, 0.0):
                pace = f"paced at {rate:.0f}/s" if rate else "unpaced"
                progress(f"authflood: {FLOOD_PROCESSES} flood clients {pace}, {flood_seconds:g} s")
                floods.append(
                    _flood(procs, demo, client, kubectl, state, port, flood_seconds, rate)
                )
    finally:
        shutil.rmtree(state, ignore_errors=True)
    paced, unpaced = floods
    return {
        "flood_seconds": flood_seconds,
        "processes": FLOOD_PROCESSES,
        "quiet": quiet,
        "paced": paced,
        "flood": unpaced,
        "bounds": {
            "rate_reached": paced["rate"] >= TARGET_RATE,
            "p99_under_1s": paced["p99"] < P99_BOUND_SECONDS,
            "audit_under_1mb": all(f["audit_growth"] < AUDIT_BOUND_BYTES for f in floods),
        },
    }


def failed(data: dict[str, Any]) -> bool:
    """The audit bound and kubectl's success are hard; the rate and p99 are reported."""
    return (
        not data["bounds"]["audit_under_1mb"]
        or data["quiet"]["failures"] > 0
        or data["paced"]["failures"] > 0
        or data["flood"]["failures"] > 0
    )


def _tables(data: dict[str, Any]) -> SectionTables:
    periods = (
        ("quiet", data["quiet"]),
        (f"flood paced at {data['paced']['paced_at']:.0f}/s", data["paced"]),
        ("flood unpaced", data["flood"]),
    )
    rows = [
        [
            name,
            str(part["n"]),
            f"{part['p50'] * 1000:.0f}",
            f"{part['p99'] * 1000:.0f}",
            f"{part['max'] * 1000:.0f}",
            f"{part['p99'] / data['quiet']['p99']:.2f}",
            str(part["failures"]),
            f"{part['rate']:.0f}" if "rate" in part else "–",
            f"{part['audit_growth']}" if "rate" in part else "–",
            f"{part['server_cpu_seconds']:.1f}" if "rate" in part else "–",
        ]
        for name, part in periods
    ]
    bounds = data["bounds"]
    return [
        (
            "kubectl exec through the gateway, quiet and during anonymous floods",
            "Sequential `kubectl exec demo -- echo ok` (process start included); × quiet = "
            f"p99 against the quiet period's p99 in the same run. {data['processes']} client "
            "processes pipeline anonymous GETs over TLS, all answered 401; req/s = answered; "
            "audit growth in bytes and gateway CPU s over each flood. The issue's bounds at "
            f"the paced rate: ≥ 5,000/s {'yes' if bounds['rate_reached'] else 'NO'}, p99 < 1 s "
            f"{'yes' if bounds['p99_under_1s'] else 'NO'}.",
            (
                "period",
                "n",
                "p50 ms",
                "p99 ms",
                "max ms",
                "p99 × quiet",
                "failed",
                "req/s",
                "audit bytes",
                "gateway CPU s",
            ),
            rows,
        ),
    ]


def print_report(data: dict[str, Any], console: Console) -> None:
    print_tables(_tables(data), [], console)


def markdown(data: dict[str, Any]) -> str:
    return markdown_tables(_tables(data), [])
