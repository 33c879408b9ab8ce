"""The official Python `kubernetes` client (WebSocket only, no fallback) against the demo API.

Exec uses the channel protocol it negotiates (v5 from our server, which enables the stdin close
signal); port-forward uses the v4 channel pairs with their 3-byte port headers
(kubectl-api-surface.md §10, k8s-streaming.md §5.6, §9).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from e2e_support import UpgradeLog, Wire, exchange, sha256_hex
from kubernetes import client
from kubernetes.stream import portforward, stream

from servers import ECHO_PORT, REFUSED_PORT, SINK_PORT, RunningServers

pytestmark = pytest.mark.e2e

# Bound on one exec session and on each port-forward exchange.
SESSION_TIMEOUT_SECONDS = 30.0
# How long cleanup waits for the client's proxy thread to let go of the WebSocket.
CLOSE_WAIT_SECONDS = 5.0
# Bytes written to `cat` through the stdin channel, in frames of STDIN_CHUNK_BYTES.
STDIN_BYTES = 2 * 1024 * 1024 + 3
STDIN_CHUNK_BYTES = 64 * 1024
# Bytes echoed through the Python client's port-forward socket.
FORWARD_BYTES = 8 * 1024 * 1024


@pytest.fixture(scope="module")
def api(demo: RunningServers) -> Iterator[Any]:
    configuration = client.Configuration(host=demo.url)
    with client.ApiClient(configuration) as api_client:
        yield client.CoreV1Api(api_client)


def wait_closed(pf: Any, timeout: float = SESSION_TIMEOUT_SECONDS) -> bool:
    """The client's proxy thread closes the WebSocket once every local socket is closed."""
    deadline = time.monotonic() + timeout
    while pf.connected and time.monotonic() < deadline:
        time.sleep(0.01)
    return not pf.connected


def release_exec(resp: Any) -> None:
    """Close for good: websocket-client skips closing its socket when the server's close frame
    arrived first, and the socket would leak."""
    resp.close()
    resp.sock.shutdown()


def release_forward(pf: Any) -> None:
    pf.close()  # closes the local sockets; the proxy thread then closes the WebSocket
    if wait_closed(pf, CLOSE_WAIT_SECONDS):
        pf.websocket.shutdown()  # as above; only once the proxy thread is done with it


