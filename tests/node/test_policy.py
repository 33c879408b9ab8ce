"""The authorization policy: allow/deny tables for every verb and port ranges, the messages,
invalid files, reloading, and properties for users no rule names."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podgate.node.auth import UserInfo
from podgate.node.policy import Decision, Policy, PolicyError, Verb

POLICY = """\
[[rule]]
users = ["alice"]
namespaces = ["default"]
pods = ["web-*"]
verbs = ["get", "log", "exec"]

[[rule]]
groups = ["devs"]
namespaces = ["dev-*"]
pods = ["*"]
verbs = ["*"]

[[rule]]
users = ["alice"]
namespaces = ["default"]
pods = ["web-*"]
verbs = ["portforward"]
ports = [8080, "9000-9010"]

[[rule]]
groups = ["viewers"]
namespaces = ["*"]
pods = ["*"]
verbs = ["list", "get"]

[[rule]]
users = ["carol"]
namespaces = ["default"]
pods = ["db-0"]
verbs = ["attach", "portforward"]
"""

ALICE = UserInfo("alice", (), "x509")
BOB = UserInfo("bob", ("devs",), "token")
CAROL = UserInfo("carol", ("system:masters",), "x509")
DAN = UserInfo("dan", ("viewers",), "token")
ROOT = UserInfo("admin", ("system:masters",), "x509")


def bump_mtime(path: Path, step_ns: int = 1_000_000_000) -> None:
    """Move the mtime on explicitly: coarse filesystem clocks can leave it unchanged."""
    st_ = path.stat()
    os.utime(path, ns=(st_.st_atime_ns, st_.st_mtime_ns + step_ns))


@pytest.fixture(scope="module")
def policy() -> Policy:
    return Policy.loads(POLICY)


@pytest.mark.parametrize(
    ("user", "verb", "namespace", "pod", "port", "allowed", "reason"),
    [
        # alice: get/log/exec on web-* in default (rule 1), port-forward to some ports (rule 3).
        (ALICE, "get", "default", "web-1", None, True,
         'rule #1 allows user "alice" to get pods/web-1 in namespace default'),
        (ALICE, "log", "default", "web-1", None, True,
         'rule #1 allows user "alice" to log pods/web-1 in namespace default'),
        (ALICE, "exec", "default", "web-abc", None, True,
         'rule #1 allows user "alice" to exec pods/web-abc in namespace default'),
        (ALICE, "attach", "default", "web-1", None, False,
         'user "alice" may not attach pods/web-1 in namespace default'),
        (ALICE, "exec", "default", "db-0", None, False,
         'user "alice" may not exec pods/db-0 in namespace default'),
        (ALICE, "exec", "default", "web", None, False,
         'user "alice" may not exec pods/web in namespace default'),
        (ALICE, "exec", "default", "WEB-1", None, False,
         'user "alice" may not exec pods/WEB-1 in namespace default'),
        (ALICE, "exec", "prod", "web-1", None, False,
         'user "alice" may not exec pods/web-1 in namespace prod'),
        (ALICE, "list", "default", "*", None, False,
         'user "alice" may not list pods in namespace default'),
        (ALICE, "portforward", "default", "web-1", None, True,
         'rule #3 allows user "alice" to portforward pods/web-1 in namespace default'),
        (ALICE, "portforward", "default", "web-1", 8080, True,
         'rule #3 allows user "alice" to portforward port 8080 of pods/web-1 in namespace default'),
        (ALICE, "portforward", "default", "web-1", 9000, True,
         'rule #3 allows user "alice" to portforward port 9000 of pods/web-1 in namespace default'),
        (ALICE, "portforward", "default", "web-1", 9005, True,
         'rule #3 allows user "alice" to portforward port 9005 of pods/web-1 in namespace default'),
        (ALICE, "portforward", "default", "web-1", 9010, True,
         'rule #3 allows user "alice" to portforward port 9010 of pods/web-1 in namespace default'),
        (ALICE, "portforward", "default", "web-1", 22, False,
         'port 22 is not allowed for user "alice" on pods/web-1 in namespace default'),
        (ALICE, "portforward", "default", "web-1", 8081, False,
         'port 8081 is not allowed for user "alice" on pods/web-1 in namespace default'),
        (ALICE, "portforward", "default", "web-1", 8999, False,
         'port 8999 is not allowed for user "alice" on pods/web-1 in namespace default'),
        (ALICE, "portforward", "default", "web-1", 9011, False,
         'port 9011 is not allowed for user "alice" on pods/web-1 in namespace default'),
        (ALICE, "portforward", "default", "db-0", None, False,
         'user "alice" may not portforward pods/db-0 in namespace default'),
        (ALICE, "portforward", "default", "db-0", 8080, False,
         'user "alice" may not portforward pods/db-0 in namespace default'),
        # bob, by group devs: everything in dev-* namespaces (rule 2), any port.
        (BOB, "exec", "dev-x", "anything", None, True,
         'rule #2 allows user "bob" to exec pods/anything in namespace dev-x'),
        (BOB, "attach", "dev-x", "a", None, True,
         'rule #2 allows user "bob" to attach pods/a in namespace dev-x'),
        (BOB, "list", "dev-y", "*", None, True,
         'rule #2 allows user "bob" to list pods in namespace dev-y'),
        (BOB, "portforward", "dev-x", "a", 1, True,
         'rule #2 allows user "bob" to portforward port 1 of pods/a in namespace dev-x'),
        (BOB, "portforward", "dev-x", "a", 65535, True,
         'rule #2 allows user "bob" to portforward port 65535 of pods/a in namespace dev-x'),
        (BOB, "exec", "default", "web-1", None, False,
         'user "bob" may not exec pods/web-1 in namespace default'),
        (BOB, "get", "dev", "a", None, False,
         'user "bob" may not get pods/a in namespace dev'),
        # dan, by group viewers: list and get anywhere (rule 4), nothing else.
        (DAN, "list", "kube-system", "*", None, True,
         'rule #4 allows user "dan" to list pods in namespace kube-system'),
        (DAN, "get", "prod", "db-0", None, True,
         'rule #4 allows user "dan" to get pods/db-0 in namespace prod'),
        (DAN, "log", "prod", "db-0", None, False,
         'user "dan" may not log pods/db-0 in namespace prod'),
        (DAN, "exec", "prod", "db-0", None, False,
         'user "dan" may not exec pods/db-0 in namespace prod'),
        (DAN, "portforward", "prod", "db-0", None, False,
         'user "dan" may not portforward pods/db-0 in namespace prod'),
        # carol: attach and any port of db-0 (rule 5); system:masters gives nothing extra.
        (CAROL, "attach", "default", "db-0", None, True,
         'rule #5 allows user "carol" to attach pods/db-0 in namespace default'),
        (CAROL, "portforward", "default", "db-0", 5432, True,
         'rule #5 allows user "carol" to portforward port 5432 of pods/db-0 in namespace default'),
        (CAROL, "exec", "default", "db-0", None, False,
         'user "carol" may not exec pods/db-0 in namespace default'),
        (CAROL, "get", "default", "db-0", None, False,
         'user "carol" may not get pods/db-0 in namespace default'),
        (ROOT, "get", "default", "web-1", None, False,
         'user "admin" may not get pods/web-1 in namespace default'),
        (None, "get", "default", "web-1", None, False,
         "anonymous requests may not get pods/web-1 in namespace default"),
        (None, "list", "default", "*", None, False,
         "anonymous requests may not list pods in namespace default"),
    ],
)  # fmt: skip
def test_decisions(
    policy: Policy,
    user: UserInfo | None,
    verb: str,
    namespace: str,
    pod: str,
    port: int | None,
    allowed: bool,
    reason: str,
) -> None:
    assert policy.authorize(user, verb, namespace, pod, port) == Decision(allowed, reason)


def test_every_verb_is_covered() -> None:
    assert {v.value for v in Verb} == {"get", "list", "log", "exec", "attach", "portforward"}


@pytest.mark.parametrize("verb", [v.value for v in Verb])
def test_star_verbs_and_names(verb: str) -> None:
    policy = Policy.from_dict(
        {"rule": [{"users": ["*"], "namespaces": ["*"], "pods": ["*"], "verbs": ["*"]}]}
    )
    port = 443 if verb == "portforward" else None
    assert policy.authorize(UserInfo("x", (), "token"), verb, "ns", "p", port).allowed
    # "*" means anyone authenticated, never anonymous.
    assert not policy.authorize(None, verb, "ns", "p", port).allowed


def test_star_group_matches_anyone_authenticated() -> None:
    policy = Policy.from_dict(
        {"rule": [{"groups": ["*"], "namespaces": ["a"], "pods": ["p"], "verbs": ["get"]}]}
    )
    assert policy.authorize(UserInfo("x", (), "token"), "get", "a", "p").allowed
    assert not policy.authorize(UserInfo("x", (), "token"), "get", "b", "p").allowed


def test_users_and_groups_in_one_rule() -> None:
    policy = Policy.from_dict(
        {
            "rule": [
                {
                    "users": ["alice"],
                    "groups": ["ops"],
                    "namespaces": ["*"],
                    "pods": ["*"],
                    "verbs": ["exec"],
                }
            ]
        }
    )
    assert policy.authorize(UserInfo("alice", (), "x509"), "exec", "n", "p").allowed
    assert policy.authorize(UserInfo("zed", ("x", "ops"), "x509"), "exec", "n", "p").allowed
    assert not policy.authorize(UserInfo("zed", ("x",), "x509"), "exec", "n", "p").allowed
    # A user name is not a group name, and the reverse.
    assert not policy.authorize(UserInfo("ops", (), "x509"), "exec", "n", "p").allowed
    assert not policy.authorize(UserInfo("zed", ("alice",), "x509"), "exec", "n", "p").allowed


def test_first_matching_rule_is_named() -> None:
    rule = {"users": ["a"], "namespaces": ["*"], "pods": ["*"], "verbs": ["portforward"]}
    policy = Policy.from_dict({"rule": [{**rule, "ports": [80]}, {**rule, "ports": [443]}]})
    user = UserInfo("a", (), "token")
    assert policy.authorize(user, "portforward", "n", "p", 80).reason.startswith("rule #1 ")
    assert policy.authorize(user, "portforward", "n", "p", 443).reason.startswith("rule #2 ")
    assert policy.authorize(user, "portforward", "n", "p").reason.startswith("rule #1 ")


def test_list_ignores_pod_patterns() -> None:
    policy = Policy.from_dict(
        {"rule": [{"users": ["a"], "namespaces": ["ns"], "pods": ["web-*"], "verbs": ["list"]}]}
    )
    user = UserInfo("a", (), "token")
    assert policy.authorize(user, "list", "ns", "*").allowed
    assert policy.authorize(user, Verb.LIST, "ns", "anything").allowed
    assert not policy.authorize(user, "list", "other", "*").allowed


def test_empty_policy_denies_everything() -> None:
    policy = Policy.loads("")
    assert policy.rules == ()
    assert not policy.authorize(ROOT, "get", "default", "web-1").allowed


def test_allow_all() -> None:
    policy = Policy.allow_all()
    for verb in Verb:
        port = 22 if verb is Verb.PORTFORWARD else None
        assert policy.authorize(None, verb, "any", "pod", port).allowed
        assert policy.authorize(ALICE, verb, "any", "pod", port).allowed


def test_misuse_of_authorize(policy: Policy) -> None:
    with pytest.raises(ValueError, match="delete"):
        policy.authorize(ALICE, "delete", "default", "web-1")
    with pytest.raises(ValueError, match="portforward"):
        policy.authorize(ALICE, "exec", "default", "web-1", port=80)


def test_forbidden_body(policy: Policy) -> None:
    decision = policy.authorize(BOB, "exec", "default", "web-1")
    assert json.loads(decision.forbidden_body()) == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": 'user "bob" may not exec pods/web-1 in namespace default',
        "reason": "Forbidden",
        "code": 403,
    }


# --- validation -------------------------------------------------------------------------------

BASE = 'users = ["a"]\nnamespaces = ["*"]\npods = ["*"]\n'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (f'[[rule]]\n{BASE}verbs = ["delete"]',
         r"<policy>: rule #1: unknown verb\(s\) \['delete'\]; known: \['get', 'list'"),
        (f'[[rule]]\n{BASE}verbs = ["get"]\n[[rule]]\n{BASE}verbs = ["Get"]',
         r"<policy>: rule #2: unknown verb\(s\) \['Get'\]"),
        (f'[[rule]]\n{BASE}verbs = ["get"]\nuser = ["b"]',
         r"rule #1: unknown key\(s\) \['user'\]; known: \['groups', 'namespaces'"),
        ('[[rule]]\nnamespaces = ["*"]\npods = ["*"]\nverbs = ["get"]',
         r"rule #1: names no users and no groups"),
        ('[[rule]]\nusers = []\ngroups = []\nnamespaces = ["*"]\npods = ["*"]\nverbs = ["get"]',
         r"rule #1: names no users and no groups"),
        ('[[rule]]\nusers = ["a"]\npods = ["*"]\nverbs = ["get"]',
         r'rule #1: missing "namespaces"'),
        ('[[rule]]\nusers = ["a"]\nnamespaces = ["*"]\nverbs = ["get"]',
         r'rule #1: missing "pods"'),
        (f"[[rule]]\n{BASE}", r'rule #1: missing "verbs"'),
        (f"[[rule]]\n{BASE}verbs = []", r'rule #1: "verbs" is empty'),
        ('[[rule]]\nusers = ["a"]\nnamespaces = []\npods = ["*"]\nverbs = ["get"]',
         r'rule #1: "namespaces" is empty'),
        ('[[rule]]\nusers = "a"\nnamespaces = ["*"]\npods = ["*"]\nverbs = ["get"]',
         r'rule #1: "users" must be a list of non-empty strings'),
        ('[[rule]]\nusers = [""]\nnamespaces = ["*"]\npods = ["*"]\nverbs = ["get"]',
         r'rule #1: "users" must be a list of non-empty strings'),
        ('[[rule]]\nusers = ["a"]\nnamespaces = ["*"]\npods = [1]\nverbs = ["get"]',
         r'rule #1: "pods" must be a list of non-empty strings'),
        (f'[[rule]]\n{BASE}verbs = ["exec"]\nports = [80]',
         r'rule #1: "ports" only applies to the portforward verb'),
        (f'[[rule]]\n{BASE}verbs = ["portforward"]\nports = []',
         r'rule #1: "ports" must be a non-empty list'),
        (f'[[rule]]\n{BASE}verbs = ["portforward"]\nports = 80',
         r'rule #1: "ports" must be a non-empty list'),
        (f'[[rules]]\n{BASE}verbs = ["get"]',
         r"<policy>: unknown top-level key\(s\) \['rules'\]"),
        ("rule = 1", r"'rule' must be an array of tables"),
        ("rule = [1]", r"rule #1: must be a table"),
        ("[[rule]\n", r"<policy>: not valid TOML"),
    ],
)  # fmt: skip
def test_invalid_policies(text: str, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        Policy.loads(text)


@pytest.mark.parametrize(
    "port",
    ["0", "65536", "70000", '"9010-9000"', '"0-80"', '"80-65536"', '"abc"', '"80-"', '"-80"',
     '"80-90-100"', '"８０"', '""', "true", "1.5", "-1", "[80]"],
)  # fmt: skip
def test_bad_ports(port: str) -> None:
    text = f'[[rule]]\n{BASE}verbs = ["portforward"]\nports = [{port}]'
    with pytest.raises(PolicyError, match=r"rule #1: bad port .*expected a number or a range"):
        Policy.loads(text)


@pytest.mark.parametrize(
    ("port", "inside", "outside"),
    [
        ("1", [1], [2]),
        ("65535", [65535], [65534]),
        ('"443"', [443], [442, 444]),
        ('"1-65535"', [1, 80, 65535], []),
        ('" 9000 - 9002 "', [9000, 9001, 9002], [8999, 9003]),
        ('"22-22"', [22], [21, 23]),
    ],
)
def test_good_ports(port: str, inside: list[int], outside: list[int]) -> None:
    policy = Policy.loads(f'[[rule]]\n{BASE}verbs = ["portforward"]\nports = [{port}]')
    user = UserInfo("a", (), "token")
    for p in inside:
        assert policy.authorize(user, "portforward", "n", "p", p).allowed, p
    for p in outside:
        assert not policy.authorize(user, "portforward", "n", "p", p).allowed, p


def test_load_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text('[[rule]]\nusers = ["a"]\n')
    with pytest.raises(PolicyError, match=r"policy\.toml: rule #1: missing \"namespaces\""):
        Policy.load(path)
    with pytest.raises(PolicyError, match="No such file"):
        Policy.load(tmp_path / "missing.toml")


# --- reloading --------------------------------------------------------------------------------


def _rule(user: str) -> str:
    return f'[[rule]]\nusers = ["{user}"]\nnamespaces = ["*"]\npods = ["*"]\nverbs = ["exec"]\n'


def test_reload_on_change(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(_rule("alice"))
    policy = Policy.load(path)
    assert policy.authorize(ALICE, "exec", "n", "p").allowed

    path.write_text(_rule("bob"))
    bump_mtime(path)
    assert not policy.authorize(ALICE, "exec", "n", "p").allowed
    assert policy.authorize(BOB, "exec", "n", "p").allowed

    # An invalid version is logged once and the previous rules stay.
    caplog.set_level(logging.ERROR, logger="podgate.node.policy")
    path.write_text(_rule("carol").replace("exec", "shell"))
    bump_mtime(path)
    assert policy.authorize(BOB, "exec", "n", "p").allowed
    assert not policy.authorize(CAROL, "exec", "n", "p").allowed
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "unknown verb(s) ['shell']" in errors[0].getMessage()

    path.write_text(_rule("carol"))
    bump_mtime(path)
    assert policy.authorize(CAROL, "exec", "n", "p").allowed
    assert not policy.authorize(BOB, "exec", "n", "p").allowed


def test_deleted_file_denies_everything(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(_rule("alice"))
    policy = Policy.load(path)
    caplog.set_level(logging.WARNING, logger="podgate.node.watched")
    path.unlink()
    assert not policy.authorize(ALICE, "exec", "n", "p").allowed
    assert not policy.authorize(ALICE, "exec", "n", "p").allowed
    loud = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    assert len(loud) == 1
    assert "every request is denied" in loud[0].getMessage()
    path.write_text(_rule("alice"))
    assert policy.authorize(ALICE, "exec", "n", "p").allowed


def test_same_size_edit_with_the_same_mtime_is_seen(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(_rule("alice"))
    policy = Policy.load(path)
    before = path.stat()
    path.write_text(_rule("bobby"))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_ino == before.st_ino
    assert not policy.authorize(ALICE, "exec", "n", "p").allowed
    assert policy.authorize(UserInfo("bobby", (), "token"), "exec", "n", "p").allowed


def test_replace_by_rename_is_seen(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(_rule("alice"))
    policy = Policy.load(path)
    new = tmp_path / "policy.toml.new"
    new.write_text(_rule("bobby"))  # same size as before
    st_ = path.stat()
    os.utime(new, ns=(st_.st_atime_ns, st_.st_mtime_ns))  # and the same mtime: only the inode
    os.replace(new, path)
    assert not policy.authorize(ALICE, "exec", "n", "p").allowed
    assert policy.authorize(UserInfo("bobby", (), "token"), "exec", "n", "p").allowed


# --- properties -------------------------------------------------------------------------------

NAMES = ["alice", "bob", "carol"]
GROUPS = ["devs", "ops"]
STRANGER = UserInfo("zed", ("nobody", "also-nobody"), "token")

_patterns = st.lists(st.sampled_from(["*", "default", "dev-*", "web-*", "db-0"]), min_size=1)
_ports = st.lists(
    st.one_of(
        st.integers(1, 65535),
        st.tuples(st.integers(1, 65535), st.integers(0, 100)).map(
            lambda t: f"{t[0]}-{min(t[0] + t[1], 65535)}"
        ),
    ),
    min_size=1,
    max_size=4,
)


def _rules(star: bool) -> st.SearchStrategy[dict[str, Any]]:
    extra = ["*"] if star else []
    return st.fixed_dictionaries(
        {
            "users": st.lists(st.sampled_from(NAMES + extra), min_size=1, max_size=3),
            "groups": st.lists(st.sampled_from(GROUPS + extra), max_size=2),
            "namespaces": _patterns,
            "pods": _patterns,
            "verbs": st.lists(st.sampled_from([*(v.value for v in Verb), "*"]), min_size=1),
        },
        optional={"ports": _ports},
    ).filter(lambda r: "ports" not in r or {"portforward", "*"} & set(r["verbs"]))


_requests = st.tuples(
    st.sampled_from(list(Verb)),
    st.sampled_from(["default", "dev-x", "prod"]),
    st.sampled_from(["web-1", "db-0", "api"]),
    st.one_of(st.none(), st.integers(1, 65535)),
).map(lambda r: r if r[0] is Verb.PORTFORWARD else (*r[:3], None))


@settings(max_examples=200, deadline=None)
@given(rules=st.lists(_rules(star=False), max_size=6), request=_requests)
def test_unnamed_user_is_always_denied(
    rules: list[dict[str, Any]], request: tuple[Verb, str, str, int | None]
) -> None:
    policy = Policy.from_dict({"rule": rules})
    decision = policy.authorize(STRANGER, *request)
    assert not decision.allowed
    assert decision.reason.startswith('user "zed" may not') or decision.reason.startswith("port ")


@settings(max_examples=200, deadline=None)
@given(rules=st.lists(_rules(star=True), max_size=6), request=_requests)
def test_unnamed_user_is_only_allowed_through_star(
    rules: list[dict[str, Any]], request: tuple[Verb, str, str, int | None]
) -> None:
    policy = Policy.from_dict({"rule": rules})
    decision = policy.authorize(STRANGER, *request)
    if decision.allowed:
        number = int(decision.reason.split()[1].lstrip("#"))
        rule = rules[number - 1]
        assert "*" in rule["users"] or "*" in rule["groups"]
    # Whatever a stranger may do, a named user may do too (rules only ever add permissions).
    named = UserInfo("alice", ("devs", "ops"), "token")
    if decision.allowed:
        assert policy.authorize(named, *request).allowed


@settings(max_examples=200, deadline=None)
@given(ports=_ports, port=st.integers(1, 65535))
def test_port_ranges_match_their_members(ports: list[int | str], port: int) -> None:
    policy = Policy.from_dict(
        {
            "rule": [
                {
                    "users": ["a"],
                    "namespaces": ["*"],
                    "pods": ["*"],
                    "verbs": ["portforward"],
                    "ports": ports,
                }
            ]
        }
    )
    members: set[int] = set()
    for item in ports:
        if isinstance(item, int):
            members.add(item)
        else:
            lo, hi = item.split("-")
            members.update(range(int(lo), int(hi) + 1))
    user = UserInfo("a", (), "token")
    assert policy.authorize(user, "portforward", "n", "p", port).allowed == (port in members)
    assert policy.authorize(user, "portforward", "n", "p").allowed


def test_request_names_are_literal_not_patterns(policy: Policy) -> None:
    # An all-namespaces list arrives as namespace "*": only a rule covering every namespace
    # allows it. A "*" or "[" in a requested name never acts as a wildcard.
    assert policy.authorize(DAN, "list", "*", "*").allowed
    assert not policy.authorize(BOB, "list", "*", "*").allowed
    assert not policy.authorize(ALICE, "exec", "default", "*").allowed
    assert not policy.authorize(ALICE, "exec", "*", "web-1").allowed
    assert policy.authorize(BOB, "exec", "dev-[", "a").allowed  # "dev-*" matches it literally
