"""UDP port-forward through `podgate up`'s gateway: client -> gateway (TLS, token, policy,
audit) -> the runtime's streaming server -> the netns backend -> a UDP echo bound to the
pod's 127.0.0.1.

The policy allows "5353/udp" to one user only; another user, allowed TCP 5353, has the UDP
stream refused on that stream's error stream (and the first user's TCP stream is refused the
same way). The audit records name the protocol, the port and the bytes.
"""

from __future__ import annotations

import asyncio
import secrets
import ssl
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from gateway_support import SETTLE_SECONDS, Gateway, bearer, matching

from podgate.cri import api_pb2 as pb
from podgate.cri import api_pb2_grpc as pb_grpc
from podgate.streaming.client import Endpoint, PortForwardSession, pod_path
from udp_support import DATAGRAMS, UDP_ECHO_SERVER, exchange_framed

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

POD = "udp-echo"
NAMESPACE = "default"
UDP_PORT = 5353
# Bound on one CRI call, on the echo server coming up, and on one streaming step.
CRI_TIMEOUT_SECONDS = 60.0
START_SECONDS = 15.0
STEP_SECONDS = 15.0
POLL_SECONDS = 0.05

POLICY = f"""
[[rule]]
groups = ["system:masters"]
namespaces = ["*"]
pods = ["*"]
verbs = ["*"]

[[rule]]
users = ["udp-user", "tcp-user"]
namespaces = ["{NAMESPACE}"]
pods = ["{POD}"]
verbs = ["get"]

[[rule]]
users = ["udp-user"]
namespaces = ["{NAMESPACE}"]
pods = ["{POD}"]
verbs = ["portforward"]
ports = ["{UDP_PORT}/udp"]

[[rule]]
users = ["tcp-user"]
namespaces = ["{NAMESPACE}"]
pods = ["{POD}"]
verbs = ["portforward"]
ports = [{UDP_PORT}]
"""


@dataclass(frozen=True, slots=True)
class Users:
    udp_token: str
    tcp_token: str


@pytest.fixture(scope="module")
def udp_pod(gateway: Gateway) -> Iterator[str]:
    """A pod made through the gateway's CRI socket, running a UDP echo on 127.0.0.1:5353."""
    with grpc.insecure_channel(f"unix://{gateway.cri_socket}") as channel:
        rt = pb_grpc.RuntimeServiceStub(channel)
        config = pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(
                name=POD, namespace=NAMESPACE, uid=uuid.uuid4().hex, attempt=0
            ),
            hostname=POD,
        )
        pod_id = rt.RunPodSandbox(
            pb.RunPodSandboxRequest(config=config), timeout=CRI_TIMEOUT_SECONDS
        ).pod_sandbox_id
        try:
            container = pb.ContainerConfig(
                metadata=pb.ContainerMetadata(name="echo"),
                command=[sys.executable, "-c", UDP_ECHO_SERVER, "127.0.0.1", str(UDP_PORT)],
            )
            container_id = rt.CreateContainer(
                pb.CreateContainerRequest(
                    pod_sandbox_id=pod_id, config=container, sandbox_config=config
                ),
                timeout=CRI_TIMEOUT_SECONDS,
            ).container_id
            rt.StartContainer(
                pb.StartContainerRequest(container_id=container_id), timeout=CRI_TIMEOUT_SECONDS
            )
            status = rt.ContainerStatus(
                pb.ContainerStatusRequest(container_id=container_id), timeout=CRI_TIMEOUT_SECONDS
            ).status
            log = Path(status.log_path)
            deadline = time.monotonic() + START_SECONDS
            while not (log.exists() and b"listening" in log.read_bytes()):
                assert time.monotonic() < deadline, "the UDP echo did not start"
                time.sleep(POLL_SECONDS)
            yield pod_id
        finally:
            rt.RemovePodSandbox(
                pb.RemovePodSandboxRequest(pod_sandbox_id=pod_id), timeout=CRI_TIMEOUT_SECONDS
            )


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
        time.sleep(POLL_SECONDS)


