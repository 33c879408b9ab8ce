"""Who may do what through the gateway: a policy with four users, exercised with real kubectl
and raw requests, and the audit record each decision leaves.

Users: `admin` (system:masters, the certificate `podgate up` made) may do everything;
`viewer` (token) may get, list and log; `execer` (a client certificate we issue) may exec in
pod `hello`; `forwarder` (token) may port-forward pod `data`, port 7000 only. kubectl reads the
pod before exec, attach, logs and port-forward (kubectl-api-surface.md §1.1, #5), so `execer`
and `forwarder` may also get their pod. How kubectl reports a refusal is §8 there; a WebSocket
upgrade refused with 403 is followed by a SPDY attempt (§1.3).
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from e2e_support import (
    FORWARD_READY_SECONDS,
    Forwarder,
    Kubectl,
    exchange_tcp,
    free_port,
    sha256_hex,
    stop_process,
)
from gateway_support import (
    ECHO_PORT,
    LOGGER_LINE,
    SETTLE_SECONDS,
    SINK_PORT,
    Gateway,
    bearer,
    exec_target,
    matching,
    read_lines,
    spdy_headers,
    websocket_headers,
)

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

KUBECTL_VERSION = "1.33"
SPDY_EXEC_ENV = (("KUBECTL_REMOTE_COMMAND_WEBSOCKETS", "false"),)
# Bytes echoed through the allowed port-forward.
ECHO_BYTES = 1024 * 1024
# Bound on one forwarded exchange, and on kubectl ending after a fatal forwarding error.
EXCHANGE_SECONDS = 30.0
# Lines `kubectl attach logger` must show (one is written every 0.2 s), and how long it may take.
ATTACH_LINES = 2
ATTACH_SECONDS = 5.0
# Terminal size for kubectl's credential prompt, and how long each prompt may take.
ROWS, COLS = 24, 80
PROMPT_SECONDS = 15.0
# How often the reload of the token file and the policy is polled for.
RELOAD_POLL_SECONDS = 0.05

POLICY = """
[[rule]]
groups = ["system:masters"]
namespaces = ["*"]
pods = ["*"]
verbs = ["*"]

[[rule]]
users = ["viewer"]
namespaces = ["default"]
pods = ["*"]
verbs = ["get", "list", "log"]

[[rule]]
users = ["execer"]
namespaces = ["default"]
pods = ["hello"]
verbs = ["get", "exec"]

[[rule]]
users = ["forwarder"]
namespaces = ["default"]
pods = ["data"]
verbs = ["get"]

[[rule]]
users = ["forwarder"]
namespaces = ["default"]
pods = ["data"]
verbs = ["portforward"]
ports = [7000]
"""

FORBIDDEN = b"Error from server (Forbidden)"


@dataclass(frozen=True, slots=True)
class User:
    name: str
    groups: tuple[str, ...]
    auth: str  # "x509" or "token", as the audit log names the method
    kubeconfig: str
    token: str | None = None
    cert: Path | None = None
    key: Path | None = None

    def kubectl(self, gateway: Gateway, env: tuple[tuple[str, str], ...] = ()) -> Kubectl:
        return gateway.kubectl(KUBECTL_VERSION, self.kubeconfig, env)

    def audit_fields(self) -> dict[str, Any]:
        return {"user": self.name, "groups": list(self.groups), "auth": self.auth}


@dataclass(frozen=True, slots=True)
class Users:
    admin: User
    viewer: User
    execer: User
    forwarder: User


def wait_status(gateway: Gateway, token: str, target: str, status: int) -> None:
    """Poll a GET with `token` until it is answered with `status` (a reload took effect)."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        with gateway.connect() as conn:
            response = conn.exchange("GET", target, bearer(token))
        assert response is not None
        if response.status == status:
            return
        assert time.monotonic() < deadline, f"GET {target}: {response.status}, not {status}"
        time.sleep(RELOAD_POLL_SECONDS)


