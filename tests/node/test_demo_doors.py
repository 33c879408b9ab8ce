"""`podgate demo` as a user starts it: HTTPS with a token, the browser-shaped upgrade refused,
and a flood of anonymous requests that neither fills the disk nor stops kubectl.

The flood runs in separate processes against the demo process, with real kubectl exec calls
in between; the achieved request rate and kubectl's latencies are printed (the latency bound
itself belongs to the bench, not here).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.authflood import FLOOD_CLIENT, percentile

pytestmark = [pytest.mark.e2e]

READY_TIMEOUT_SECONDS = 30.0
STOP_TIMEOUT_SECONDS = 30.0
EXCHANGE_TIMEOUT_SECONDS = 15.0
# The flood: this many client processes for this long, each pipelining batches of requests.
FLOOD_PROCESSES = 3
FLOOD_SECONDS = 30.0
FLOOD_BATCH = 64
# Bound on one kubectl call during the flood, seconds.
KUBECTL_TIMEOUT_SECONDS = 60.0
AUDIT_LIMIT_BYTES = 1024 * 1024
READY = re.compile(r"podgate demo API on https://127\.0\.0\.1:(\d+)")
KUBECONFIG = re.compile(r"kubeconfig: (\S+)")


@dataclass
class Demo:
    proc: subprocess.Popen[bytes]
    port: int
    state: Path
    kubeconfig: str

    @property
    def token(self) -> str:
        for line in (self.state / "tokens.csv").read_text().splitlines():
            if not line.startswith("#"):
                return line.split(",")[0]
        raise AssertionError("no token")

    def tls(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.state / "pki" / "ca.crt"))


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    state = tmp_path_factory.mktemp("demo-state")
    log = state.parent / "demo.log"
    argv = [sys.executable, "-m", "podgate", "demo", "--port", "0", "--state-dir", str(state)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while not (m := READY.search(text := log.read_text(errors="replace"))) or not (
            k := KUBECONFIG.search(text)
        ):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        yield Demo(proc, int(m[1]), state, k[1])
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(STOP_TIMEOUT_SECONDS)


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl is not installed")
    return path


def raw(demo: Demo, request: bytes) -> tuple[int, bytes]:
    sock = socket.create_connection(("127.0.0.1", demo.port), timeout=EXCHANGE_TIMEOUT_SECONDS)
    with demo.tls().wrap_socket(sock, server_hostname="127.0.0.1") as s:
        s.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            assert chunk, data
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status != 101:
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            while len(body) < length:
                body += s.recv(65536)
        return status, body


def upgrade(demo: Demo, *, origin: str | None, token: str | None) -> bytes:
    lines = [
        "GET /api/v1/namespaces/default/pods/demo/exec?command=id&stdout=true HTTP/1.1",
        f"Host: 127.0.0.1:{demo.port}",
        "Connection: Upgrade",
        "Upgrade: websocket",
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Version: 13",
        "Sec-WebSocket-Protocol: v4.channel.k8s.io",
    ]
    if origin:
        lines.append(f"Origin: {origin}")
    if token:
        lines.append(f"Authorization: Bearer {token}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_demo_refuses_the_browser_upgrade(demo: Demo) -> None:
    for token in (None, demo.token):
        status, body = raw(demo, upgrade(demo, origin="https://evil.example", token=token))
        assert status == 403
        assert json.loads(body)["kind"] == "Status"
    assert raw(demo, upgrade(demo, origin=None, token=None))[0] == 401
    assert raw(demo, upgrade(demo, origin=None, token=demo.token))[0] == 101
    rebound = f"GET /api HTTP/1.1\r\nHost: evil.example:{demo.port}\r\n\r\n".encode()
    assert raw(demo, rebound)[0] == 421


def test_demo_kubeconfig_works_with_kubectl(demo: Demo) -> None:
    out = subprocess.run(
        [kubectl(), "--kubeconfig", demo.kubeconfig, "exec", "demo", "--", "echo", "hi"],
        capture_output=True,
        timeout=KUBECTL_TIMEOUT_SECONDS,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == b"hi\n"
    text = Path(demo.kubeconfig).read_text()
    assert "token:" in text and "certificate-authority-data" in text
    assert "insecure-skip-tls-verify" not in text


def test_anonymous_flood_leaves_the_audit_small_and_kubectl_working(
    demo: Demo, tmp_path: Path
) -> None:
    binary = kubectl()
    audit = demo.state / "audit.log"
    before = audit.stat().st_size if audit.exists() else 0
    script = tmp_path / "flood.py"
    script.write_text(FLOOD_CLIENT)
    ca = str(demo.state / "pki" / "ca.crt")
    argv = [sys.executable, str(script), str(demo.port), str(FLOOD_SECONDS), str(FLOOD_BATCH), ca]
    flooders = [
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(FLOOD_PROCESSES)
    ]
    latencies: list[float] = []
    failures: list[bytes] = []
    try:
        started = time.monotonic()
        while time.monotonic() - started < FLOOD_SECONDS - 1:
            t0 = time.monotonic()
            out = subprocess.run(
                [binary, "--kubeconfig", demo.kubeconfig, "exec", "demo", "--", "echo", "ok"],
                capture_output=True,
                timeout=KUBECTL_TIMEOUT_SECONDS,
                check=False,
            )
            latencies.append(time.monotonic() - t0)
            if out.returncode != 0 or out.stdout != b"ok\n":
                failures.append(out.stderr)
        results = [p.communicate(timeout=FLOOD_SECONDS + 60) for p in flooders]
    finally:
        for p in flooders:
            if p.poll() is None:
                p.kill()
                p.wait()
    answered = sum(int(out.split()[0]) for out, _ in results)
    rate = answered / FLOOD_SECONDS
    grown = audit.stat().st_size - before
    print(
        f"\nflood: {answered} anonymous requests answered 401 in {FLOOD_SECONDS:.0f} s "
        f"= {rate:.0f}/s by {FLOOD_PROCESSES} processes; audit grew {grown} bytes; "
        f"kubectl exec x{len(latencies)}: p50 {percentile(latencies, 50):.3f} s, "
        f"p99 {percentile(latencies, 99):.3f} s, max {max(latencies):.3f} s"
    )
    assert failures == []
    assert len(latencies) >= 3
    assert answered > 10_000, results  # it was a flood
    assert grown < AUDIT_LIMIT_BYTES
