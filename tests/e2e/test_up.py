"""`podgate up` as a user meets it: the ready line, then real kubectl against the sample pods."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_support import PtySession

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="podgate up runs pods in namespaces: needs root"),
]

REPO = Path(__file__).resolve().parents[2]
READY = re.compile(r"podgate ready api=(\S+) kubeconfig=(\S+) cri=(\S+)")
# The runtime's log line naming its streaming server (where CRI's one-time URLs point).
STREAMING = re.compile(r"streaming on http://127\.0\.0\.1:(\d+)")


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
        streaming = STREAMING.search(Path(log_path).read_text())
        assert streaming is not None, Path(log_path).read_text()
        yield {
            "api": m[1],
            "kubeconfig": m[2],
            "home": home,
            "state": state,
            "pid": str(proc.pid),
            "streaming_port": streaming[1],
        }
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
        # The UDP flows are the runtime's own, with no upstream session to its streaming server.
        assert streaming_connections(up) == []
    finally:
        pf.terminate()
        pf.wait(10)
        if pf.stderr is not None:
            pf.stderr.close()


# --- the gateway hands streams to the runtime in-process ------------------------------------

ECHO_PORT = 7000
ECHO_BYTES = 8 * 1024 * 1024


def streaming_connections(up: dict[str, str]) -> list[str]:
    """Established TCP connections to the runtime's streaming server, in podgate up's network
    namespace: the hop a gateway going through CRI URLs opens for every stream."""
    port = int(up["streaming_port"])
    found = []
    for table in ("tcp", "tcp6"):
        lines = Path(f"/proc/{up['pid']}/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            local, remote, state = line.split()[1:4]
            if state == "01" and port in (
                int(local.rsplit(":", 1)[1], 16),
                int(remote.rsplit(":", 1)[1], 16),
            ):
                found.append(line)
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kubectl_env(up: dict[str, str]) -> dict[str, str]:
    return {**os.environ, "KUBECONFIG": up["kubeconfig"], "HOME": up["home"]}


def audit_records(up: dict[str, str]) -> list[dict[str, object]]:
    path = Path(up["state"]) / "node" / "audit.log"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def echo_through(local: int, payload: bytes) -> bytes:
    """Send `payload` on a fresh connection while reading the echo back; what came back."""
    with socket.create_connection(("127.0.0.1", local), timeout=30) as c:
        got = bytearray()

        def read() -> None:
            while len(got) < len(payload) and (chunk := c.recv(1 << 20)):
                got.extend(chunk)

        reader = threading.Thread(target=read)
        reader.start()
        c.sendall(payload)
        reader.join(60)
        return bytes(got)


def test_port_forward_is_served_in_process_and_echoes_intact(up: dict[str, str]) -> None:
    """kubectl 1.33 port-forward through podgate up: the bytes come back intact (sha256),
    no connection to the runtime's streaming server exists while they flow, and the audit
    log records the forward as the gateway's."""
    env = kubectl_env(up)
    # busybox nc in the shell pod, one `cat` per connection, for as long as this exec runs.
    echo = subprocess.Popen(
        [kubectl(), "exec", "shell", "--", "nc", "-ll", "-p", str(ECHO_PORT), "-e", "cat"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    # kubectl 1.33's port-forward ends at a connection's first error: nc listens first.
    deadline = time.monotonic() + 30
    listening = f"netstat -ltn | grep -q :{ECHO_PORT}"
    while run_kubectl(up, "exec", "shell", "--", "sh", "-c", listening).returncode != 0:
        assert echo.poll() is None and time.monotonic() < deadline, "no echo in the pod"
        time.sleep(0.2)
    local = free_port()
    pf = subprocess.Popen(
        [kubectl(), "port-forward", "pod/shell", f"{local}:{ECHO_PORT}"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert pf.stdout is not None
        assert "Forwarding from" in pf.stdout.readline()
        payload = os.urandom(ECHO_BYTES)
        with socket.create_connection(("127.0.0.1", local), timeout=30) as c:
            c.sendall(payload[:1024])
            first = b""
            while len(first) < 1024:
                first += c.recv(1024 - len(first))
            # Mid-transfer, with the exec and the forward both open: nothing goes through
            # the runtime's streaming server.
            assert streaming_connections(up) == []
        echoed = echo_through(local, payload)
        assert hashlib.sha256(echoed).hexdigest() == hashlib.sha256(payload).hexdigest()
    finally:
        pf.terminate()
        pf.wait(10)
        assert pf.stdout is not None
        pf.stdout.close()
        echo.terminate()
        echo.wait(10)
    forwards = [
        r
        for r in audit_records(up)
        if r.get("verb") == "portforward" and r.get("pod") == "shell" and "port" in r
    ]
    assert any(
        r["port"] == ECHO_PORT
        and r["outcome"] == "allowed"
        and r["bytes_in"] == r["bytes_out"] == ECHO_BYTES
        for r in forwards
    ), json.dumps(forwards)


def test_exec_stdin_and_exit_code_in_process(up: dict[str, str]) -> None:
    """kubectl 1.33 exec -i: stdin reaches the command, its output and exit code come back,
    and no connection to the runtime's streaming server carries it."""
    # Both lines are read by the command: the end of stdin is not what ends it (kubectl 1.33
    # closing stdin mid-exec does not always reach the command, through CRI or not).
    script = "read line; echo got $line; read more; echo $more; exit 3"
    argv = ["exec", "-i", "shell", "--", "sh", "-c", script]
    with subprocess.Popen(
        [kubectl(), *argv],
        env=kubectl_env(up),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    ) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(b"hello\n")
            proc.stdin.flush()
            assert proc.stdout.readline() == b"got hello\n"
            assert streaming_connections(up) == []  # the exec is running now
            proc.stdin.write(b"tail\n")
            proc.stdin.flush()
            assert proc.stdout.read() == b"tail\n"
            assert proc.wait(30) == 3
        finally:
            if proc.poll() is None:
                proc.kill()


def test_tty_resize_reaches_the_command(up: dict[str, str]) -> None:
    with PtySession(
        [kubectl(), "exec", "-it", "shell", "--", "sh"], kubectl_env(up), rows=21, cols=77
    ) as session:
        # The shell is up first: the first size is test_tty_initial_size's subject.
        session.expect(re.compile(rb"/ # "), 30)
        session.resize(33, 99)
        time.sleep(0.5)  # the resize travels on its own channel: let it land before asking
        session.write(b"stty size; exit 4\n")
        session.expect(re.compile(rb"33 99"), 30)
        assert session.proc.wait(30) == 4


def test_missing_pod_and_port_errors_keep_their_words(up: dict[str, str]) -> None:
    out = run_kubectl(up, "exec", "nosuch", "--", "true")
    assert out.returncode == 1
    assert 'pods "nosuch" not found' in out.stderr
    sandbox = run_kubectl(up, "get", "pod", "hello", "-o", "jsonpath={.metadata.uid}")
    assert sandbox.returncode == 0, sandbox.stderr
    local = free_port()
    pf = subprocess.Popen(
        [kubectl(), "port-forward", "pod/hello", f"{local}:9999"],
        env=kubectl_env(up),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert pf.stdout is not None
        assert "Forwarding from" in pf.stdout.readline()
        with socket.create_connection(("127.0.0.1", local), timeout=10) as c:
            c.settimeout(30)
            assert c.recv(1) == b""  # nothing listens on 9999 in the pod
    finally:
        pf.terminate()
        pf.wait(10)
        assert pf.stdout is not None
        output = pf.stdout.read()
        pf.stdout.close()
    # The runtime's own words for it, as the CRI path relays them: the sandbox id and the
    # pod's uid, then why.
    pattern = rf"error forwarding port 9999 to pod [0-9a-f]{{64}}, uid {sandbox.stdout}: .*refused"
    assert re.search(pattern, output), output


def test_a_refused_attach_keeps_the_runtimes_words(up: dict[str, str]) -> None:
    """The in-process target checks a stream as CRI Attach would: shell's container has a tty,
    so an attach without one is refused in the runtime's words."""
    out = run_kubectl(up, "attach", "shell", "-i=false", timeout=30)
    assert out.returncode != 0
    refusal = "error: Internal error occurred: tty False does not match the container's tty True"
    assert refusal in out.stderr, out.stderr