@pytest.fixture(scope="module")
def users(gateway: Gateway) -> Iterator[Users]:
    viewer_token, forwarder_token = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    gateway.add_token(viewer_token, "viewer", ["viewers"])
    gateway.add_token(forwarder_token, "forwarder", ["forwarders"])
    # The token file is re-read on change: the new token authenticates (and, under the first
    # start's policy, which names only system:masters, may not list).
    wait_status(gateway, viewer_token, "/api/v1/namespaces/default/pods", 403)
    gateway.write_policy(POLICY)
    wait_status(gateway, viewer_token, "/api/v1/namespaces/default/pods", 200)
    execer_kubeconfig, execer_cert, execer_key = gateway.cert_kubeconfig("execer", ["exec-team"])
    yield Users(
        admin=User(
            "admin",
            ("system:masters",),
            "x509",
            gateway.kubeconfig,
            cert=gateway.pki.admin_cert,
            key=gateway.pki.admin_key,
        ),
        viewer=User(
            "viewer",
            ("viewers",),
            "token",
            gateway.token_kubeconfig("viewer", viewer_token),
            token=viewer_token,
        ),
        execer=User(
            "execer", ("exec-team",), "x509", execer_kubeconfig, cert=execer_cert, key=execer_key
        ),
        forwarder=User(
            "forwarder",
            ("forwarders",),
            "token",
            gateway.token_kubeconfig("forwarder", forwarder_token),
            token=forwarder_token,
        ),
    )


def assert_denial(entry: dict[str, Any], user: User, verb: str, pod: str) -> None:
    """A denial record: who (and how authenticated), from where, what, and why."""
    assert entry["outcome"] == "denied"
    assert {k: entry[k] for k in ("user", "groups", "auth")} == user.audit_fields()
    assert re.fullmatch(r"127\.0\.0\.1:\d+", entry["address"]), entry
    assert (entry["verb"], entry["namespace"], entry["pod"]) == (verb, "default", pod)
    # The reason names the user and the verb refused.
    assert f'"{user.name}"' in entry["reason"] and verb in entry["reason"], entry


def denials(gateway: Gateway, mark: int, user: User, verb: str, count: int = 1) -> list[Any]:
    found = gateway.audit.wait_for(
        mark, matching(user=user.name, verb=verb, outcome="denied"), count=count
    )
    assert len(found) == count, found
    return found


# --- get ----------------------------------------------------------------------------------


def test_get(gateway: Gateway, users: Users) -> None:
    allowed = users.viewer.kubectl(gateway).run(["get", "pod", "hello"])
    assert allowed.returncode == 0, allowed.stderr
    assert allowed.stdout.decode().splitlines()[1].split()[0] == "hello"

    mark = gateway.audit.mark()
    denied = users.forwarder.kubectl(gateway).run(["get", "pod", "hello"])
    assert denied.returncode == 1
    assert FORBIDDEN in denied.stderr and b'"forwarder"' in denied.stderr, denied.stderr
    (entry,) = denials(gateway, mark, users.forwarder, "get")
    assert_denial(entry, users.forwarder, "get", "hello")


# --- list ---------------------------------------------------------------------------------


def test_list(gateway: Gateway, users: Users) -> None:
    allowed = users.viewer.kubectl(gateway).run(["get", "pods"])
    assert allowed.returncode == 0, allowed.stderr
    names = [line.split()[0] for line in allowed.stdout.decode().splitlines()[1:]]
    assert sorted(names) == ["data", "data-sandboxed", "hello", "logger", "shell"]

    mark = gateway.audit.mark()
    denied = users.execer.kubectl(gateway).run(["get", "pods"])
    assert denied.returncode == 1
    assert FORBIDDEN in denied.stderr and b'"execer"' in denied.stderr, denied.stderr
    (entry,) = denials(gateway, mark, users.execer, "list")
    # A list is of the namespace, not of a pod.
    assert_denial(entry, users.execer, "list", "*")


# --- log ----------------------------------------------------------------------------------


def test_log(gateway: Gateway, users: Users) -> None:
    allowed = users.viewer.kubectl(gateway).run(["logs", "logger"])
    assert allowed.returncode == 0, allowed.stderr
    lines = allowed.stdout.decode().splitlines()
    assert lines and all(LOGGER_LINE.match(line) for line in lines)

    # execer may read pod hello (and exec in it) but not its log.
    mark = gateway.audit.mark()
    denied = users.execer.kubectl(gateway).run(["logs", "hello"])
    assert denied.returncode == 1
    assert FORBIDDEN in denied.stderr and b'"execer"' in denied.stderr, denied.stderr
    assert denied.stdout == b""
    (entry,) = denials(gateway, mark, users.execer, "log")
    assert_denial(entry, users.execer, "log", "hello")