def test_exec_exit_code(api: Any, upgrades: UpgradeLog) -> None:
    upgrades.clear()
    resp = stream(
        api.connect_get_namespaced_pod_exec,
        "demo",
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
        release_exec(resp)
    assert upgrades.wires("exec") == [Wire.WEBSOCKET]
    upgrades.assert_served_cleanly()


def test_exec_stdin_then_close_channel(api: Any, upgrades: UpgradeLog) -> None:
    """Text and binary stdin frames reach `cat`; closing channel 0 (v5) ends its input."""
    text = "text frame: héllo\n"
    data = os.urandom(STDIN_BYTES)
    upgrades.clear()
    resp = stream(
        api.connect_get_namespaced_pod_exec,
        "demo",
        "default",
        command=["cat"],
        stderr=True,
        stdin=True,
        stdout=True,
        tty=False,
        binary=True,
        _preload_content=False,
    )
    received = bytearray()
    try:
        assert resp.subprotocol == "v5.channel.k8s.io"  # close_channel() is a no-op on v4
        resp.write_stdin(text)  # a str goes out as a text frame
        for offset in range(0, len(data), STDIN_CHUNK_BYTES):
            resp.write_stdin(data[offset : offset + STDIN_CHUNK_BYTES])
            # Read as we go so neither side's buffers fill while we only write.
            resp.update(timeout=0)
            received += resp.read_stdout(timeout=0)
        resp.close_channel(0)
        resp.run_forever(timeout=SESSION_TIMEOUT_SECONDS)
        assert not resp.is_open(), "cat did not end: stdin EOF was not delivered"
        received += resp.read_stdout(timeout=0)
        assert resp.returncode == 0
    finally:
        release_exec(resp)
    expected = text.encode() + data
    assert len(received) == len(expected)
    assert sha256_hex(bytes(received)) == sha256_hex(expected)
    assert upgrades.wires("exec") == [Wire.WEBSOCKET]
    upgrades.assert_served_cleanly()


def test_portforward_one_port(api: Any, upgrades: UpgradeLog) -> None:
    data = os.urandom(FORWARD_BYTES)
    upgrades.clear()
    pf = portforward(api.connect_get_namespaced_pod_portforward, "demo", "default", ports="7000")
    try:
        sock = pf.socket(ECHO_PORT)
        # No half-close exists on this protocol: read until every byte is back, then close.
        echoed = exchange(sock, data, SESSION_TIMEOUT_SECONDS, half_close=False)
        sock.close()
        assert wait_closed(pf)
        assert pf.error(ECHO_PORT) is None
    finally:
        release_forward(pf)
    assert echoed.nbytes == len(data)
    assert echoed.sha256 == sha256_hex(data)
    assert upgrades.wires("portforward") == [Wire.WEBSOCKET]
    upgrades.assert_served_cleanly()


def test_portforward_two_ports(api: Any, upgrades: UpgradeLog) -> None:
    """Both channel pairs at once: the echo on 7000 gets exactly its own bytes back while
    7001 (the sink, which answers only after an EOF this protocol cannot send) gets data too
    and sends nothing; a mixed-up channel would show on either side."""
    echo_data = os.urandom(FORWARD_BYTES)
    sink_data = os.urandom(FORWARD_BYTES)
    upgrades.clear()
    pf = portforward(
        api.connect_get_namespaced_pod_portforward, "demo", "default", ports="7000,7001"
    )
    try:
        sink = pf.socket(SINK_PORT)
        sink.setblocking(True)
        sink.sendall(sink_data[: FORWARD_BYTES // 2])
        echoed = exchange(
            pf.socket(ECHO_PORT), echo_data, SESSION_TIMEOUT_SECONDS, half_close=False
        )
        sink.sendall(sink_data[FORWARD_BYTES // 2 :])
        sink.setblocking(False)
        with pytest.raises(BlockingIOError):
            sink.recv(1)
        assert pf.error(ECHO_PORT) is None and pf.error(SINK_PORT) is None
        pf.socket(ECHO_PORT).close()
        sink.close()
        assert wait_closed(pf)
    finally:
        release_forward(pf)
    assert echoed.nbytes == len(echo_data)
    assert echoed.sha256 == sha256_hex(echo_data)
    # Closing the WebSocket ends the sink's input, so it answers after the client has gone:
    # the server has to drop that answer, not fail.
    upgrades.assert_served_cleanly()


def test_portforward_refused_port(api: Any, upgrades: UpgradeLog) -> None:
    # The failed dial is reported on the port's error channel, in the kubelet's wording.
    upgrades.clear()
    pf = portforward(api.connect_get_namespaced_pod_portforward, "demo", "default", ports="7002")
    try:
        sock = pf.socket(REFUSED_PORT)
        sock.settimeout(SESSION_TIMEOUT_SECONDS)
        assert sock.recv(1024) == b""  # the client closes the local socket on error text
        sock.close()
        assert wait_closed(pf)
        error = pf.error(REFUSED_PORT)
    finally:
        release_forward(pf)
    assert error is not None
    assert error.startswith(f"error forwarding port {REFUSED_PORT} to pod demo"), error
    upgrades.assert_served_cleanly()


def test_exec_client_leaves_early(api: Any, upgrades: UpgradeLog) -> None:
    """The client closes while the command still writes: the rest of the output has nowhere to
    go and the server must drop it, let the command finish, and end the session normally."""
    upgrades.clear()
    resp = stream(
        api.connect_get_namespaced_pod_exec,
        "demo",
        "default",
        command=["sh", "-c", "for i in $(seq 100); do echo line $i; sleep 0.01; done"],
        stderr=True,
        stdin=False,
        stdout=True,
        tty=False,
        _preload_content=False,
    )
    try:
        assert resp.readline_stdout(timeout=SESSION_TIMEOUT_SECONDS) == "line 1"
    finally:
        release_exec(resp)
    upgrades.assert_served_cleanly()


def test_portforward_error_names_the_pod_uid(api: Any, upgrades: UpgradeLog) -> None:
    # The kubelet's wording is `error forwarding port <p> to pod <pod>, uid <uid>: <err>`
    # (k8s-streaming.md §3, §5.6); the uid is the one the API reports for the pod.
    uid = api.read_namespaced_pod("demo", "default").metadata.uid
    assert uid
    upgrades.clear()
    pf = portforward(api.connect_get_namespaced_pod_portforward, "demo", "default", ports="7002")
    try:
        sock = pf.socket(REFUSED_PORT)
        sock.settimeout(SESSION_TIMEOUT_SECONDS)
        assert sock.recv(1024) == b""
        sock.close()
        assert wait_closed(pf)
        error = pf.error(REFUSED_PORT)
    finally:
        release_forward(pf)
    assert error is not None
    assert error.startswith(f"error forwarding port {REFUSED_PORT} to pod demo, uid {uid}: "), error
    upgrades.assert_served_cleanly()
