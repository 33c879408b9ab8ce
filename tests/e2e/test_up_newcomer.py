"""`podgate up` as a newcomer meets it: Ctrl-C twice, a deep state directory, a busy port."""

from __future__ import annotations

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

from process_support import processes_mentioning

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="podgate up runs pods in namespaces: needs root"),
]

REPO = Path(__file__).resolve().parents[2]
READY = re.compile(r"podgate ready api=(\S+) kubeconfig=(\S+) cri=(\S+)")
# Generous: start-up under a loaded CI machine; never a performance claim.
READY_TIMEOUT_SECONDS = 120
EXIT_TIMEOUT_SECONDS = 120


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        pytest.skip("kubectl is not installed")
    binary = os.path.join(os.path.dirname(os.path.realpath(found)), "kubectl.1.33")
    return binary if os.path.exists(binary) else found


def start_up(
    state: str, *extra: str, examples: Path | None = None
) -> tuple[subprocess.Popen[bytes], Path]:
    log_path = Path(state) / "up.log"
    Path(state).mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "podgate",
                "up",
                "--state-dir",
                state,
                "--examples",
                str(examples or REPO / "examples"),
                *extra,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return proc, log_path


def wait_ready(proc: subprocess.Popen[bytes], log_path: Path) -> re.Match[str]:
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    while not (m := READY.search(log_path.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail("podgate up printed no ready line:\n" + log_path.read_text())
        time.sleep(0.1)
    return m


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(EXIT_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def pod_processes(state: str) -> list[int]:
    return [p for p in processes_mentioning(state) if p != os.getpid()]


@pytest.fixture
def state_dir() -> Iterator[str]:
    state = tempfile.mkdtemp(prefix="pgnew", dir="/tmp")
    yield state
    shutil.rmtree(state, ignore_errors=True)


def test_second_ctrl_c_during_shutdown_is_answered_not_crashed(state_dir: str) -> None:
    examples = Path(state_dir) / "examples"
    examples.mkdir()
    shutil.copy(REPO / "examples" / "shell.json", examples)
    shutil.copy(REPO / "examples" / "hello.json", examples)
    proc, log_path = start_up(state_dir, "--port", "0", examples=examples)
    try:
        wait_ready(proc, log_path)
        assert pod_processes(state_dir), "the sample pods' processes should be running"
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + EXIT_TIMEOUT_SECONDS
        while "stopping" not in log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)  # the impatient second Ctrl-C
        proc.wait(EXIT_TIMEOUT_SECONDS)
    finally:
        stop(proc)
    out = log_path.read_text()
    assert proc.returncode == 0, out
    assert "Traceback" not in out
    lines = [line for line in out.splitlines() if line.startswith("podgate: ")]
    assert lines[0].startswith("podgate: signal 2: stopping")
    assert "podgate: removing 2 sample pods" in lines
    assert lines[-1] == "podgate: stopped"
    assert "podgate: already stopping, please wait" in out
    assert pod_processes(state_dir) == []


def test_deep_state_directory_works(state_dir: str) -> None:
    # Far past what fits in a unix socket path (107 bytes) once pod ids and names are added.
    deep = os.path.join(state_dir, *(["a-rather-long-directory-name"] * 5))
    assert len(deep) > 150
    proc, log_path = start_up(deep, "--port", "0")
    try:
        m = wait_ready(proc, log_path)
        env = {**os.environ, "KUBECONFIG": m[2], "HOME": state_dir}
        for pod in ("hello", "hello-sandboxed"):
            out = subprocess.run(
                [kubectl(), "exec", pod, "--", "cat", "/proc/self/cgroup"],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert out.returncode == 0, out.stderr
        # A port-forward into the sandboxed pod makes the agent's dial-back sockets.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            local = s.getsockname()[1]
        pf = subprocess.Popen(
            [kubectl(), "port-forward", "pod/hello-sandboxed", f"{local}:8080"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            assert pf.stdout is not None
            assert "Forwarding from" in pf.stdout.readline()
            with socket.create_connection(("127.0.0.1", local), timeout=30) as c:
                c.sendall(b"GET / HTTP/1.0\r\n\r\n")
                reply = b""
                while chunk := c.recv(65536):
                    reply += chunk
            assert reply.endswith(b"hello from a podgate sandbox\n")
        finally:
            pf.terminate()
            pf.wait(10)
            assert pf.stdout is not None
            pf.stdout.close()
    finally:
        stop(proc)
    assert proc.returncode == 0, log_path.read_text()
    assert "AF_UNIX path too long" not in log_path.read_text()


def test_busy_port_is_one_clear_line_before_any_pod_starts(state_dir: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc, log_path = start_up(state_dir, "--port", str(port))
        try:
            proc.wait(EXIT_TIMEOUT_SECONDS)
        finally:
            stop(proc)
    out = log_path.read_text()
    assert proc.returncode == 1, out
    assert "Traceback" not in out
    assert (
        f"Error: cannot listen on 127.0.0.1:{port}: address already in use; "
        "choose another with --port" in out.splitlines()
    )
    assert "running as" not in out  # no pod was started
    assert pod_processes(state_dir) == []