@pytest.mark.parametrize(
    ("verb", "args", "pod"),
    [
        ("get", ["get", "pod", "hello"], "hello"),
        ("list", ["get", "pods"], "*"),
        ("log", ["logs", "logger"], "logger"),
    ],
)
def test_allowed_reads_are_audited(
    gateway: Gateway, users: Users, verb: str, args: list[str], pod: str
) -> None:
    """Every decision is audited, the allowed ones too (the audit log is "one line per
    decision and per finished stream"): an allowed get, list or log leaves a record."""
    mark = gateway.audit.mark()
    result = users.viewer.kubectl(gateway).run(args)
    assert result.returncode == 0, result.stderr
    (entry, *_) = gateway.audit.wait_for(mark, matching(user="viewer", verb=verb))
    assert entry["outcome"] == "allowed"
    assert {k: entry[k] for k in ("user", "groups", "auth")} == users.viewer.audit_fields()
    assert (entry["namespace"], entry["pod"]) == ("default", pod)
    assert re.fullmatch(r"127\.0\.0\.1:\d+", entry["address"]), entry


# --- exec ---------------------------------------------------------------------------------


def test_exec_allowed(gateway: Gateway, users: Users) -> None:
    mark = gateway.audit.mark()
    result = users.execer.kubectl(gateway).run(["exec", "hello", "--", "sh", "-c", "echo ok"])
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"ok\n"
    fields = {**users.execer.audit_fields(), "verb": "exec", "namespace": "default"}
    (started,) = gateway.audit.wait_for(mark, matching(**fields, pod="hello", stage="started"))
    (finished,) = gateway.audit.wait_for(mark, matching(**fields, pod="hello", stage="finished"))
    assert started["outcome"] == "allowed"
    assert started["command"] == ["sh", "-c", "echo ok"]
    assert (finished["outcome"], finished["reason"]) == ("completed", "exit code 0")
    assert started["address"] == finished["address"]
    assert re.fullmatch(r"127\.0\.0\.1:\d+", started["address"]), started


@pytest.mark.parametrize(
    ("env", "attempts"),
    [
        # WebSocket refused with 403, then the SPDY fallback, refused too (§1.3, §8).
        pytest.param((), 2, id="websocket-then-spdy"),
        pytest.param(SPDY_EXEC_ENV, 1, id="spdy"),
    ],
)
def test_exec_denied_kubectl(
    gateway: Gateway, users: Users, env: tuple[tuple[str, str], ...], attempts: int
) -> None:
    mark = gateway.audit.mark()
    result = users.viewer.kubectl(gateway, env).run(["exec", "hello", "--", "touch", "/tmp/x"])
    assert result.returncode == 1
    assert result.stdout == b""
    assert FORBIDDEN in result.stderr and b'"viewer"' in result.stderr, result.stderr
    for entry in denials(gateway, mark, users.viewer, "exec", count=attempts):
        assert_denial(entry, users.viewer, "exec", "hello")
    # Nothing ran: no stream was started for the viewer.
    assert not [e for e in gateway.audit.since(mark) if e.get("stage") == "started"]


@pytest.mark.parametrize(
    "upgrade",
    [
        pytest.param(websocket_headers("v5.channel.k8s.io"), id="websocket"),
        pytest.param(spdy_headers(["v4.channel.k8s.io"]), id="spdy"),
    ],
)
def test_exec_denied_raw_upgrade(
    gateway: Gateway, users: Users, upgrade: list[tuple[str, str]]
) -> None:
    """The upgrade request itself (a WebSocket GET is an exec, not a get) is refused: 403 with
    a Status, never 101."""
    assert users.viewer.token is not None
    mark = gateway.audit.mark()
    method = "GET" if ("Upgrade", "websocket") in upgrade else "POST"
    with gateway.connect() as conn:
        response = conn.exchange(
            method, exec_target("hello", ["id"]), upgrade + bearer(users.viewer.token)
        )
        address = conn.local_address
    assert response is not None
    assert response.status == 403
    status = response.json()
    assert (status["kind"], status["code"], status["reason"]) == ("Status", 403, "Forbidden")
    assert '"viewer"' in status["message"]
    (entry,) = denials(gateway, mark, users.viewer, "exec")
    assert_denial(entry, users.viewer, "exec", "hello")
    assert entry["address"] == address


