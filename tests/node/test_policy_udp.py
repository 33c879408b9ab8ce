"""UDP in the policy grammar: "53/udp" entries allow UDP flows, plain numbers stay TCP (what
they always meant), a rule without ports allows both, and the messages name the protocol."""

from __future__ import annotations

import pytest

from podgate.node.auth import UserInfo
from podgate.node.policy import Policy, PolicyError, PortRange

POLICY = """\
[[rule]]
users = ["alice"]
namespaces = ["n"]
pods = ["p"]
verbs = ["portforward"]
ports = [8080, "5353/udp", "6000-6002/UDP", "7000/tcp"]

[[rule]]
users = ["bob"]
namespaces = ["n"]
pods = ["p"]
verbs = ["portforward"]
ports = [5353]

[[rule]]
users = ["carol"]
namespaces = ["n"]
pods = ["p"]
verbs = ["portforward"]

[[rule]]
users = ["dan"]
namespaces = ["n"]
pods = ["p"]
verbs = ["portforward"]
ports = ["53/udp"]
"""

ALICE = UserInfo("alice", (), "token")
BOB = UserInfo("bob", (), "token")
CAROL = UserInfo("carol", (), "token")
DAN = UserInfo("dan", (), "token")
TARGET = "pods/p in namespace n"


@pytest.fixture(scope="module")
def policy() -> Policy:
    return Policy.loads(POLICY)


@pytest.mark.parametrize(
    ("user", "port", "protocol", "shown", "rule"),
    [
        (ALICE, 8080, "tcp", "8080", 1),
        (ALICE, 8080, "udp", "8080/udp", None),
        (ALICE, 5353, "udp", "5353/udp", 1),
        (ALICE, 5353, "tcp", "5353", None),
        (ALICE, 6000, "udp", "6000/udp", 1),
        (ALICE, 6002, "udp", "6002/udp", 1),
        (ALICE, 6003, "udp", "6003/udp", None),
        (ALICE, 6001, "tcp", "6001", None),
        (ALICE, 7000, "tcp", "7000", 1),
        (ALICE, 7000, "udp", "7000/udp", None),
        # A plain number is TCP, as it was before UDP existed.
        (BOB, 5353, "tcp", "5353", 2),
        (BOB, 5353, "udp", "5353/udp", None),
        # No ports: every port of either protocol.
        (CAROL, 53, "udp", "53/udp", 3),
        (CAROL, 53, "tcp", "53", 3),
        (DAN, 53, "udp", "53/udp", 4),
        (DAN, 53, "tcp", "53", None),
    ],
)
def test_decisions(
    policy: Policy, user: UserInfo, port: int, protocol: str, shown: str, rule: int | None
) -> None:
    """`rule` allows it (None: denied); `shown` is how the messages name the port."""
    decision = policy.authorize(user, "portforward", "n", "p", port, protocol)
    who = f'user "{user.name}"'
    if rule is None:
        expected = (False, f"port {shown} is not allowed for {who} on {TARGET}")
    else:
        expected = (True, f"rule #{rule} allows {who} to portforward port {shown} of {TARGET}")
    assert (decision.allowed, decision.reason) == expected


def test_tcp_is_the_default(policy: Policy) -> None:
    assert policy.authorize(BOB, "portforward", "n", "p", 5353).allowed
    assert not policy.authorize(DAN, "portforward", "n", "p", 53).allowed


def test_the_upgrade_needs_any_allowed_port_of_either_protocol(policy: Policy) -> None:
    # dan may only forward UDP: the upgrade (no port yet) is still allowed.
    decision = policy.authorize(DAN, "portforward", "n", "p")
    assert (decision.allowed, decision.reason) == (
        True,
        f'rule #4 allows user "dan" to portforward {TARGET}',
    )


def test_parsed_ranges(policy: Policy) -> None:
    assert policy.rules[0].ports == (
        PortRange(8080, 8080, "tcp"),
        PortRange(5353, 5353, "udp"),
        PortRange(6000, 6002, "udp"),
        PortRange(7000, 7000, "tcp"),
    )
    shown = [str(r) for r in policy.rules[0].ports or ()]
    assert shown == ["8080", "5353/udp", "6000-6002/udp", "7000"]


BAD = ['"53/sctp"', '"53/"', '"/udp"', '"udp"', '"53 udp"', '"0/udp"', '"70000/udp"', '"5-3/udp"']


@pytest.mark.parametrize("entry", BAD)
def test_bad_entries_are_refused(entry: str) -> None:
    text = POLICY.replace('ports = ["53/udp"]', f"ports = [{entry}]")
    with pytest.raises(PolicyError, match=r'rule #4: bad port .*optionally with "/udp" or "/tcp"'):
        Policy.loads(text)


def test_unknown_protocol_in_a_request_is_a_bug(policy: Policy) -> None:
    with pytest.raises(ValueError, match="sctp"):
        policy.authorize(ALICE, "portforward", "n", "p", 53, "sctp")
