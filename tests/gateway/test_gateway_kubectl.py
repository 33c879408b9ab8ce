"""Real kubectl through `podgate up`: the HTTPS gateway, the CRI runtime and real pods.

Each kubectl profile runs with the admin's client-certificate kubeconfig, and 1.27 and 1.33
also with the bearer-token one. Which transport each profile must end up on is
kubectl-api-surface.md §1.2 and §7; the gateway's audit log records the one it served, and the
credential it authenticated. Expected outputs come from the commands run in the pods (sh,
sha256sum, stty) and the bytes the tests send; every digest is computed here.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from e2e_support import Kubectl, exchange_tcp, free_port, sha256_hex
from gateway_support import (
    ECHO_PORT,
    LOGGER_LINE,
    SINK_PORT,
    V6_ECHO_PORT,
    Gateway,
    matching,
    read_lines,
)

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

# Concurrent local connections through one port-forward, and what each sends to the sink:
# 8 × 128 MiB = 1 GiB for every profile with the client certificate, 8 × 16 MiB for the token
# runs (the same path, another credential).
SINK_CONNECTIONS = 8
BIG_SINK_BYTES = 128 * 1024 * 1024
SMALL_SINK_BYTES = 16 * 1024 * 1024
# One connection through the echo port, both ways.
ECHO_BYTES = 1024 * 1024 * 1024
# Upper bounds for the transfers (a few seconds each through the gateway on loopback).
SINK_TIMEOUT_SECONDS = 120.0
ECHO_TIMEOUT_SECONDS = 180.0
# Bytes piped through `exec -i ... sha256sum`: several MiB, so stdin crosses many frames.
STDIN_BYTES = 4 * 1024 * 1024 + 17
# The local terminal's size for the tty tests: unusual numbers, so no default can match.
ROWS, COLS = 33, 97
# How long a pty session may take to show each expected piece of output.
PTY_STEP_SECONDS = 15.0
# Lines `kubectl logs -f` must deliver, and the time they may take (one per 0.2 s is written).
FOLLOW_LINES = 5
FOLLOW_SECONDS = 5.0
# After kubectl is gone, how long the gateway may take to log a failure, if it does.
AFTERMATH_SECONDS = 1.0

WS_EXEC = "websocket:v5.channel.k8s.io"
WS_TUNNEL = "websocket:SPDY/3.1+portforward.k8s.io"
SPDY_EXEC = "spdy:v4.channel.k8s.io"  # kubectl offers v5 first; the gateway picks v4
SPDY_PF = "spdy:portforward.k8s.io"


@dataclass(frozen=True, slots=True)
class Case:
    """A kubectl version, its environment, a credential, and the transports it must use."""

    name: str
    version: str
    env: tuple[tuple[str, str], ...]
    exec_transport: str
    portforward_transport: str
    credential: str  # "x509" (client certificate) or "token", as the audit log names them
    big: bool = False  # 1 GiB through the sink

    @property
    def id(self) -> str:
        return f"{self.name}-{'cert' if self.credential == 'x509' else 'token'}"


_PROFILES = {
    "1.27": ("1.27", (), SPDY_EXEC, SPDY_PF),
    "1.30": ("1.30", (), WS_EXEC, SPDY_PF),
    "1.33": ("1.33", (), WS_EXEC, WS_TUNNEL),
    "1.33-pf-spdy": ("1.33", (("KUBECTL_PORT_FORWARD_WEBSOCKETS", "false"),), WS_EXEC, SPDY_PF),
    "1.33-exec-spdy": (
        "1.33",
        (("KUBECTL_REMOTE_COMMAND_WEBSOCKETS", "false"),),
        SPDY_EXEC,
        WS_TUNNEL,
    ),
}


def _case(name: str, credential: str, big: bool = False) -> Case:
    return Case(name, *_PROFILES[name], credential=credential, big=big)


CASES = [
    _case("1.27", "x509", big=True),
    _case("1.27", "token"),
    _case("1.30", "x509", big=True),
    _case("1.33", "x509", big=True),
    _case("1.33", "token"),
    _case("1.33-pf-spdy", "x509", big=True),
    _case("1.33-exec-spdy", "x509", big=True),
]


@pytest.fixture(params=[pytest.param(c, id=c.id) for c in CASES])
def case(request: pytest.FixtureRequest) -> Case:
    return request.param  # type: ignore[no-any-return]


def kubectl_for(gateway: Gateway, case: Case) -> Kubectl:
    kubeconfig = gateway.kubeconfig if case.credential == "x509" else gateway.kubeconfig_token
    return gateway.kubectl(case.version, kubeconfig, case.env)


@pytest.fixture
def kubectl(gateway: Gateway, case: Case) -> Kubectl:
    return kubectl_for(gateway, case)


class Payload:
    """1 GiB of pseudo-random bytes (an AES-CTR keystream under a random key: as unpredictable
    as os.urandom for these tests, and several times faster), and the digests of its slices."""

    def __init__(self, size: int) -> None:
        cipher = Cipher(algorithms.AES(os.urandom(16)), modes.CTR(os.urandom(16)))
        self.data = cipher.encryptor().update(bytes(size))
        self._digests: dict[tuple[int, int], str] = {}

    def chunk(self, index: int, size: int) -> memoryview:
        return memoryview(self.data)[index * size : (index + 1) * size]

    def digest(self, index: int, size: int) -> str:
        key = (index, size)
        if key not in self._digests:
            self._digests[key] = hashlib.sha256(self.chunk(index, size)).hexdigest()
        return self._digests[key]


@pytest.fixture(scope="module")
def payload() -> Payload:
    """Made once: each sink connection sends its own slice; the echo sends all of it."""
    return Payload(ECHO_BYTES)


def admin(case: Case) -> dict[str, Any]:
    """The audit fields every admin request of this case carries."""
    return {"user": "admin", "groups": ["system:masters"], "auth": case.credential}


def test_get_pods(kubectl: Kubectl) -> None:
    result = kubectl.run(["get", "pods"])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.decode().splitlines()
    assert lines[0].split() == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    rows = {line.split()[0]: line.split()[1:3] for line in lines[1:]}
    assert rows == {
        name: ["1/1", "Running"] for name in ("data", "data-sandboxed", "hello", "logger", "shell")
    }


def test_get_one_pod_shows_its_status(gateway: Gateway) -> None:
    """`kubectl get pod NAME` asks for a Table, as the list does; answered with a plain Pod,
    kubectl can only print NAME and AGE (kubectl-api-surface.md §1.1, #4)."""
    result = kubectl_for(gateway, _case("1.33", "x509")).run(["get", "pod", "hello"])
    assert result.returncode == 0, result.stderr
    header, row = result.stdout.decode().splitlines()
    assert header.split() == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"], result.stdout
    assert row.split()[:4] == ["hello", "1/1", "Running", "0"], result.stdout


def test_logs(kubectl: Kubectl) -> None:
    result = kubectl.run(["logs", "logger"])
    assert result.returncode == 0, result.stderr
    numbers = [int(LOGGER_LINE.match(line)[1]) for line in result.stdout.decode().splitlines()]  # type: ignore[index]
    # The whole log from the container's start: every line, in order, none twice.
    assert numbers and numbers == list(range(1, len(numbers) + 1))


def test_logs_follow(kubectl: Kubectl) -> None:
    with kubectl.popen(["logs", "-f", "--tail=1", "logger"]) as proc:
        lines = read_lines(proc, FOLLOW_LINES, FOLLOW_SECONDS)
        assert proc.poll() is None  # still following
    numbers = [int(LOGGER_LINE.match(line)[1]) for line in lines]  # type: ignore[index]
    # New lines as the container writes them: consecutive, none lost or repeated.
    assert numbers == list(range(numbers[0], numbers[0] + FOLLOW_LINES))


@pytest.mark.parametrize("code", [0, 3])
def test_exec_exit_code(gateway: Gateway, kubectl: Kubectl, case: Case, code: int) -> None:
    audit = gateway.audit
    mark = audit.mark()
    command = ["sh", "-c", f"echo out; echo err >&2; exit {code}"]
    result = kubectl.run(["exec", "hello", "--", *command])
    assert result.stdout == b"out\n", result.stderr
    assert result.returncode == code, result.stderr
    if code == 0:
        assert result.stderr == b"err\n"
    else:
        assert result.stderr.startswith(b"err\n")
        assert f"command terminated with exit code {code}".encode() in result.stderr
    expected = {
        **admin(case),
        "verb": "exec",
        "namespace": "default",
        "pod": "hello",
        "container": "web",
        "transport": case.exec_transport,
        "command": command,
    }
    (started,) = audit.wait_for(mark, matching(**expected, stage="started"))
    (finished,) = audit.wait_for(mark, matching(**expected, stage="finished"))
    assert started["outcome"] == "allowed"
    assert finished["outcome"] == "completed"
    assert finished["reason"] == f"exit code {code}"
    assert re.fullmatch(r"127\.0\.0\.1:\d+", started["address"]), started
    assert finished["address"] == started["address"]


def test_exec_stdin(kubectl: Kubectl) -> None:
    # sha256sum prints only after reading to EOF: the digest proves every byte and the EOF.
    data = os.urandom(STDIN_BYTES)
    result = kubectl.run(["exec", "-i", "hello", "--", "sha256sum"], stdin=data)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{sha256_hex(data)}  -\n".encode()


def test_exec_tty_size(kubectl: Kubectl) -> None:
    # The first size travels separately from the upgrade (test_tty_initial_size.py): the shell
    # waits (5 s at most) for the pty to have one before printing it. busybox's stty fails on a
    # pty without a size (coreutils' prints "0 0"): anything but "ROWS COLS" means "not yet".
    script = (
        'i=0; while :; do s=$(stty size 2>/dev/null); case "$s" in [1-9]*) break;; esac;'
        ' [ $i -ge 100 ] && break; sleep 0.05; i=$((i+1)); done; echo "$s"'
    )
    with kubectl.pty_session(
        ["exec", "-i", "-t", "hello", "--", "sh", "-c", script], rows=ROWS, cols=COLS
    ) as session:
        output = session.read_to_end(PTY_STEP_SECONDS)
        assert session.wait(PTY_STEP_SECONDS) == 0, output
    assert output == b"%d %d\r\n" % (ROWS, COLS)


def test_attach_tty_shell(kubectl: Kubectl) -> None:
    with kubectl.pty_session(["attach", "-i", "-t", "shell"], rows=ROWS, cols=COLS) as session:
        # kubectl prints this once the session is up; typing before it could be lost.
        session.expect(re.compile(rb"try pressing enter"), PTY_STEP_SECONDS)
        session.write(b"echo $((6*7))\r")
        # The shell's answer on a line of its own (the typed line is echoed, but holds no 42).
        session.expect(re.compile(rb"\r\n42\r\n"), PTY_STEP_SECONDS)


def test_port_forward_sink(
    gateway: Gateway, kubectl: Kubectl, case: Case, payload: Payload
) -> None:
    size = BIG_SINK_BYTES if case.big else SMALL_SINK_BYTES
    chunks = [payload.chunk(i, size) for i in range(SINK_CONNECTIONS)]
    local = free_port()
    audit = gateway.audit
    mark = audit.mark()
    started = time.monotonic()
    with kubectl.port_forward("data", local, SINK_PORT) as forwarder:
        with ThreadPoolExecutor(SINK_CONNECTIONS) as pool:
            answers = list(
                pool.map(lambda data: exchange_tcp(local, data, SINK_TIMEOUT_SECONDS), chunks)
            )
        assert forwarder.proc.poll() is None, forwarder.stderr
    elapsed = time.monotonic() - started
    for i, answer in enumerate(answers):
        assert answer.nbytes == 64
        assert answer.head.decode() == payload.digest(i, size)
    assert forwarder.stdout.count(f"Handling connection for {local}\n") == SINK_CONNECTIONS
    assert "error" not in forwarder.stderr.lower(), forwarder.stderr
    # One audit record per forwarded connection, with the port and the bytes each way.
    records = audit.wait_for(
        mark,
        matching(**admin(case), verb="portforward", pod="data", port=SINK_PORT),
        count=SINK_CONNECTIONS,
    )
    assert len(records) == SINK_CONNECTIONS
    for record in records:
        assert record["transport"] == case.portforward_transport
        assert record["outcome"] == "allowed"
        assert (record["bytes_in"], record["bytes_out"]) == (size, 64)
    print(f"{case.id}: {SINK_CONNECTIONS} x {size >> 20} MiB to the sink in {elapsed:.1f} s")


def test_port_forward_echo_1gib(gateway: Gateway, payload: Payload) -> None:
    case = _case("1.33", "x509")
    local = free_port()
    audit = gateway.audit
    mark = audit.mark()
    started = time.monotonic()
    with kubectl_for(gateway, case).port_forward("data", local, ECHO_PORT) as forwarder:
        echoed = exchange_tcp(local, payload.data, ECHO_TIMEOUT_SECONDS)
        assert forwarder.proc.poll() is None, forwarder.stderr
    elapsed = time.monotonic() - started
    assert echoed.nbytes == ECHO_BYTES
    assert echoed.sha256 == payload.digest(0, ECHO_BYTES)
    (record,) = audit.wait_for(
        mark, matching(**admin(case), verb="portforward", pod="data", port=ECHO_PORT)
    )
    assert (record["bytes_in"], record["bytes_out"]) == (ECHO_BYTES, ECHO_BYTES)
    assert record["transport"] == WS_TUNNEL
    print(f"1 GiB echoed in {elapsed:.1f} s")


def test_logs_follow_client_leaving_is_not_an_error(gateway: Gateway) -> None:
    """kubectl stops following (^C): the gateway ends the response quietly. A failed write to
    the gone client is the normal end of a follow, not an unhandled error."""
    kubectl = kubectl_for(gateway, _case("1.33", "x509"))
    mark = gateway.log_mark()
    with kubectl.popen(["logs", "-f", "--tail=1", "logger"]) as proc:
        read_lines(proc, 1, FOLLOW_SECONDS)
    # The next line is written 0.2 s later, to a closed connection.
    time.sleep(AFTERMATH_SECONDS)
    assert "Traceback" not in gateway.log_since(mark), gateway.log_since(mark)


@pytest.mark.parametrize("name", ["1.33", "1.27"])
def test_attach_client_leaving_ends_the_session(gateway: Gateway, name: str) -> None:
    """kubectl attach (no stdin) is stopped while the container keeps writing: the gateway must
    end the session (and its audit record and stream count), not hold it open for as long as
    the container runs."""
    case = _case(name, "x509")
    audit = gateway.audit
    mark = audit.mark()
    with gateway.kubectl(case.version, gateway.kubeconfig).popen(["attach", "logger"]) as proc:
        read_lines(proc, 2, FOLLOW_SECONDS)
    fields = {**admin(case), "verb": "attach", "pod": "logger"}
    audit.wait_for(mark, matching(**fields, stage="started"))
    (finished,) = audit.wait_for(mark, matching(**fields, stage="finished"))
    assert finished["outcome"] in ("completed", "error")


SANDBOX_CASES = [_case("1.27", "x509"), _case("1.33", "x509")]


@pytest.mark.parametrize("sandbox_case", SANDBOX_CASES, ids=[c.id for c in SANDBOX_CASES])
def test_port_forward_into_a_sandboxed_pod(
    gateway: Gateway, payload: Payload, sandbox_case: Case
) -> None:
    """kubectl into a VM-style pod (its servers live in a guest netns the runtime's reported
    pod netns cannot reach): 8 concurrent connections x 128 MiB = 1 GiB to a 127.0.0.1-only
    sink, plus an echo bound only to ::1, through gateway → runtime → sandbox shim → agent."""
    kubectl = kubectl_for(gateway, sandbox_case)
    chunks = [payload.chunk(i, BIG_SINK_BYTES) for i in range(SINK_CONNECTIONS)]
    local, local_v6 = free_port(), free_port()
    mark = gateway.audit.mark()
    with kubectl.port_forward("data-sandboxed", local, SINK_PORT) as forwarder:
        with ThreadPoolExecutor(SINK_CONNECTIONS) as pool:
            answers = list(
                pool.map(lambda data: exchange_tcp(local, data, SINK_TIMEOUT_SECONDS), chunks)
            )
        assert forwarder.proc.poll() is None, forwarder.stderr
    for i, answer in enumerate(answers):
        assert answer.head.decode() == payload.digest(i, BIG_SINK_BYTES)
    data = payload.chunk(0, 4 << 20)
    with kubectl.port_forward("data-sandboxed", local_v6, V6_ECHO_PORT) as forwarder:
        echoed = exchange_tcp(local_v6, data, SINK_TIMEOUT_SECONDS)
        assert forwarder.proc.poll() is None, forwarder.stderr
    assert echoed.nbytes == len(data) and echoed.sha256 == sha256_hex(data)
    records = gateway.audit.wait_for(
        mark,
        lambda e: (
            matching(**admin(sandbox_case), verb="portforward", pod="data-sandboxed")(e)
            and "port" in e
        ),
        count=SINK_CONNECTIONS + 1,
    )
    assert sorted(r["port"] for r in records) == [SINK_PORT] * SINK_CONNECTIONS + [V6_ECHO_PORT]
    assert {r["outcome"] for r in records} == {"allowed"}, records