def test_exec_denied_on_another_pod_raw(gateway: Gateway, users: Users) -> None:
    """execer may exec in hello only; its certificate is the identity on a raw connection."""
    mark = gateway.audit.mark()
    with gateway.connect(cert=users.execer.cert, key=users.execer.key) as conn:
        response = conn.exchange(
            "GET", exec_target("data", ["id"]), websocket_headers("v5.channel.k8s.io")
        )
        address = conn.local_address
    assert response is not None and response.status == 403
    (entry,) = denials(gateway, mark, users.execer, "exec")
    assert_denial(entry, users.execer, "exec", "data")
    assert entry["address"] == address


# --- attach -------------------------------------------------------------------------------


def test_attach_allowed(gateway: Gateway, users: Users) -> None:
    mark = gateway.audit.mark()
    with users.admin.kubectl(gateway).popen(["attach", "logger"]) as proc:
        lines = read_lines(proc, ATTACH_LINES, ATTACH_SECONDS)
    assert all(LOGGER_LINE.match(line) for line in lines), lines
    fields = {**users.admin.audit_fields(), "verb": "attach", "namespace": "default"}
    (started,) = gateway.audit.wait_for(mark, matching(**fields, pod="logger", stage="started"))
    assert started["outcome"] == "allowed"
    assert started["container"] == "log"


@pytest.mark.parametrize(("who", "pod"), [("viewer", "logger"), ("execer", "hello")])
def test_attach_denied(gateway: Gateway, users: Users, who: str, pod: str) -> None:
    # viewer may read logger but not attach; execer may exec in hello but not attach to it.
    user: User = getattr(users, who)
    mark = gateway.audit.mark()
    result = user.kubectl(gateway).run(["attach", pod])
    assert result.returncode == 1
    assert FORBIDDEN in result.stderr and f'"{who}"'.encode() in result.stderr, result.stderr
    for entry in denials(gateway, mark, user, "attach", count=2):  # WebSocket, then SPDY
        assert_denial(entry, user, "attach", pod)


# --- port-forward -------------------------------------------------------------------------


def test_portforward_allowed_port_then_denied_port(gateway: Gateway, users: Users) -> None:
    """One kubectl session forwards 7000 (allowed) and 7001 (not): the first connection works,
    the second is refused on its own stream with the policy's reason, which kubectl prints
    (kubectl-api-surface.md §6.3: `an error occurred forwarding L -> P: <text>`)."""
    kubectl = users.forwarder.kubectl(gateway)
    echo_local, sink_local = free_port(), free_port()
    mark = gateway.audit.mark()
    data = os.urandom(ECHO_BYTES)
    proc = subprocess.Popen(
        kubectl.argv(
            ["port-forward", "pod/data", f"{echo_local}:{ECHO_PORT}", f"{sink_local}:{SINK_PORT}"]
        ),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=kubectl.environ(),
    )
    forwarder = Forwarder(proc, sink_local, SINK_PORT)  # the last "Forwarding from" line
    try:
        forwarder.wait_ready(FORWARD_READY_SECONDS)
        echoed = exchange_tcp(echo_local, data, EXCHANGE_SECONDS)
        assert (echoed.nbytes, echoed.sha256) == (len(data), sha256_hex(data))
        with socket.create_connection(("127.0.0.1", sink_local), timeout=EXCHANGE_SECONDS) as s:
            s.sendall(b"refused?")
            s.shutdown(socket.SHUT_WR)
            assert s.recv(1024) == b""  # nothing from the sink: the stream was refused
        error_line = f"an error occurred forwarding {sink_local} -> {SINK_PORT}: "
        deadline = time.monotonic() + EXCHANGE_SECONDS
        while error_line not in forwarder.stderr and time.monotonic() < deadline:
            time.sleep(RELOAD_POLL_SECONDS)
    finally:
        stop_process(proc)
        forwarder.join_readers()
    line = next((x for x in forwarder.stderr.splitlines() if error_line in x), None)
    assert line is not None, forwarder.stderr
    # klog quotes the message: err="an error occurred forwarding …: <text>"
    reason = line.split(error_line, 1)[1].removesuffix('"').replace('\\"', '"')
    assert str(SINK_PORT) in reason and '"forwarder"' in reason, line

    fields = {**users.forwarder.audit_fields(), "verb": "portforward", "pod": "data"}
    (allowed,) = gateway.audit.wait_for(mark, matching(**fields, port=ECHO_PORT))
    (refused,) = gateway.audit.wait_for(mark, matching(**fields, port=SINK_PORT))
    assert allowed["outcome"] == "allowed"
    assert (allowed["bytes_in"], allowed["bytes_out"]) == (len(data), len(data))
    assert refused["outcome"] == "denied"
    assert refused["reason"] == reason.strip()
    assert (refused["bytes_in"], refused["bytes_out"]) == (0, 0)
    for entry in (allowed, refused):
        assert entry["namespace"] == "default"
        assert re.fullmatch(r"127\.0\.0\.1:\d+", entry["address"]), entry


