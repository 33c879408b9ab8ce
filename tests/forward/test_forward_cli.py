"""`podgate port-forward`, `exec` and `attach` as child processes against the demo API.

The demo pod `default/demo` has an echo server as port 7000 and nothing on 7002 (refused);
servers.py describes it. Payloads are random and every transfer is checked by sha256.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_support import PtySession, exchange_tcp, sha256_hex
from forward_support import REPO, json_forward

from servers import ECHO_PORT, REFUSED_PORT, RunningServers

pytestmark = pytest.mark.e2e

# 8 concurrent connections of 16 MiB each, echoed back.
CONNECTIONS = 8
CONNECTION_BYTES = 16 * 1024 * 1024
# Bound on one of those exchanges (loopback, Python on both ends).
TRANSFER_SECONDS = 120.0
# Bound on a short command or exchange.
STEP_SECONDS = 20.0
ROWS, COLS = 37, 101
PODGATE = (sys.executable, "-m", "podgate")


def podgate(
    *args: str, stdin: bytes = b"", timeout: float = STEP_SECONDS
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "podgate", *args],
        input=stdin,
        capture_output=True,
        cwd=REPO,
        timeout=timeout,
        check=False,
    )


def test_eight_concurrent_connections_of_16_mib(demo: RunningServers) -> None:
    payloads = [os.urandom(CONNECTION_BYTES) for _ in range(CONNECTIONS)]
    with json_forward(["--kubeconfig", demo.kubeconfig, "pod/demo", f":{ECHO_PORT}"]) as fwd:
        port = fwd.ports(1)[(ECHO_PORT, "tcp")]
        with concurrent.futures.ThreadPoolExecutor(CONNECTIONS) as pool:
            results = list(
                pool.map(lambda data: exchange_tcp(port, data, TRANSFER_SECONDS), payloads)
            )
        for data, got in zip(payloads, results, strict=True):
            assert (got.nbytes, got.sha256) == (len(data), sha256_hex(data))
        closed = fwd.wait_for("connection_closed", CONNECTIONS)
        assert {(e["bytes_in"], e["bytes_out"]) for e in closed} == {
            (CONNECTION_BYTES, CONNECTION_BYTES)
        }
        assert len({e["connection"] for e in closed}) == CONNECTIONS
        assert fwd.interrupt() == 0
    kinds = [e["event"] for e in fwd.events]
    assert kinds[0] == "listening" and kinds.count("connected") == 1
    assert kinds[-1] == "stopped"
    assert "connection_error" not in kinds and "session_lost" not in kinds


def test_refused_port_fails_one_connection_only(demo: RunningServers) -> None:
    args = ["--kubeconfig", demo.kubeconfig, "demo", f":{REFUSED_PORT}", f":{ECHO_PORT}"]
    with json_forward(args) as fwd:
        ports = fwd.ports(2)
        with socket.create_connection(("127.0.0.1", ports[(REFUSED_PORT, "tcp")]), 10) as sock:
            sock.settimeout(STEP_SECONDS)
            sock.sendall(b"hello")
            with pytest.raises(ConnectionResetError):
                while sock.recv(4096):
                    pass
                raise AssertionError("a refused remote port must reset the local connection")
        (error,) = fwd.wait_for("connection_error")
        assert error["remote"] == REFUSED_PORT and error["protocol"] == "tcp"
        assert f"error forwarding port {REFUSED_PORT}" in error["error"], error
        data = os.urandom(1024 * 1024)
        got = exchange_tcp(ports[(ECHO_PORT, "tcp")], data, STEP_SECONDS)
        assert got.sha256 == sha256_hex(data)
        (closed,) = fwd.wait_for("connection_closed")
        assert (closed["remote"], closed["bytes_out"], closed["bytes_in"]) == (
            ECHO_PORT,
            len(data),
            len(data),
        )
        assert re.fullmatch(r"127\.0\.0\.1:\d+", closed["peer"])
        assert closed["local"] == f"127.0.0.1:{ports[(ECHO_PORT, 'tcp')]}"
        assert fwd.interrupt(signal.SIGTERM) == 0


def test_missing_pod_exits_3_after_the_gone_timeout(demo: RunningServers) -> None:
    args = ["--kubeconfig", demo.kubeconfig, "missing", ":80", "--gone-timeout", "1"]
    with json_forward(args) as fwd:
        assert fwd.wait_exit(STEP_SECONDS) == 3
    kinds = [e["event"] for e in fwd.events]
    assert kinds[0] == "listening" and kinds[-1] == "target_gone", kinds
    assert "reconnecting" in kinds and "connected" not in kinds
    assert "pod default/missing not found" in fwd.events[-1]["error"]


def test_targets_file_keeps_running_while_one_target_lives(
    demo: RunningServers, tmp_path: Path
) -> None:
    targets = tmp_path / "targets.yaml"
    targets.write_text(
        f'- pod: demo\n  ports: [":{ECHO_PORT}"]\n'
        '- pod: missing\n  namespace: default\n  ports: [":80"]\n'
    )
    args = ["--kubeconfig", demo.kubeconfig, "-f", str(targets), "--gone-timeout", "0.5"]
    with json_forward(args) as fwd:
        ports = fwd.ports(2)
        fwd.wait_for("target_gone", target="default/missing")
        data = os.urandom(256 * 1024)
        assert exchange_tcp(ports[(ECHO_PORT, "tcp")], data, STEP_SECONDS).sha256 == sha256_hex(
            data
        )
        assert fwd.proc.poll() is None
        assert fwd.interrupt() == 0
    stopped = [e["target"] for e in fwd.events if e["event"] == "stopped"]
    assert stopped == ["default/demo"]


def test_all_targets_gone_exits_with_the_worst_code(demo: RunningServers, tmp_path: Path) -> None:
    targets = tmp_path / "targets.yaml"
    targets.write_text("- {pod: gone1, ports: [':80']}\n- {pod: gone2, ports: [':81']}\n")
    args = ["--kubeconfig", demo.kubeconfig, "-f", str(targets), "--gone-timeout", "0.5"]
    with json_forward(args) as fwd:
        assert fwd.wait_exit(STEP_SECONDS) == 3
    assert sorted(e["target"] for e in fwd.events if e["event"] == "target_gone") == [
        "default/gone1",
        "default/gone2",
    ]


def test_plain_output_has_kubectls_forwarding_line(demo: RunningServers) -> None:
    proc = subprocess.Popen(
        [*PODGATE, "port-forward", "--kubeconfig", demo.kubeconfig, "demo", f":{ECHO_PORT}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
    )
    closed = re.compile(
        rf"\d\d:\d\d:\d\d default/demo: connection 1 from 127\.0\.0\.1:\d+ to {ECHO_PORT}: "
        r"closed \(in 3 B, out 3 B\)\n"
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline().decode()
        match = re.fullmatch(rf"Forwarding from 127\.0\.0\.1:(\d+) -> {ECHO_PORT}\n", first)
        assert match, first
        assert exchange_tcp(int(match[1]), b"abc", STEP_SECONDS).head == b"abc"
        lines = []
        for _ in range(10):  # connected, opened, closed: in some order, a few lines at most
            lines.append(proc.stdout.readline().decode())
            if closed.fullmatch(lines[-1]):
                break
        else:
            raise AssertionError(f"no closed line: {lines}")
        proc.send_signal(2)
        proc.communicate(timeout=STEP_SECONDS)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0


def test_listen_failure_exits_5(demo: RunningServers) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        result = podgate(
            "port-forward", "--json", "--kubeconfig", demo.kubeconfig, "demo", f"{busy}:{ECHO_PORT}"
        )
    assert result.returncode == 5, result
    (line,) = result.stdout.decode().splitlines()
    assert f"unable to listen on 127.0.0.1:{busy}" in line and '"listen_failed"' in line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["svc/web", "80"], "only pods are supported"),
        (["demo"], "no port pair given"),
        ([], "nothing to forward"),
        (["demo", "8080:http"], "is not a number"),
        (["demo", "80", "--address", "nowhere"], "invalid --address"),
    ],
)
def test_usage_errors_exit_2(demo: RunningServers, args: list[str], message: str) -> None:
    result = podgate("port-forward", "--kubeconfig", demo.kubeconfig, *args)
    assert result.returncode == 2, result
    assert message in result.stderr.decode()


def test_bad_kubeconfig_exits_1(tmp_path: Path) -> None:
    result = podgate("port-forward", "--kubeconfig", str(tmp_path / "none"), "demo", "80")
    assert result.returncode == 1
    assert "cannot read kubeconfig" in result.stderr.decode()


# --- exec and attach ----------------------------------------------------------------------


def test_exec_exit_code_and_output(demo: RunningServers) -> None:
    result = podgate(
        "exec",
        "--kubeconfig",
        demo.kubeconfig,
        "demo",
        "--",
        "sh",
        "-c",
        "echo out; echo err >&2; exit 3",
    )
    assert result.returncode == 3
    assert result.stdout == b"out\n"
    assert result.stderr == b"err\ncommand terminated with exit code 3\n"


@pytest.mark.parametrize("transport", ["auto", "websocket", "spdy"])
def test_exec_stdin_digest(demo: RunningServers, transport: str) -> None:
    data = os.urandom(3 * 1024 * 1024 + 7)
    result = podgate(
        "exec",
        "-i",
        "--transport",
        transport,
        "--kubeconfig",
        demo.kubeconfig,
        "pod/demo",
        "--",
        "sha256sum",
        stdin=data,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.decode().split()[0] == sha256_hex(data)


def test_exec_missing_pod_is_a_clear_error(demo: RunningServers) -> None:
    result = podgate("exec", "--kubeconfig", demo.kubeconfig, "nope", "--", "true")
    assert result.returncode == 1
    assert result.stderr.decode() == 'Error from server (NotFound): pods "nope" not found\n'


def test_exec_tty_sees_the_window_size_and_resizes(demo: RunningServers) -> None:
    # The shell waits (5 s at most) for the pty to have a size, prints it, then waits for a
    # line; meanwhile the terminal is resized (SIGWINCH) and the new size must arrive. The
    # resize and the line travel on different streams, so the shell waits (5 s at most) for
    # the size to change after the line rather than racing them.
    script = (
        "i=0; while [ \"$(stty size)\" = '0 0' ] && [ $i -lt 100 ]; do sleep 0.05; i=$((i+1));"
        " done; first=$(stty size); echo $first; read line;"
        ' i=0; while [ "$(stty size)" = "$first" ] && [ $i -lt 100 ]; do sleep 0.05;'
        " i=$((i+1)); done; stty size; exit 4"
    )
    argv = [sys.executable, "-m", "podgate", "exec", "--kubeconfig", demo.kubeconfig]
    argv += ["-i", "-t", "demo", "--", "sh", "-c", script]
    with PtySession(argv, dict(os.environ), rows=ROWS, cols=COLS) as session:
        session.expect(re.compile(rb"%d %d\r\n" % (ROWS, COLS)), STEP_SECONDS)
        session.resize(ROWS + 3, COLS - 5)
        session.write(b"go\r")
        session.expect(re.compile(rb"%d %d\r\n" % (ROWS + 3, COLS - 5)), STEP_SECONDS)
        output = session.read_to_end(STEP_SECONDS)
        assert session.wait(STEP_SECONDS) == 4, output
    assert b"command terminated with exit code 4" in output


def test_exec_tty_without_a_terminal_warns_and_runs(demo: RunningServers) -> None:
    result = podgate("exec", "-t", "--kubeconfig", demo.kubeconfig, "demo", "--", "echo", "hi")
    assert result.returncode == 0
    assert result.stdout == b"hi\n"
    assert b"Unable to use a TTY" in result.stderr


def test_attach_with_stdin(demo: RunningServers) -> None:
    # The demo's attach runs `cat`: stdin comes back, and EOF ends it.
    data = os.urandom(64 * 1024)
    result = podgate("attach", "-i", "--kubeconfig", demo.kubeconfig, "demo", stdin=data)
    assert result.returncode == 0, result.stderr
    assert sha256_hex(result.stdout) == sha256_hex(data)
