"""kubectl port-forward against the demo API, for each kubectl profile.

Remote port 7001 is a sink that answers, after the client's EOF, with the sha256 hex of what it
read; 7000 echoes. Every expected digest is computed here from the bytes sent.
"""

from __future__ import annotations

import os
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from e2e_support import (
    Kubectl,
    Profile,
    UpgradeLog,
    exchange_tcp,
    free_port,
    profile_named,
    profile_params,
    sha256_hex,
)

from servers import ECHO_PORT, REFUSED_PORT, SINK_PORT, RunningServers

pytestmark = pytest.mark.e2e

# Simultaneous local connections through one kubectl, and what each sends to the sink.
SINK_CONNECTIONS = 4
SINK_BYTES = 64 * 1024 * 1024
# One connection through the echo port, checked byte for byte.
ECHO_BYTES = 256 * 1024 * 1024
# Upper bounds for the transfers (they take a few seconds on loopback).
SINK_TIMEOUT_SECONDS = 120.0
ECHO_TIMEOUT_SECONDS = 180.0
# A port-forward that hit a fatal error exits on its own within this.
EXIT_TIMEOUT_SECONDS = 15.0


@pytest.fixture(params=profile_params())
def profile(request: pytest.FixtureRequest) -> Profile:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def kubectl(profile: Profile, demo: RunningServers, tmp_path: Path) -> Kubectl:
    return Kubectl.for_profile(profile, demo.kubeconfig, tmp_path)


def test_parallel_connections_to_sink(
    kubectl: Kubectl, profile: Profile, upgrades: UpgradeLog
) -> None:
    payloads = [os.urandom(SINK_BYTES) for _ in range(SINK_CONNECTIONS)]
    local = free_port()
    upgrades.clear()
    with kubectl.port_forward("demo", local, SINK_PORT) as forwarder:
        with ThreadPoolExecutor(SINK_CONNECTIONS) as pool:
            answers = list(
                pool.map(lambda data: exchange_tcp(local, data, SINK_TIMEOUT_SECONDS), payloads)
            )
        assert forwarder.proc.poll() is None, forwarder.stderr
    assert forwarder.stdout.count(f"Handling connection for {local}\n") == SINK_CONNECTIONS
    for data, answer in zip(payloads, answers, strict=True):
        assert answer.head.decode() == sha256_hex(data)
        assert answer.nbytes == 64
    # All connections share the one upgraded connection kubectl opened at startup.
    assert upgrades.wires("portforward") == [profile.portforward_wire]
    assert "error" not in forwarder.stderr.lower(), forwarder.stderr
    upgrades.assert_served_cleanly()


def test_echo_256_mib(kubectl: Kubectl, profile: Profile, upgrades: UpgradeLog) -> None:
    data = os.urandom(ECHO_BYTES)
    local = free_port()
    upgrades.clear()
    with kubectl.port_forward("demo", local, ECHO_PORT) as forwarder:
        echoed = exchange_tcp(local, data, ECHO_TIMEOUT_SECONDS)
        assert forwarder.proc.poll() is None, forwarder.stderr
    assert echoed.nbytes == len(data)
    assert echoed.sha256 == sha256_hex(data)
    assert upgrades.wires("portforward") == [profile.portforward_wire]
    upgrades.assert_served_cleanly()


def test_pending_pod_is_refused(demo: RunningServers, tmp_path: Path, upgrades: UpgradeLog) -> None:
    # kubectl checks the phase itself (kubectl-api-surface.md §8) and never upgrades.
    kubectl = Kubectl.for_profile(profile_named("1.33"), demo.kubeconfig, tmp_path)
    upgrades.clear()
    result = kubectl.run(["port-forward", "pod/pending", f"{free_port()}:{ECHO_PORT}"])
    assert result.returncode == 1
    assert (
        b"error: unable to forward port because pod is not running. Current status=Pending"
        in result.stderr
    )
    assert upgrades.wires("portforward") == []


def test_refused_remote_port(demo: RunningServers, tmp_path: Path, upgrades: UpgradeLog) -> None:
    """The server reports the refused dial on the error stream; kubectl treats that as fatal.

    Upstream kubectl (all versions, k8s-streaming.md §3) logs the error, drops the connection
    to the pod and exits 1 — so one refused connection ends the whole port-forward.
    """
    kubectl = Kubectl.for_profile(profile_named("1.33"), demo.kubeconfig, tmp_path)
    local = free_port()
    upgrades.clear()
    with kubectl.port_forward("demo", local, REFUSED_PORT) as forwarder:
        with socket.create_connection(("127.0.0.1", local), timeout=EXIT_TIMEOUT_SECONDS) as s:
            assert s.recv(1024) == b""  # kubectl closes the local connection (FIN)
        assert forwarder.wait_exit(EXIT_TIMEOUT_SECONDS) == 1
    stderr = forwarder.stderr
    assert f"an error occurred forwarding {local} -> {REFUSED_PORT}" in stderr, stderr
    # The text is the server's, in the kubelet's wording (k8s-streaming.md §3).
    assert f"error forwarding port {REFUSED_PORT} to pod demo" in stderr, stderr
    assert "error: lost connection to pod" in stderr, stderr
    assert upgrades.wires("portforward") == [profile_named("1.33").portforward_wire]
    upgrades.assert_served_cleanly()


def test_killed_mid_transfer(kubectl: Kubectl, upgrades: UpgradeLog) -> None:
    """kubectl dies (as by ^C) while bytes flow both ways: the server ends the session and
    its connection to the pod without an error."""
    local = free_port()
    upgrades.clear()
    with (
        kubectl.port_forward("demo", local, ECHO_PORT) as forwarder,
        socket.create_connection(("127.0.0.1", local), timeout=SINK_TIMEOUT_SECONDS) as s,
    ):
        s.sendall(os.urandom(1024 * 1024))
        assert s.recv(1024)  # the echo is flowing
        forwarder.proc.kill()
        forwarder.wait_exit(EXIT_TIMEOUT_SECONDS)
    upgrades.assert_served_cleanly()
