"""`podgate port-forward` and `exec` against the real gateway (`podgate up`): HTTPS with the
kubeconfigs it writes (client certificate, token), its authorization policy, real pods."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from e2e_support import exchange_tcp, sha256_hex
from forward_support import REPO, json_forward
from gateway_support import ECHO_PORT, SETTLE_SECONDS, Gateway, bearer, running_gateway

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

TRANSFER_BYTES = 16 * 1024 * 1024
STEP_SECONDS = 30.0
RELOAD_POLL_SECONDS = 0.05


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    if os.geteuid() != 0:
        pytest.skip("podgate up runs pods in Linux namespaces: needs root")
    with running_gateway() as running:
        yield running


def podgate(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "podgate", *args],
        input=stdin,
        capture_output=True,
        cwd=REPO,
        timeout=STEP_SECONDS,
        check=False,
    )


def no_rights_kubeconfig(gateway: Gateway) -> str:
    """A token the gateway knows (401 no more) whose user no policy rule names (403)."""
    token = secrets.token_urlsafe(32)
    gateway.add_token(token, "nobody-in-particular", ["no-group"])
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:  # the token file is re-read when it changes
        with gateway.connect() as conn:
            response = conn.exchange("GET", "/api/v1/namespaces/default/pods/data", bearer(token))
        assert response is not None
        if response.status == 403:
            return gateway.token_kubeconfig("nobody", token)
        assert time.monotonic() < deadline, f"token not accepted: {response.status}"
        time.sleep(RELOAD_POLL_SECONDS)


@pytest.mark.parametrize("kind", ["certificate", "token"])
def test_forward_16_mib_over_https(gateway: Gateway, kind: str) -> None:
    kubeconfig = gateway.kubeconfig if kind == "certificate" else gateway.kubeconfig_token
    data = os.urandom(TRANSFER_BYTES)
    with json_forward(["--kubeconfig", kubeconfig, "pod/data", f":{ECHO_PORT}"]) as fwd:
        port = fwd.ports(1)[(ECHO_PORT, "tcp")]
        (connected,) = fwd.wait_for("connected")
        assert connected["protocol"] == "websocket"  # the gateway serves kubectl 1.31+'s tunnel
        got = exchange_tcp(port, data, STEP_SECONDS)
        assert (got.nbytes, got.sha256) == (len(data), sha256_hex(data))
        assert fwd.interrupt() == 0


def test_token_without_rights_exits_4(gateway: Gateway) -> None:
    kubeconfig = no_rights_kubeconfig(gateway)
    with json_forward(["--kubeconfig", kubeconfig, "data", f":{ECHO_PORT}"]) as fwd:
        assert fwd.wait_exit(STEP_SECONDS) == 4
    (denied,) = [e for e in fwd.events if e["event"] == "target_denied"]
    assert denied["target"] == "default/data"
    assert "Forbidden" in denied["error"] and "nobody-in-particular" in denied["error"], denied
    assert [e["event"] for e in fwd.events][-1] == "target_denied"


def test_exec_exit_code_and_stdin_over_https(gateway: Gateway) -> None:
    result = podgate(
        "exec", "--kubeconfig", gateway.kubeconfig_token, "hello", "--", "sh", "-c", "exit 3"
    )
    assert result.returncode == 3, result.stderr
    data = os.urandom(1024 * 1024)
    result = podgate(
        "exec",
        "-i",
        "--kubeconfig",
        gateway.kubeconfig,
        "data",
        "--",
        "python3",
        "-c",
        "import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())",
        stdin=data,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.decode().strip() == sha256_hex(data)


def test_exec_denied_is_a_clear_error(gateway: Gateway) -> None:
    result = podgate("exec", "--kubeconfig", no_rights_kubeconfig(gateway), "hello", "--", "true")
    assert result.returncode == 1
    stderr = result.stderr.decode()
    assert stderr.startswith("Error from server (Forbidden): "), stderr
