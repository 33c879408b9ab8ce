"""Many concurrent forwards to one pod through the gateway: four users, one kubectl 1.33
port-forward each, hundreds of connections through each held open at once, every one's echo
checked by sha256 (issue: "performance"; `make bench` runs 4 x 1,000).

Each user carries more forwards than one upstream session to the runtime holds (podgate's
streaming server accepts 512 streams, 256 pairs, per session), so the gateway must open further
upstream sessions to the pod; and more than a port-forward session carries by default, so the
gateway's --max-forwards-per-session is raised for them.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from e2e_support import free_port
from gateway_support import ECHO_PORT, Gateway, running_gateway

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.manyforwards import hold_connections, policy, raise_nofile, wait_for_echo

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

USERS = 4
# Past one upstream session's 256 pairs and the default 224 forwards per client session.
PER_USER = 300
HOLD_TIMEOUT_SECONDS = 300.0


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    if os.geteuid() != 0:
        pytest.skip("podgate up runs pods in Linux namespaces: needs root")
    raise_nofile()
    with running_gateway(["--max-forwards-per-session", str(PER_USER)]) as running:
        yield running


def test_four_users_hold_hundreds_of_forwards_each_to_one_pod(gateway: Gateway) -> None:
    names = [f"forwarder{i}" for i in range(USERS)]
    kubeconfigs = []
    for name in names:
        token = f"{name}-token-{os.urandom(8).hex()}"
        gateway.add_token(token, name)
        kubeconfigs.append(gateway.token_kubeconfig(name, token))
    gateway.write_policy(policy(names, "data", ECHO_PORT))
    with ExitStack() as stack:
        ports = [free_port() for _ in names]
        forwarders = [
            stack.enter_context(
                gateway.kubectl("1.33", kubeconfig).port_forward("data", port, ECHO_PORT)
            )
            for kubeconfig, port in zip(kubeconfigs, ports, strict=True)
        ]
        wait_for_echo(ports[0])
        held = asyncio.run(hold_connections(ports, PER_USER, HOLD_TIMEOUT_SECONDS))
        for forwarder in forwarders:
            assert forwarder.proc.poll() is None, forwarder.stderr
    assert [h.failures[:3] for h in held] == [[]] * USERS
    assert [h.ok for h in held] == [PER_USER] * USERS
    print(f"{USERS} x {PER_USER} forwards held and checked in {held[0].seconds:.1f} s")
