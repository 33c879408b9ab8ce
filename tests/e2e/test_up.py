"""`podgate up` as a user meets it: the ready line, then real kubectl against the sample pods."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="podgate up runs pods in namespaces: needs root"),
]

REPO = Path(__file__).resolve().parents[2]
READY = re.compile(r"podgate ready api=(\S+) kubeconfig=(\S+) cri=(\S+)")


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        pytest.skip("kubectl is not installed")
    binary = os.path.join(os.path.dirname(os.path.realpath(found)), "kubectl.1.33")
    return binary if os.path.exists(binary) else found


@pytest.fixture(scope="module")
def up() -> Iterator[dict[str, str]]:
    state = tempfile.mkdtemp(prefix="pgup", dir="/tmp")
    log_path = os.path.join(state, "up.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "podgate",
                "up",
                "--state-dir",
                state,
                "--port",
                "0",
                "--examples",
                str(REPO / "examples"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    home = tempfile.mkdtemp(prefix="pgkc")
    try:
        deadline = time.monotonic() + 30
        while not (m := READY.search(Path(log_path).read_text())):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("podgate up printed no ready line:\n" + Path(log_path).read_text())
            time.sleep(0.1)
        yield {"api": m[1], "kubeconfig": m[2], "home": home, "state": state}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(home, ignore_errors=True)
    assert proc.returncode == 0, Path(log_path).read_text()
    shutil.rmtree(state, ignore_errors=True)


def run_kubectl(
    up: dict[str, str], *args: str, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KUBECONFIG": up["kubeconfig"], "HOME": up["home"]}
    return subprocess.run(
        [kubectl(), *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_sample_pods_are_listed(up: dict[str, str]) -> None:
    out = run_kubectl(up, "get", "pods")
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()[1:]}
    assert rows["hello"][1:3] == ["1/1", "Running"]
    assert rows["shell"][1:3] == ["1/1", "Running"]
    assert rows["udp-echo"][1:3] == ["1/1", "Running"]


def test_exec_runs_inside_the_pod(up: dict[str, str]) -> None:
    out = run_kubectl(up, "exec", "hello", "--", "sh", "-c", "hostname; exit 5")
    assert out.stdout == "hello\n"
    assert out.returncode == 5
    assert socket.gethostname() != "hello"


def test_sample_pods_run_from_their_images(up: dict[str, str]) -> None:
    # hello's root is localhost/podgate/hello: its /www, and none of the node's files.
    out = run_kubectl(up, "exec", "hello", "--", "cat", "/www/index.html")
    assert (out.returncode, out.stdout) == (0, "hello from podgate\n"), out.stderr
    for pod in ("hello", "shell", "udp-echo"):
        out = run_kubectl(up, "exec", pod, "--", "ls", sys.executable)
        assert out.returncode != 0 and "No such file" in out.stderr, (pod, out)
    # udp-echo runs the image's own program (its log line), not python3 from the node.
    logs = run_kubectl(up, "logs", "udp-echo")
    assert (logs.returncode, logs.stdout) == (0, "udp-echo listening on port 9053\n"), logs
    # busybox httpd answers inside the pod and logs the request (kubectl logs: its stderr).
    out = run_kubectl(up, "exec", "hello", "--", "wget", "-qO-", "http://127.0.0.1:8080/")
    assert (out.returncode, out.stdout) == (0, "hello from podgate\n"), out.stderr
    logs = run_kubectl(up, "logs", "hello")
    assert logs.returncode == 0, logs.stderr
    assert "127.0.0.1:" in logs.stdout and "response:200" in logs.stdout, logs.stdout


def test_port_forward_reaches_the_loopback_only_server(up: dict[str, str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        local = s.getsockname()[1]
    env = {**os.environ, "KUBECONFIG": up["kubeconfig"], "HOME": up["home"]}
    pf = subprocess.Popen(
        [kubectl(), "port-forward", "pod/hello", f"{local}:8080"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert pf.stdout is not None
        assert "Forwarding from" in pf.stdout.readline()
        for _ in range(2):
            with socket.create_connection(("127.0.0.1", local), timeout=10) as c:
                c.sendall(b"GET / HTTP/1.0\r\n\r\n")
                reply = b""
                while chunk := c.recv(65536):
                    reply += chunk
            assert reply.startswith(b"HTTP/1.1 200")  # busybox httpd
            assert reply.endswith(b"hello from podgate\n")
    finally:
        pf.terminate()
        pf.wait(10)
        assert pf.stdout is not None
        pf.stdout.close()


def test_readme_udp_example_echoes_through_podgate_port_forward(up: dict[str, str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        local = s.getsockname()[1]
    env = {**os.environ, "HOME": up["home"]}
    pf = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "podgate",
            "port-forward",
            "--kubeconfig",
            up["kubeconfig"],
            "pod/udp-echo",
            f"{local}:9053/udp",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        payloads = [os.urandom(n) for n in (1, 512, 1400)]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
            client.settimeout(1.0)
            deadline = time.monotonic() + 60
            echoed: list[bytes] = []
            for payload in payloads:
                while True:  # the forward may still be starting: retry until it answers
                    client.sendto(payload, ("127.0.0.1", local))
                    try:
                        echoed.append(client.recv(65535))
                        break
                    except TimeoutError:
                        assert pf.poll() is None, pf.stderr.read() if pf.stderr else ""
                        assert time.monotonic() < deadline, "no UDP echo through the forward"
        assert [hashlib.sha256(e).hexdigest() for e in echoed] == [
            hashlib.sha256(p).hexdigest() for p in payloads
        ]
    finally:
        pf.terminate()
        pf.wait(10)
        if pf.stderr is not None:
            pf.stderr.close()
