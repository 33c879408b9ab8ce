"""`make bench` end to end at a tiny size, plus the check that its byte verification bites.

The harness starts the target, three podgate servers and one client process per run, exactly as
a full run does, only with 2 MiB, one run and no kubectl/socat, so it finishes in seconds.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import PARTS, PATTERN_BYTES, Pattern, Verifier  # noqa: E402
from bench.procs import ProcessSet  # noqa: E402

SIZE = 2 * 1024 * 1024
# How long a bench that ran out of time gets to stop its daemons and pods after SIGTERM.
STOP_SECONDS = 120
PODGATE_PATHS = ("podgate-spdy", "podgate-tunnel", "podgate-ws")
# Well below anything loopback does, well above what a hung or looping path would show.
MIN_PLAUSIBLE_BYTES_PER_SECOND = 1e6
MAX_PLAUSIBLE_BYTES_PER_SECOND = 200e9


def run_bench(tmp_path: Path, *args: str, timeout: float) -> tuple[dict[str, Any], str]:
    """`python -m bench ARGS` to success; its JSON results and the report it printed."""
    out = tmp_path / "results.json"
    # Only the parts ARGS turn on: every other has a smoke test of its own.
    only = ",".join(p for p in PARTS if f"--{p}" in args)
    with subprocess.Popen(
        [sys.executable, "-m", "bench", "--only", only, *args, "--json", str(out)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # SIGTERM, not the SIGKILL of subprocess.run: the bench stops what it started.
            proc.terminate()
            stdout, stderr = proc.communicate(timeout=STOP_SECONDS)
            raise AssertionError(f"bench took over {timeout} s:\n{stderr}{stdout}") from None
    assert proc.returncode == 0, stderr + stdout
    return json.loads(out.read_text()), stdout


def test_bench_runs_every_podgate_path_with_verified_bytes(tmp_path: Path) -> None:
    data, report = run_bench(
        tmp_path,
        *("--size", "2M", "--runs", "1", "--skip-kubectl", "--skip-socat"),
        *("--conns", "20", "--sessions", "5"),
        timeout=120,
    )
    assert (tmp_path / "results.md").exists()

    for path in ("direct", *PODGATE_PATHS):
        for direction in ("upload", "download"):
            [run] = [
                r for r in data["throughput"] if r["path"] == path and r["direction"] == direction
            ]
            assert run["error"] is None
            assert run["verified"] is True
            assert run["bytes"] == SIZE
            rate = run["bytes"] / run["seconds"]
            assert MIN_PLAUSIBLE_BYTES_PER_SECOND < rate < MAX_PLAUSIBLE_BYTES_PER_SECOND
            assert run["cpu"]["target"] >= 0
            if path != "direct":
                assert run["cpu"]["server"] >= 0  # the podgate server's CPU was attributed
            line = next(ln for ln in report.splitlines() if f" {path} " in ln and direction in ln)
            assert "1/1 × 2 MiB" in line

    kinds = {(r["path"], r["kind"]): r for r in data["conns"]}
    assert set(kinds) == {
        ("direct", "connect"),
        ("podgate-spdy", "stream"),
        ("podgate-tunnel", "stream"),
        ("podgate-spdy", "session"),
        ("podgate-tunnel", "session"),
        ("podgate-ws", "session"),
    }
    for (_, kind), run in kinds.items():
        assert run["error"] is None
        assert run["count"] == (5 if kind == "session" else 20)
        assert 0 < run["p50_us"] <= run["p99_us"]


def _ask_target(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := sock.recv(100):
            reply += chunk
    return reply


def test_target_sink_reports_the_first_corrupted_byte() -> None:
    pattern = Pattern()
    good = bytes(pattern.chunk(0, 1000))
    bad = bytearray(good)
    bad[500] ^= 0xFF
    with ProcessSet(cwd=REPO) as procs:
        target = procs.start("target", [sys.executable, "-m", "bench.target"])
        port = int(target.wait_for_json()["bulk_port"])
        assert _ask_target(port, b"U 1000\n" + good) == b"OK 1000\n"
        assert _ask_target(port, b"U 1000\n" + bytes(bad)) == b"BAD 1000 500\n"
        assert _ask_target(port, b"U 1000\n" + good[:999]) == b"BAD 999 999\n"
        assert _ask_target(port, b"D 1000\n") == good
        workdir = procs.workdir
    assert target.proc.returncode is not None
    assert not workdir.exists()


def test_verifier_catches_a_reordered_frame_across_the_pattern_period() -> None:
    pattern = Pattern()
    size = PATTERN_BYTES + 300_000
    data = bytes(pattern.chunk(0, PATTERN_BYTES)) + bytes(pattern.chunk(PATTERN_BYTES, 300_000))
    frames = [data[i : i + 65536] for i in range(0, size, 65536)]
    ok = Verifier(pattern, size)
    for frame in frames:
        ok.feed(frame)
    assert ok.ok
    frames[3], frames[4] = frames[4], frames[3]
    swapped = Verifier(pattern, size)
    for frame in frames:
        swapped.feed(frame)
    assert not swapped.ok
    assert swapped.first_bad == 3 * 65536


def test_bench_runtime_part_forwards_into_a_real_pod_with_verified_bytes(tmp_path: Path) -> None:
    """`--runtime` at 2 MiB: a real `podgate runtime` daemon and pod, every path byte-checked,
    and afterwards neither the daemon nor the pod's processes are left running."""
    import os
    import shutil

    import pytest

    if os.geteuid() != 0:
        pytest.skip("the runtime benchmark needs root (pod network namespaces, nsenter)")
    results, _ = run_bench(
        tmp_path,
        *("--size", "2M", "--runs", "1", "--paths", "direct"),
        *("--conns", "0", "--sessions", "0", "--runtime"),
        *("--runtime-paths", "socat-into-netns,runtime-spdy,runtime-tunnel,runtime-ws"),
        timeout=120,
    )
    section = results["runtime"]
    assert section["error"] is None
    assert "warning" not in section["meta"]  # the target is not reachable from the host
    expected = ["direct-in-netns", "runtime-spdy", "runtime-tunnel", "runtime-ws"]
    if shutil.which("socat"):
        expected.insert(1, "socat-into-netns")
    else:
        assert "socat-into-netns" in section["skipped"]
    rows = section["throughput"]
    assert [(r["path"], r["direction"]) for r in rows] == [
        (p, d) for p in expected for d in ("upload", "download")
    ]
    for run in rows:
        assert run["error"] is None, run
        assert run["verified"] is True
        assert run["bytes"] == SIZE
        rate = run["bytes"] / run["seconds"]
        assert MIN_PLAUSIBLE_BYTES_PER_SECOND < rate < MAX_PLAUSIBLE_BYTES_PER_SECOND
        assert set(run["cpu"]) >= {"runtime", "target"}
        assert ("socat" in run["cpu"]) == (run["path"] == "socat-into-netns")
    ratios = {(s["path"], s["direction"]): s["ratio"] for s in section["summary"]}
    assert ratios[("direct-in-netns", "upload")]["median"] == 1.0
    assert ratios[("runtime-spdy", "download")]["median"] > 0
    assert "| runtime-ws | download |" in (tmp_path / "results.md").read_text()

    pids = section["meta"]["pids"]
    assert set(pids) == {"runtime", "target", "holder"}
    for pid in pids.values():  # gone, or reused by something that is not ours
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        assert b"podgate" not in cmdline and b"bench.target" not in cmdline


