"""Security properties of `podgate up`'s gateway, probed from outside with raw connections.

- Nothing but the gateway faces the network: every listening socket is on loopback.
- The runtime's one-time streaming URLs are not reachable through the gateway.
- CVE-2018-1002105 class: after a refused or failed upgrade, the next request on the same
  connection is answered by the gateway as itself, authenticated on its own.
- One user's concurrent streams are capped (DEFAULT_MAX_STREAMS_PER_USER).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import os
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import pytest
from e2e_support import sha256_hex
from gateway_support import (
    ECHO_PORT,
    SETTLE_SECONDS,
    Gateway,
    RawConnection,
    Response,
    bearer,
    child_pids,
    exec_target,
    listening_sockets,
    matching,
    spdy_headers,
    websocket_headers,
)

from podgate.cri import api_pb2 as pb
from podgate.cri import api_pb2_grpc as pb_grpc
from podgate.node.gateway import DEFAULT_MAX_STREAMS_PER_USER
from podgate.streaming.client import PortForwardSession, endpoint_from_url

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

# Bound on each CRI call.
CRI_TIMEOUT_SECONDS = 10.0
# Bytes echoed through a port-forward session opened directly on the runtime.
ECHO_BYTES = 64 * 1024
# How long a capped stream's command runs; closing our side does not end it sooner.
CAP_SLEEP_SECONDS = 5
# After the capped streams end, how long the gateway may take to count them down.
CAP_RELEASE_SECONDS = 30.0
# Poll interval while waiting for a slot to free.
CAP_POLL_SECONDS = 0.5

EXECER_POLICY = """
[[rule]]
groups = ["system:masters"]
namespaces = ["*"]
pods = ["*"]
verbs = ["*"]

[[rule]]
users = ["execer"]
namespaces = ["default"]
pods = ["hello"]
verbs = ["get", "exec"]
"""

WS_EXEC = websocket_headers("v5.channel.k8s.io")
WS_TUNNEL = websocket_headers("SPDY/3.1+portforward.k8s.io")
SPDY_PF = spdy_headers(["portforward.k8s.io"])


@pytest.fixture(scope="module")
def admin_token(gateway: Gateway) -> str:
    return gateway.admin_token()


@pytest.fixture(scope="module")
def viewer_token(gateway: Gateway) -> str:
    """A user the first start's policy (system:masters only) allows nothing."""
    token = secrets.token_urlsafe(32)
    gateway.add_token(token, "viewer", ["viewers"])
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:  # the token file is re-read on change
        with gateway.connect() as conn:
            response = conn.exchange("GET", "/api", bearer(token))
        assert response is not None
        if response.status == 200:
            return token
        assert time.monotonic() < deadline, f"new token not accepted: {response.status}"
        time.sleep(CAP_POLL_SECONDS / 10)


# --- (a) only loopback listens ------------------------------------------------------------


def local_addresses() -> set[str]:
    """This host's own IPv4 addresses (the kernel's LOCAL routes)."""
    found = set()
    lines = Path("/proc/net/fib_trie").read_text().splitlines()
    for previous, line in itertools.pairwise(lines):
        if line.strip() == "/32 host LOCAL":
            found.add(previous.split()[-1])
    return found


def test_every_listener_is_loopback(gateway: Gateway) -> None:
    pids = [gateway.proc.pid, *child_pids(gateway.proc.pid)]
    listeners = [entry for pid in pids for entry in listening_sockets(pid)]
    streaming = urlsplit(gateway.streaming_url())
    assert streaming.scheme == "http" and streaming.hostname == "127.0.0.1", streaming
    # Both servers are found, so an empty or partial scan cannot pass.
    assert {gateway.port, streaming.port} <= {entry.port for entry in listeners}, listeners
    for entry in listeners:
        assert ipaddress.ip_address(entry.address).is_loopback, entry
    # And from the host's other addresses, neither port answers.
    for address in local_addresses() - {"127.0.0.1"}:
        if ipaddress.ip_address(address).is_loopback:
            continue
        for port in (gateway.port, streaming.port):
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((address, port), timeout=CRI_TIMEOUT_SECONDS).close()


# --- (b) the runtime's streaming URLs are not reachable through the gateway ---------------


def portforward_url(gateway: Gateway, pod: str, port: int) -> str:
    """A fresh one-time URL for `pod`, straight from the runtime over CRI."""
    with grpc.insecure_channel(f"unix://{gateway.cri_socket}") as channel:
        cri = pb_grpc.RuntimeServiceStub(channel)
        sandboxes = cri.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=CRI_TIMEOUT_SECONDS)
        (sandbox,) = [s for s in sandboxes.items if s.metadata.name == pod]
        request = pb.PortForwardRequest(pod_sandbox_id=sandbox.id, port=[port])
        return cri.PortForward(request, timeout=CRI_TIMEOUT_SECONDS).url