@pytest.fixture(scope="module")
def users(gateway: Gateway, udp_pod: str) -> Users:
    udp_token, tcp_token = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    gateway.add_token(udp_token, "udp-user")
    gateway.add_token(tcp_token, "tcp-user")
    gateway.write_policy(POLICY)
    for token in (udp_token, tcp_token):
        wait_status(gateway, token, f"/api/v1/namespaces/{NAMESPACE}/pods/{POD}", 200)
    return Users(udp_token, tcp_token)


def endpoint(gateway: Gateway, token: str) -> Endpoint:
    context = ssl.create_default_context(cafile=str(gateway.ca_cert))
    return Endpoint(
        "127.0.0.1",
        gateway.port,
        context,
        server_hostname="127.0.0.1",
        headers=(("Authorization", f"Bearer {token}"),),
    )


async def connect(gateway: Gateway, token: str) -> PortForwardSession:
    return await asyncio.wait_for(
        PortForwardSession.connect(
            endpoint(gateway, token), pod_path(NAMESPACE, POD, "portforward"), udp=True
        ),
        STEP_SECONDS,
    )


async def test_allowed_user_gets_every_reply_and_the_audit_says_udp(
    gateway: Gateway, users: Users
) -> None:
    audit = gateway.audit
    mark = audit.mark()
    session = await connect(gateway, users.udp_token)
    try:
        assert session.supports_udp
        forwarded = await session.open(UDP_PORT, "udp")
        tally = await exchange_framed(forwarded.data, DATAGRAMS)
        assert (tally.sent, tally.matched, tally.unmatched) == (DATAGRAMS, DATAGRAMS, [])
        await forwarded.data.send_eof()
        async with asyncio.timeout(STEP_SECONDS):
            assert await forwarded.data.receive() == b""
            assert await forwarded.error() == ""
    finally:
        await session.aclose()
    (record,) = await asyncio.to_thread(
        audit.wait_for, mark, matching(verb="portforward", port=UDP_PORT, protocol="udp")
    )
    # Each datagram is 2 bytes of length and its payload on the stream, both ways.
    framed = tally.payload_bytes + 2 * DATAGRAMS
    assert (record["user"], record["auth"], record["pod"]) == ("udp-user", "token", POD)
    assert (record["outcome"], record["reason"]) == ("allowed", "")
    assert (record["bytes_in"], record["bytes_out"]) == (framed, framed)
    assert record["transport"] == "spdy:udp.portforward.podgate.io"


async def test_another_users_udp_stream_is_refused_on_that_stream(
    gateway: Gateway, users: Users
) -> None:
    audit = gateway.audit
    mark = audit.mark()
    target = f"pods/{POD} in namespace {NAMESPACE}"
    # tcp-user may forward TCP 5353 (the upgrade is allowed), not UDP.
    session = await connect(gateway, users.tcp_token)
    try:
        async with asyncio.timeout(STEP_SECONDS):
            refused = await session.open(UDP_PORT, "udp")
            text = await refused.error()
            assert text == f'port {UDP_PORT}/udp is not allowed for user "tcp-user" on {target}'
    finally:
        await session.aclose()
    # ...and udp-user may not forward TCP 5353: the policy keeps the protocols apart.
    session = await connect(gateway, users.udp_token)
    try:
        async with asyncio.timeout(STEP_SECONDS):
            refused = await session.open(UDP_PORT)
            text = await refused.error()
            assert text == f'port {UDP_PORT} is not allowed for user "udp-user" on {target}'
    finally:
        await session.aclose()
    denials = await asyncio.to_thread(
        audit.wait_for, mark, matching(verb="portforward", outcome="denied"), count=2
    )
    assert sorted((d["user"], d["port"], d["protocol"]) for d in denials) == [
        ("tcp-user", UDP_PORT, "udp"),
        ("udp-user", UDP_PORT, "tcp"),
    ]
    assert all(d["bytes_in"] == d["bytes_out"] == 0 for d in denials)
