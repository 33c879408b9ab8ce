"""The gateway's upstream side against containerd, whose streaming server knows only
`portforward.k8s.io`: CriTarget's pooled session offers podgate's UDP extension first,
containerd picks plain port-forward (client order wins, and it has no other), TCP forwarding
works as ever on that session, and a UDP forward fails with "runtime does not support UDP
port-forward" without touching the session.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from containerd_support import Containerd, missing_tools, private_containerd
from e2e_support import free_port

from podgate.node.cri_client import CriClient
from podgate.node.upstream import CriTarget
from podgate.streaming.target import PodRef, TargetError

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="containerd and runc need root"),
]

POD, NAMESPACE = "ctrd-udp", "default"
# Until the echo server in the container accepts connections; one streaming step.
LISTEN_SECONDS = 20.0
STEP_SECONDS = 15.0


@dataclass(frozen=True, slots=True)
class Stack:
    containerd: Containerd
    pod: PodRef
    port: int


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    tools, why = missing_tools()
    if tools is None:
        pytest.skip(why)
    with private_containerd(tools) as ctrd:
        port = free_port()
        pod = ctrd.run_pod(POD, NAMESPACE, ["sh", "-c", f"exec nc -ll -p {port} -e cat"])
        ctrd.wait_running(pod.container_id)
        deadline = time.monotonic() + LISTEN_SECONDS
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                    break
            except OSError:
                assert time.monotonic() < deadline, "the echo server did not start"
                time.sleep(0.05)
        yield Stack(ctrd, PodRef(NAMESPACE, POD, pod.uid, pod.sandbox_id), port)


async def test_udp_is_refused_and_tcp_goes_on(stack: Stack) -> None:
    client = CriClient(str(stack.containerd.socket))
    target = CriTarget(client)
    try:
        async with asyncio.timeout(STEP_SECONDS):
            tcp = await target.open_port(stack.pod, stack.port)
            await tcp.send(b"over containerd")
            await tcp.send_eof()
            echoed = b""
            while chunk := await tcp.receive():
                echoed += chunk
            await tcp.aclose()
            assert echoed == b"over containerd"
            ((session,),) = target.pooled_sessions.values()
            assert (session.protocol, session.supports_udp) == ("portforward.k8s.io", False)

            with pytest.raises(TargetError) as info:
                await target.open_port(stack.pod, stack.port, protocol="udp")
            assert str(info.value) == "runtime does not support UDP port-forward"

            # The same pooled session still forwards TCP.
            again = await target.open_port(stack.pod, stack.port)
            await again.send(b"still")
            assert await again.receive() == b"still"
            await again.aclose()
            assert list(target.pooled_sessions.values()) == [[session]]
    finally:
        await target.aclose()
        await client.close()