async def echo_directly(url: str, data: bytes) -> bytes:
    """Use the URL on the runtime itself, as the gateway would: it must still be unused."""
    endpoint, path = endpoint_from_url(url)
    session = await PortForwardSession.connect(endpoint, path)
    try:
        forwarded = await session.open(ECHO_PORT)
        await forwarded.data.send(data)
        await forwarded.data.send_eof()
        received = bytearray()
        while chunk := await forwarded.data.receive():
            received += chunk
        return bytes(received)
    finally:
        await session.aclose()


def test_streaming_urls_are_not_proxied(gateway: Gateway, admin_token: str) -> None:
    """With admin rights, a real one-time URL's path sent to the gateway finds nothing (404):
    the gateway only serves the Kubernetes API paths and opens runtime URLs itself. The token
    is left unused, which the runtime then confirms by serving it."""
    url = portforward_url(gateway, "data", ECHO_PORT)
    token_path = urlsplit(url).path
    assert token_path.startswith("/portforward/")
    token = token_path.rsplit("/", 1)[1]
    pod_path = "/api/v1/namespaces/default/pods/data/portforward"
    targets = [
        token_path,
        f"{pod_path}/{token}",
        f"{pod_path}/../../../../../../portforward/{token}",
        f"/api/v1/namespaces/default/pods/data%2Fportforward%2F{token}",
        url,  # absolute form, as sent to a proxy
    ]
    credentials = bearer(admin_token)
    with gateway.connect() as conn:
        for target in targets:
            for method, upgrade in (("GET", WS_TUNNEL), ("POST", SPDY_PF)):
                response = conn.exchange(method, target, upgrade + credentials)
                assert response is not None, f"{method} {target}: connection closed"
                assert response.status == 404, (method, target, response)
                # The gateway's own Status, not the streaming server's plain-text 404.
                assert response.json()["kind"] == "Status", response
    data = os.urandom(ECHO_BYTES)
    echoed = asyncio.run(echo_directly(url, data))
    assert sha256_hex(echoed) == sha256_hex(data)


# --- (c) one connection, two requests: each stands on its own -----------------------------


def assert_gateway_status(response: Response | None, status: int) -> None:
    assert isinstance(response, Response), response
    assert response.status == status, response
    body = response.json()
    assert (body["kind"], body["code"]) == ("Status", status), body


def no_stream_started(gateway: Gateway, mark: int) -> None:
    started = [e for e in gateway.audit.since(mark) if e.get("stage") == "started"]
    assert started == [], started


def test_denied_upgrade_then_anonymous_requests(gateway: Gateway, viewer_token: str) -> None:
    """CVE-2018-1002105's shape: a refused upgrade must not leave the connection in a state
    where later bytes reach the backend with the first request's credentials."""
    mark = gateway.audit.mark()
    target = exec_target("hello", ["id"])
    with gateway.connect() as conn:
        assert_gateway_status(conn.exchange("GET", target, WS_EXEC + bearer(viewer_token)), 403)
        # Same connection, no credentials: the gateway answers as itself.
        assert_gateway_status(conn.exchange("GET", target, WS_EXEC), 401)
        assert_gateway_status(conn.exchange("GET", "/api/v1/namespaces/default/pods"), 401)
        assert_gateway_status(
            conn.exchange("POST", target, spdy_headers(["v4.channel.k8s.io"])), 401
        )
        address = conn.local_address
    entries = gateway.audit.wait_for(mark, matching(address=address), count=4)
    assert [(e["user"], e["outcome"]) for e in entries] == [
        ("viewer", "denied"),
        (None, "denied"),
        (None, "denied"),
        (None, "denied"),
    ]
    no_stream_started(gateway, mark)


@pytest.mark.parametrize(
    ("target", "status"),
    [
        pytest.param(exec_target("nope", ["id"]), 404, id="no-such-pod"),
        pytest.param(exec_target("hello", ["id"]) + "&container=nope", 400, id="no-such-container"),
    ],
)
def test_failed_upgrade_does_not_lend_its_credentials(
    gateway: Gateway, admin_token: str, viewer_token: str, target: str, status: int
) -> None:
    """The admin's upgrade fails before 101; the next request on the same connection carries
    no credentials (or the viewer's) and must be judged as exactly that."""
    mark = gateway.audit.mark()
    good = exec_target("hello", ["id"])
    with gateway.connect() as conn:
        assert_gateway_status(conn.exchange("GET", target, WS_EXEC + bearer(admin_token)), status)
        assert_gateway_status(conn.exchange("GET", good, WS_EXEC), 401)
        assert_gateway_status(conn.exchange("GET", good, WS_EXEC + bearer(viewer_token)), 403)
    no_stream_started(gateway, mark)