def test_bench_gateway_part_runs_kubectl_through_podgate_node(tmp_path: Path) -> None:
    """`--gateway` at 2 MiB: kubectl 1.33 port-forwards through `podgate node` (TLS) and
    `podgate runtime` into a real pod over the tunnel and SPDY, byte-checked both ways; the
    exec floods are checked at kubectl's stdout; afterwards nothing of it is left running.
    The flood client's own check must bite on output that is not what the command writes."""
    import os

    import pytest
    from bench.portforward import find_kubectl

    if os.geteuid() != 0:
        pytest.skip("the gateway benchmark needs root (a real pod through podgate runtime)")
    if find_kubectl(None) is None:
        pytest.skip("kubectl.1.33 is not installed next to kubectl")

    # Stand-ins for `kubectl exec`: each output below breaks one rule of its flood kind.
    for kind, size, script, error in (
        ("echo", 0, r'printf "a\na\nab\n"; exit 124', "unexpected output at byte 5"),
        ("echo", 0, r'printf "a\na\na"; exit 124', "output ended inside a line"),
        ("echo", 0, r'printf "a\n"; exit 0', "kubectl exited 0"),  # `timeout` exits 124
        ("bulk", 1001, "head -c 1000 /dev/zero", "dd finished after 1000 of 1001 bytes"),
        ("bulk", 1000, "head -c 999 /dev/zero; printf x", "unexpected output at byte 999"),
    ):
        fake = subprocess.run(
            [
                *(sys.executable, "-m", "bench.gateway", "flood", "--kind", kind),
                *("--seconds", "1", "--size", str(size), "--", "sh", "-c", script),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        result = json.loads(fake.stdout)
        assert result["verified"] is False
        assert result["error"].startswith(error), (script, result)

    results, _ = run_bench(
        tmp_path,
        *("--size", "2M", "--runs", "1", "--paths", "direct", "--conns", "0"),
        *("--sessions", "0", "--no-runtime", "--gateway"),
        timeout=180,
    )
    section = results["gateway"]
    assert section["error"] is None
    assert "warning" not in section["meta"]  # the target is not reachable from the host
    assert section["meta"]["node_api"].startswith("https://127.0.0.1:")

    rows = section["throughput"]
    paths = [
        "direct-in-netns",
        "gateway-tunnel",
        "gateway-spdy",
        "up-tunnel",
        "up-spdy",
        "tls-tunnel",
        "tls-spdy",
    ]
    # Who carries the bytes besides kubectl and the target: podgate node and the runtime
    # daemon; podgate up alone (gateway and runtime in one process); the one-hop TLS server.
    watched = {"gateway": {"gateway", "runtime"}, "up": {"gateway"}, "tls": {"server"}}
    assert [(r["path"], r["direction"]) for r in rows] == [
        (p, d) for p in paths for d in ("upload", "download")
    ]
    for run in rows:
        assert run["error"] is None, run
        assert run["verified"] is True
        assert run["bytes"] == SIZE
        rate = run["bytes"] / run["seconds"]
        assert MIN_PLAUSIBLE_BYTES_PER_SECOND < rate < MAX_PLAUSIBLE_BYTES_PER_SECOND
        if run["path"] != "direct-in-netns":
            front = watched[run["path"].split("-")[0]]
            assert set(run["cpu"]) == front | {"kubectl", "target"}, run
    summary = {(s["path"], s["direction"]): s for s in section["summary"]["throughput"]}
    for path in ("up-tunnel", "up-spdy"):
        for direction in ("upload", "download"):
            row = summary[path, direction]
            assert row["peer"] == path.replace("up-", "tls-")
            assert row["peer_ratio"] is not None and row["peer_ratio"]["median"] > 0
            assert row["gw_rt_cpu_s_per_gb"] is not None

    floods = {(r["flood"], r["protocol"]): r for r in section["floods"]}
    assert list(floods) == [
        ("echo", "WebSocket v5"),
        ("echo", "SPDY"),
        ("bulk", "WebSocket v5"),
        ("bulk", "SPDY"),
    ]
    for (kind, _), run in floods.items():
        assert run["error"] is None, run
        assert run["verified"] is True
        assert set(run["cpu"]) == {"gateway", "runtime", "kubectl"}
        if kind == "echo":
            # `timeout` stops the endless loop and exits 124; kubectl passes the status on.
            assert run["exit_code"] == 124
            assert run["bytes"] > 0 and run["bytes"] % 2 == 0
        else:
            assert run["exit_code"] == 0
            assert run["bytes"] == SIZE  # dd bs=1M count=2M iflag=count_bytes
    markdown = (tmp_path / "results.md").read_text()
    assert "| gateway-spdy | download |" in markdown
    assert "| up-spdy | download |" in markdown
    assert "| echo | WebSocket v5 |" in markdown

    probe = section["disconnect"]
    assert "error" not in probe, probe
    assert probe["exec_left_running"] is False  # the exec stops when its client goes
    assert probe["bytes_before_kill"] > 0

    pids = section["meta"]["pids"]
    assert set(pids) == {"runtime", "target", "holder", "gateway", "up", "tls_server"}
    for pid in pids.values():  # gone, or reused by something that is not ours
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        assert b"podgate" not in cmdline and b"bench.target" not in cmdline
    for entry in Path("/proc").iterdir():  # nor is the probe's exec
        if entry.name.isdigit():
            try:
                assert probe["marker"].encode() not in (entry / "cmdline").read_bytes()
            except OSError:
                continue


def test_bench_runtime_part_measures_the_agent_and_exec_backends(tmp_path: Path) -> None:
    """A sandboxed pod (agent backend) and a pod forced to exec, at 2 MiB: every transfer
    byte-checked against its own in-netns peer, connection setup measured per backend, the
    sandbox shim's CPU reported, and nothing of the pods left running afterwards."""
    import os

    import pytest

    if os.geteuid() != 0:
        pytest.skip("the runtime benchmark needs root (pod network namespaces, nsenter)")
    results, _ = run_bench(
        tmp_path,
        *("--size", "2M", "--runs", "1", "--paths", "direct", "--conns", "0"),
        *("--sessions", "0", "--runtime", "--no-gateway", "--conn-budget", "2"),
        *("--runtime-paths", "agent-spdy,exec-spdy"),
        timeout=180,
    )
    section = results["runtime"]
    assert section["error"] is None and section["skipped"] == {}
    rows = section["throughput"]
    # The peers come along: each ratio needs one.
    paths = ["direct-in-netns", "direct-in-guest", "agent-spdy", "exec-spdy"]
    assert [(r["path"], r["direction"]) for r in rows] == [
        (p, d) for p in paths for d in ("upload", "download")
    ]
    for run in rows:
        assert run["error"] is None, run
        assert run["verified"] is True
        assert run["bytes"] == SIZE
        rate = run["bytes"] / run["seconds"]
        assert MIN_PLAUSIBLE_BYTES_PER_SECOND < rate < MAX_PLAUSIBLE_BYTES_PER_SECOND
        if run["path"] in ("agent-spdy", "exec-spdy"):
            # (Its relay's CPU at 2 MiB is below the 10 ms clock tick; `make bench` shows it.)
            assert run["peer"] == ("direct-in-guest" if run["path"] == "agent-spdy" else paths[0])
    setup = {r["backend"]: r for r in section["setup"]}
    assert list(setup) == ["netns", "exec", "agent"]
    for row in setup.values():
        assert row["error"] is None, row
        assert 1 <= row["conns"] <= 500
        assert 0 < row["p50_ms"] <= row["p99_ms"]
    markdown = (tmp_path / "results.md").read_text()
    assert "| agent-spdy | download |" in markdown and "| exec |" in markdown

    pods = section["meta"]["pods"]
    assert set(pods) == {"netns", "exec", "agent"}
    for pids in pods.values():  # gone, or reused by something that is not ours
        for pid in pids.values():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            assert b"podgate" not in cmdline and b"bench.target" not in cmdline


def test_bench_containerd_flood_check_bites() -> None:
    """The exec flood's counter rejects output that is not "a\\n" repeated, wherever it starts."""
    import asyncio

    from bench.containerd import FloodSink
    from bench.runtime import ForwardMeter

    async def feed(*chunks: bytes) -> FloodSink:
        sink = FloodSink(ForwardMeter([]))
        for chunk in chunks:
            await sink.send(chunk)
        return sink

    good = asyncio.run(feed(b"a\na", b"\na\n", b"a", b"\n"))
    assert good.error is None and good.bytes == 8
    bad = asyncio.run(feed(b"a\na", b"\nab\n"))
    assert bad.error == "unexpected output at byte 5"


def test_bench_containerd_part_measures_both_runtimes_live(tmp_path: Path) -> None:
    """`--containerd` at 2 MiB: podgate runtime and a private containerd 1.6 each run the same
    target; bulk port-forward both ways byte-checked, new connections, new sessions and an exec
    flood measured on both, every figure with its podgate ÷ containerd ratio; nothing of either
    pod is left running afterwards."""
    import os

    import pytest

    sys.path.insert(0, str(REPO / "tests" / "e2e"))
    import containerd_support

    if os.geteuid() != 0:
        pytest.skip("the containerd comparison needs root (pods of both runtimes)")
    tools, why = containerd_support.missing_tools()
    if tools is None:
        pytest.skip(why)
    results, report = run_bench(
        tmp_path,
        *("--size", "2M", "--runs", "1", "--paths", "direct", "--conns", "20"),
        *("--sessions", "5", "--no-runtime", "--no-gateway", "--no-forward", "--no-authflood"),
        *("--startup-runs", "0", "--containerd", "--flood-seconds", "1"),
        timeout=240,
    )
    section = results["containerd"]
    assert section["error"] is None and section["skipped"] == {}
    assert "1.6" in section["meta"]["containerd"]
    rows = {(r["figure"], r["runtime"]): r for r in section["rows"]}
    figures = ["bulk download", "bulk upload", "conn", "session", "flood"]
    assert list(rows) == [(f, rt) for rt in ("podgate", "containerd") for f in figures]
    for (figure, runtime), row in rows.items():
        assert row["error"] is None, row
        if figure.startswith("bulk"):
            assert row["verified"] is True and row["bytes"] == SIZE
            rate = row["bytes"] / row["seconds"]
            assert MIN_PLAUSIBLE_BYTES_PER_SECOND < rate < MAX_PLAUSIBLE_BYTES_PER_SECOND
            expected = {"runtime"} if runtime == "podgate" else {"runtime", "shim"}
            assert set(row["cpu"]) == expected
        elif figure == "flood":
            assert row["bytes"] > 0 and row["bytes"] % 2 == 0
        else:
            assert 0 < row["p50_ms"] <= row["p99_ms"]
    summary = {(s["figure"], s["metric"]): s for s in section["summary"]}
    for figure, metric in (("conn", "p50 µs"), ("session", "p50 µs"), ("flood", "MB/s")):
        s = summary[(figure, metric)]
        assert s["errors"] == []
        expected = s["podgate"]["median"] / s["containerd"]["median"]
        assert s["ratio"]["median"] == pytest.approx(expected)
    assert "Against containerd, live" in report

    for pids in section["meta"]["pods"].values():  # gone, or reused by something not ours
        for pid in pids.values():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            assert b"podgate" not in cmdline and b"containerd" not in cmdline