def test_portforward_denied(gateway: Gateway, users: Users) -> None:
    """viewer may read pod data but not forward to it: the upgrade is refused (WebSocket,
    then SPDY) and kubectl reports the SPDY refusal (§8)."""
    mark = gateway.audit.mark()
    result = users.viewer.kubectl(gateway).run(["port-forward", "pod/data", f"{free_port()}:7000"])
    assert result.returncode == 1
    assert b"error upgrading connection" in result.stderr, result.stderr
    assert b'"viewer"' in result.stderr and b"portforward" in result.stderr, result.stderr
    for entry in denials(gateway, mark, users.viewer, "portforward", count=2):
        assert_denial(entry, users.viewer, "portforward", "data")


# --- no credentials -----------------------------------------------------------------------


def test_anonymous_kubectl(gateway: Gateway) -> None:
    """A kubeconfig with the server and its CA but no credentials. Over HTTPS kubectl then asks
    for a user name and password on its terminal; the answers become HTTP basic credentials,
    which the gateway (like kube-apiserver since 1.19) does not accept: the request is
    anonymous, and kubectl reports the 401 (kubectl-api-surface.md §8)."""
    kubectl = gateway.kubectl(KUBECTL_VERSION, gateway.anonymous_kubeconfig())
    mark = gateway.audit.mark()
    with kubectl.pty_session(["get", "pods"], rows=ROWS, cols=COLS) as session:
        session.expect(re.compile(rb"Username: "), PROMPT_SECONDS)
        session.write(b"nobody\r")
        session.expect(re.compile(rb"Password: "), PROMPT_SECONDS)
        session.write(b"\r")
        output = session.read_to_end(PROMPT_SECONDS)
        assert session.wait(PROMPT_SECONDS) == 1, output
    assert b"You must be logged in to the server" in output, output
    entries = gateway.audit.wait_for(mark, matching(user=None, outcome="denied"))
    for entry in entries:
        assert entry["reason"] == "unauthenticated"
        assert re.fullmatch(r"127\.0\.0\.1:\d+", entry["address"]), entry
    assert not [e for e in gateway.audit.since(mark) if e.get("user") is not None]


@pytest.mark.parametrize(
    "credentials",
    [pytest.param([], id="none"), pytest.param(bearer("not-a-known-token"), id="unknown-token")],
)
def test_unauthenticated_exec_upgrade(gateway: Gateway, credentials: list[tuple[str, str]]) -> None:
    mark = gateway.audit.mark()
    target = exec_target("hello", ["id"])
    with gateway.connect() as conn:
        response = conn.exchange(
            "GET", target, websocket_headers("v5.channel.k8s.io") + credentials
        )
        address = conn.local_address
    assert response is not None and response.status == 401
    assert response.json()["reason"] == "Unauthorized"
    (entry,) = gateway.audit.wait_for(mark, matching(user=None, address=address))
    assert (entry["outcome"], entry["reason"], entry["path"]) == (
        "denied",
        "unauthenticated",
        target.split("?")[0],
    )