def test_pipelined_requests_after_a_refused_upgrade(gateway: Gateway, viewer_token: str) -> None:
    """Both requests in one write, as an attacker would send them: the second is still parsed
    as HTTP and authenticated by itself, not handed on as the first one's stream data."""
    mark = gateway.audit.mark()
    target = exec_target("hello", ["id"])
    with gateway.connect() as conn:
        first = conn.request("GET", target, WS_EXEC + bearer(viewer_token))
        second = conn.request("GET", target, WS_EXEC)
        conn.send(first + second)
        assert_gateway_status(conn.read_response(), 403)
        assert_gateway_status(conn.read_response(), 401)
    no_stream_started(gateway, mark)


@pytest.fixture(scope="module")
def execer_token(gateway: Gateway) -> str:
    """A user who may exec in pod `hello` and nowhere else."""
    token = secrets.token_urlsafe(32)
    gateway.add_token(token, "execer", ["exec-team"])
    gateway.write_policy(EXECER_POLICY)
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:  # both files are re-read on change
        with gateway.connect() as conn:
            response = conn.exchange("GET", "/api/v1/namespaces/default/pods/hello", bearer(token))
        assert response is not None
        if response.status == 200:
            return token
        assert time.monotonic() < deadline, f"policy not reloaded: {response.status}"
        time.sleep(CAP_POLL_SECONDS / 10)


@pytest.mark.parametrize(
    ("name", "upgraded"),
    [
        ("hello", True),  # control: the user's own pod
        ("%68ello", True),  # the same name, percent-encoded
        ("%64ata", False),
        ("%2564ata", False),
        ("data%00", False),
        ("data%2F", False),
        ("data/", False),
        ("hello%2F..%2Fdata", False),
    ],
)
def test_encoded_pod_names_do_not_escape_policy(
    gateway: Gateway, execer_token: str, name: str, upgraded: bool
) -> None:
    """However the other pod's name is spelt, a user who may exec only in `hello` gets no
    upgrade into it; spellings of `hello` itself still work."""
    mark = gateway.audit.mark()
    with gateway.connect() as conn:
        response = conn.exchange("GET", exec_target(name, ["id"]), WS_EXEC + bearer(execer_token))
    assert response is not None
    if upgraded:
        assert response.status == 101, response
        (started,) = gateway.audit.wait_for(mark, matching(user="execer", stage="started"))
        assert started["pod"] == "hello"
    else:
        assert response.status in (403, 404), response
        no_stream_started(gateway, mark)


# --- (d) the per-user stream cap ----------------------------------------------------------


@contextlib.contextmanager
def open_connections(gateway: Gateway, count: int) -> Iterator[list[RawConnection]]:
    conns: list[RawConnection] = []
    try:
        for _ in range(count):
            conns.append(gateway.connect())
        yield conns
    finally:
        for conn in conns:
            conn.close()


def test_per_user_stream_cap(gateway: Gateway, admin_token: str) -> None:
    cap = DEFAULT_MAX_STREAMS_PER_USER
    token = secrets.token_urlsafe(32)
    gateway.add_token(token, "busy", ["system:masters"])
    sleeper = exec_target("hello", ["sleep", str(CAP_SLEEP_SECONDS)])
    # Spread over two pods: one user's streams on one pod have a lower cap of their own.
    elsewhere = exec_target("shell", ["sleep", str(CAP_SLEEP_SECONDS)])
    credentials = WS_EXEC + bearer(token)
    mark = gateway.audit.mark()
    with open_connections(gateway, cap + 1) as conns:
        for i, conn in enumerate(conns[:cap]):
            response = conn.exchange("GET", (sleeper, elsewhere)[i % 2], credentials)
            assert response is not None and response.status == 101, response
        refused = conns[cap].exchange("GET", sleeper, credentials)
        assert_gateway_status(refused, 429)
        assert refused is not None
        assert refused.json()["reason"] == "TooManyRequests"
        assert '"busy"' in refused.json()["message"] or "'busy'" in refused.json()["message"]
        # The cap is per user: another user is not held up by it.
        with gateway.connect() as other:
            response = other.exchange("GET", sleeper, WS_EXEC + bearer(admin_token))
            assert response is not None and response.status == 101, response
    (denial,) = gateway.audit.wait_for(mark, matching(user="busy", outcome="denied"))
    assert (denial["verb"], denial["pod"], denial["auth"]) == ("exec", "hello", "token")
    started = gateway.audit.since(mark)
    assert (
        len([e for e in started if e.get("user") == "busy" and e.get("stage") == "started"]) == cap
    )
    # Once the commands end, the slots are free again.
    deadline = time.monotonic() + CAP_RELEASE_SECONDS
    while True:
        with gateway.connect() as conn:
            response = conn.exchange("GET", exec_target("hello", ["true"]), credentials)
        assert response is not None
        if response.status == 101:
            break
        assert response.status == 429, response
        assert time.monotonic() < deadline, "stream slots not released after the commands ended"
        time.sleep(CAP_POLL_SECONDS)
