"""The official Python `kubernetes` client through `podgate up`'s gateway, authenticated with the
admin's client certificate from the kubeconfig `podgate up` wrote.

The client speaks WebSocket only (exec: v5/v4 channels; port-forward: v4 channel pairs with
their port headers), kubectl-api-surface.md §10.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest
from e2e_support import exchange, sha256_hex
from gateway_support import ECHO_PORT, HTTP10_PORT, STALL_PORT, Gateway, matching
from kubernetes import client, config
from kubernetes.stream import portforward, stream
from test_gateway_streams import EXPECTED, http10_exchange

from podgate.aio.spdy import STALLED_STREAM_RESET_SECONDS

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

# Bound on one exec session and on the port-forward exchange.
SESSION_TIMEOUT_SECONDS = 30.0
# Bytes echoed through the client's port-forward socket.
FORWARD_BYTES = 8 * 1024 * 1024


@pytest.fixture(scope="module")
def api(gateway: Gateway) -> Iterator[Any]:
    # The loader writes the embedded certificate and key to files: keep them in a directory
    # of our own, removed afterwards.
    certs = tempfile.mkdtemp(prefix="pgwpy")
    try:
        configuration = client.Configuration()
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=gateway.kubeconfig,
            client_configuration=configuration,
            temp_file_path=certs,
        )
        assert configuration.cert_file and configuration.key_file  # the certificate, no token
        assert "authorization" not in {k.lower() for k in configuration.api_key}
        with client.ApiClient(configuration) as api_client:
            yield client.CoreV1Api(api_client)
    finally:
        shutil.rmtree(certs, ignore_errors=True)


def wait_closed(pf: Any, timeout: float = SESSION_TIMEOUT_SECONDS) -> bool:
    """The client's proxy thread closes the WebSocket once every local socket is closed."""
    deadline = time.monotonic() + timeout
    while pf.connected and time.monotonic() < deadline:
        time.sleep(0.01)
    return not pf.connected


def test_list_pods(api: Any) -> None:
    pods = api.list_namespaced_pod("default")
    assert sorted(p.metadata.name for p in pods.items) == [
        "data",
        "data-sandboxed",
        "hello",
        "logger",
        "shell",
    ]
    assert {p.status.phase for p in pods.items} == {"Running"}


def test_exec_exit_code(api: Any, gateway: Gateway) -> None:
    audit = gateway.audit
    mark = audit.mark()
    resp = stream(
        api.connect_get_namespaced_pod_exec,
        "hello",
        "default",
        command=["sh", "-c", "echo out; exit 3"],
        stderr=True,
        stdin=False,
        stdout=True,
        tty=False,
        _preload_content=False,
    )
    try:
        resp.run_forever(timeout=SESSION_TIMEOUT_SECONDS)
        assert not resp.is_open(), "the server did not end the session"
        assert resp.read_stdout() == "out\n"
        assert resp.returncode == 3
    finally:
        resp.close()
        resp.sock.shutdown()
    (finished,) = audit.wait_for(mark, matching(verb="exec", pod="hello", stage="finished"))
    assert finished["user"] == "admin" and finished["auth"] == "x509"
    assert finished["transport"].startswith("websocket:")
    assert (finished["outcome"], finished["reason"]) == ("completed", "exit code 3")


def test_audit_names_the_negotiated_subprotocol(api: Any, gateway: Gateway) -> None:
    """The client offers `v5.channel.k8s.io,v4.channel.k8s.io`; the session runs on the one
    the gateway chose (the client reports it). The audit record must name that one, not the
    client's list of offers."""
    audit = gateway.audit
    mark = audit.mark()
    resp = stream(
        api.connect_get_namespaced_pod_exec,
        "hello",
        "default",
        command=["true"],
        stderr=True,
        stdin=False,
        stdout=True,
        tty=False,
        _preload_content=False,
    )
    try:
        negotiated = resp.subprotocol
        resp.run_forever(timeout=SESSION_TIMEOUT_SECONDS)
    finally:
        resp.close()
        resp.sock.shutdown()
    assert negotiated in ("v5.channel.k8s.io", "v4.channel.k8s.io")
    (started,) = audit.wait_for(mark, matching(verb="exec", pod="hello", stage="started"))
    assert started["transport"] == f"websocket:{negotiated}"


