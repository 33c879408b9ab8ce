"""Idle sessions against a gateway started with a small per-user-per-pod cap and a small idle
timeout (`podgate up --max-streams-per-user-per-pod --stream-idle-timeout`), with real kubectl:
two users holding every session they may have on a pod cannot deny a third, and sessions that
carry no data are reaped although kubectl keeps pinging them.
"""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import time
from collections.abc import Iterator

import pytest
from e2e_support import Kubectl, free_port, stop_process
from gateway_support import ECHO_PORT, Gateway, matching, running_gateway

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

# Sessions one user may hold on one pod: one port-forward and one exec each.
CAP = 2
# Above kubectl's ping periods (5 s on SPDY, 10 s through the WebSocket tunnel and for v5
# exec): a session kept alive by pings would never reach it.
IDLE_TIMEOUT_SECONDS = 15.0
# Generous bound on polling for the reaped sessions (the idle timeout plus scheduling slack).
REAP_DEADLINE_SECONDS = IDLE_TIMEOUT_SECONDS + 45.0
POLL_SECONDS = 0.2
# Users holding idle sessions: one on kubectl's WebSocket transports, one on SPDY.
HOLDERS = {
    "idler-ws": (),
    "idler-spdy": (
        ("KUBECTL_PORT_FORWARD_WEBSOCKETS", "false"),
        ("KUBECTL_REMOTE_COMMAND_WEBSOCKETS", "false"),
    ),
}


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    flags = ["--max-streams-per-user-per-pod", str(CAP)]
    flags += ["--stream-idle-timeout", str(IDLE_TIMEOUT_SECONDS)]
    with running_gateway(flags) as running:
        yield running


def user_kubectl(gateway: Gateway, name: str, env: tuple[tuple[str, str], ...] = ()) -> Kubectl:
    token = secrets.token_urlsafe(32)
    gateway.add_token(token, name, ["system:masters"])
    return gateway.kubectl("1.33", gateway.token_kubeconfig(name, token), env)


@contextlib.contextmanager
def idle_exec(kubectl: Kubectl) -> Iterator[subprocess.Popen[bytes]]:
    """`kubectl exec -i data -- cat` whose stdin stays open and silent."""
    proc = subprocess.Popen(
        kubectl.argv(["exec", "-i", "data", "--", "cat"]),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=kubectl.environ(),
    )
    try:
        yield proc
    finally:
        stop_process(proc)


def wait_until_exited(procs: list[subprocess.Popen[bytes]], deadline: float) -> None:
    while any(p.poll() is None for p in procs):
        assert time.monotonic() < deadline, "idle kubectl sessions were not closed"
        time.sleep(POLL_SECONDS)


def test_two_users_with_idle_sessions_cannot_deny_a_third_and_idle_sessions_are_reaped(
    gateway: Gateway,
) -> None:
    mark = gateway.audit.mark()
    holders = {name: user_kubectl(gateway, name, env) for name, env in HOLDERS.items()}
    third = user_kubectl(gateway, "third")
    with contextlib.ExitStack() as stack:
        forwarders = [
            stack.enter_context(k.port_forward("data", free_port(), ECHO_PORT))
            for k in holders.values()
        ]
        execs = [stack.enter_context(idle_exec(k)) for k in holders.values()]
        # Port-forward sessions are audited when they end, an exec also when it starts; a
        # port-forwarder is ready once its session is up.
        for name in holders:
            gateway.audit.wait_for(mark, matching(user=name, verb="exec", stage="started"))
        started = time.monotonic()
        # Each holder is at its cap on this pod: one more is refused...
        for name, kubectl in holders.items():
            refused = kubectl.run(["exec", "data", "--", "true"])
            assert refused.returncode != 0, refused
            assert b"streams open on pod default/data" in refused.stderr, refused.stderr
            gateway.audit.wait_for(mark, matching(user=name, outcome="denied"))
        # ...while a third user gets in.
        answer = third.run(["exec", "data", "--", "echo", "third user"])
        assert answer.returncode == 0, answer.stderr
        assert answer.stdout == b"third user\n"
        # Nothing moves on the held sessions: the gateway closes them, kubectl pings or not.
        procs = [f.proc for f in forwarders] + execs
        wait_until_exited(procs, started + REAP_DEADLINE_SECONDS)
        idle_for = time.monotonic() - started
        for name in holders:
            gateway.audit.wait_for(mark, matching(user=name, stage="finished"), count=CAP)
    print(f"idle sessions closed {idle_for:.1f} s after they started")
    # Their slots are free again.
    for kubectl in holders.values():
        again = kubectl.run(["exec", "data", "--", "echo", "back"])
        assert again.returncode == 0, again.stderr
        assert again.stdout == b"back\n"
