"""The gateway's stream caps: users with sessions left open cannot take a pod away from a
third user (the per-user-per-pod cap), and a user's streams are counted per pod."""

from __future__ import annotations

from pathlib import Path

from podgate.node.auth import Authenticator, UserInfo
from podgate.node.gateway import (
    DEFAULT_MAX_STREAMS_PER_POD,
    AuditLog,
    Caller,
    Gate,
    GateStream,
    Limits,
)
from podgate.node.kubeapi import PodView
from podgate.node.policy import Policy
from podgate.proto.upgrade import UpgradeRequest

POLICY = """
[[rule]]
users = ["alice", "bob", "carol"]
namespaces = ["*"]
pods = ["*"]
verbs = ["portforward"]
"""
POD = PodView("ns", "p", "uid")
OTHER_POD = PodView("ns", "q", "uid2")
REQUEST = UpgradeRequest("POST", "/api/v1/namespaces/ns/pods/p/portforward", ())


def caller(name: str) -> Caller:
    return Caller(UserInfo(name, (), "token"), "127.0.0.1:1")


def fill(gate: Gate, who: Caller, pod: PodView) -> tuple[list[GateStream], str]:
    """Open sessions until the gate refuses one: (the admitted, the refusal)."""
    held: list[GateStream] = []
    for _ in range(10 * DEFAULT_MAX_STREAMS_PER_POD):
        admitted = gate.admit(who, "portforward", pod, None, REQUEST)
        if isinstance(admitted, str):
            return held, admitted
        held.append(admitted)
    raise AssertionError("the gate never refused")


def test_two_users_holding_sessions_cannot_deny_a_third(tmp_path: Path) -> None:
    gate = Gate(
        Authenticator(None), Policy.loads(POLICY), AuditLog(str(tmp_path / "audit.log")), None
    )
    limits = gate.limits
    try:
        alice, alice_refused = fill(gate, caller("alice"), POD)
        bob, bob_refused = fill(gate, caller("bob"), POD)
        assert len(alice) == len(bob) == limits.max_streams_per_user_per_pod
        assert "on pod ns/p" in alice_refused and "on pod ns/p" in bob_refused
        # Capped per pod: alice may still use another pod.
        elsewhere = gate.admit(caller("alice"), "portforward", OTHER_POD, None, REQUEST)
        assert isinstance(elsewhere, GateStream)
        elsewhere.finish("completed")
        carol = gate.admit(caller("carol"), "portforward", POD, None, REQUEST)
        assert isinstance(carol, GateStream), carol
        carol.finish("completed")
        # Streams that end give their slots back.
        alice.pop().finish("completed")
        again = gate.admit(caller("alice"), "portforward", POD, None, REQUEST)
        assert isinstance(again, GateStream)
        alice.append(again)
    finally:
        for stream in alice + bob:
            stream.finish("completed")
        gate.audit.close()
    assert gate._per_user_pod == {}


def test_the_pod_cap_still_binds_when_the_per_user_cap_is_off(tmp_path: Path) -> None:
    limits = Limits(max_streams_per_pod=3, max_streams_per_user_per_pod=0)
    gate = Gate(
        Authenticator(None),
        Policy.loads(POLICY),
        AuditLog(str(tmp_path / "audit.log")),
        None,
        limits,
    )
    try:
        held, refused = fill(gate, caller("alice"), POD)
        assert len(held) == 3 and refused == "pod ns/p has 3 streams open"
    finally:
        for stream in held:
            stream.finish("completed")
        gate.audit.close()