def test_portforward_echo(api: Any, gateway: Gateway) -> None:
    data = os.urandom(FORWARD_BYTES)
    audit = gateway.audit
    mark = audit.mark()
    pf = portforward(api.connect_get_namespaced_pod_portforward, "data", "default", ports="7000")
    try:
        sock = pf.socket(ECHO_PORT)
        # No half-close exists on this protocol: read until every byte is back, then close.
        echoed = exchange(sock, data, SESSION_TIMEOUT_SECONDS, half_close=False)
        sock.close()
        assert wait_closed(pf)
        assert pf.error(ECHO_PORT) is None
    finally:
        pf.close()
        if wait_closed(pf, 5.0):
            pf.websocket.shutdown()
    assert echoed.nbytes == len(data)
    assert echoed.sha256 == sha256_hex(data)
    (record,) = audit.wait_for(mark, matching(verb="portforward", pod="data", port=ECHO_PORT))
    assert record["user"] == "admin" and record["auth"] == "x509"
    assert record["transport"].startswith("websocket:")
    assert record["bytes_in"] == record["bytes_out"] == len(data)


def test_pod_close_reaches_the_python_client_websocket_v4_as_eof(
    gateway: Gateway, api: Any
) -> None:
    pf = portforward(
        api.connect_get_namespaced_pod_portforward, "data", "default", ports=str(HTTP10_PORT)
    )
    try:
        sock = pf.socket(HTTP10_PORT)
        answer, eof_after = http10_exchange(sock)
        sock.close()
        assert answer == EXPECTED
        assert pf.error(HTTP10_PORT) is None
        print(f"python client v4: EOF {eof_after * 1000:.0f} ms after the answer")
    finally:
        pf.close()
        if wait_closed(pf, 5.0):
            pf.websocket.shutdown()


# Pushed into the never-reading port: several times what the path buffers before it stalls.
STALL_PUSH_BYTES = 32 * 1024 * 1024


def test_a_port_the_pod_never_reads_is_reset_with_an_error_and_the_others_go_on(
    api: Any, gateway: Gateway
) -> None:
    """v4 WebSocket port-forward has no flow control: a port whose reader stalls is reset with
    a message on its error channel, and the session's other port keeps working."""
    pf = portforward(
        api.connect_get_namespaced_pod_portforward,
        "data",
        "default",
        ports=f"{STALL_PORT},{ECHO_PORT}",
    )
    try:
        stalled = pf.socket(STALL_PORT)
        stalled.setblocking(False)
        data = bytes(STALL_PUSH_BYTES)
        sent = 0
        # The reset comes STALLED_STREAM_RESET_SECONDS after the port's reader stopped.
        deadline = time.monotonic() + STALLED_STREAM_RESET_SECONDS + SESSION_TIMEOUT_SECONDS
        # Push until the path stops taking bytes or the error arrives (bounded either way).
        while pf.error(STALL_PORT) is None and time.monotonic() < deadline:
            try:
                sent += stalled.send(data[sent : sent + 256 * 1024])
            except BlockingIOError:
                time.sleep(0.05)
            if sent >= len(data):
                time.sleep(0.05)
        error = pf.error(STALL_PORT)
        assert error is not None, f"no error on the stalled port after {sent >> 20} MiB"
        assert "unread" in error, error
        print(f"stalled port: {sent >> 20} MiB taken, then: {error}")
        # The other port of the same WebSocket still carries data both ways.
        echo = pf.socket(ECHO_PORT)
        payload = os.urandom(64 * 1024)
        echoed = exchange(echo, payload, SESSION_TIMEOUT_SECONDS, half_close=False)
        assert echoed.sha256 == sha256_hex(payload)
        stalled.close()
        echo.close()
    finally:
        pf.close()
        if wait_closed(pf, 5.0):
            pf.websocket.shutdown()
