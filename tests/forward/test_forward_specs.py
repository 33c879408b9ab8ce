"""Parsing what `podgate port-forward` is asked: port pairs, targets, addresses, files."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podgate.forward.specs import (
    PortSpec,
    Protocol,
    SpecError,
    TargetSpec,
    check_local_ports,
    load_targets_file,
    parse_addresses,
    parse_port_spec,
    parse_port_specs,
    parse_target,
    parse_targets_document,
)

TCP, UDP = Protocol.TCP, Protocol.UDP


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8080:80", PortSpec(8080, 80, TCP)),
        ("80", PortSpec(80, 80, TCP)),  # kubectl: the same port locally
        (":80", PortSpec(0, 80, TCP)),  # kubectl: a random local port
        ("0:80", PortSpec(0, 80, TCP)),
        ("5353:53/udp", PortSpec(5353, 53, UDP)),
        ("53/UDP", PortSpec(53, 53, UDP)),
        (":53/udp", PortSpec(0, 53, UDP)),
        ("8080:80/tcp", PortSpec(8080, 80, TCP)),
        (" 1:65535 ", PortSpec(1, 65535, TCP)),
    ],
)
def test_port_pairs(text: str, expected: PortSpec) -> None:
    assert parse_port_spec(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty port pair"),
        ("0", "remote port 0 is not in 1..65535"),
        ("8080:0", "remote port 0 is not in 1..65535"),
        ("65536", "remote port 65536 is not in 1..65535"),
        ("70000:80", "local port 70000 is not in 0..65535"),
        ("http", "remote port 'http' is not a number"),
        ("8080:http", "remote port 'http' is not a number"),
        ("x:80", "local port 'x' is not a number"),
        ("1:2:3", "expected [LOCAL:]REMOTE"),
        ("80/sctp", "protocol must be tcp or udp, not 'sctp'"),
        ("-1:80", "local port '-1' is not a number"),
        ("８０", "is not a number"),  # full-width digits are not ASCII digits
    ],
)
def test_bad_port_pairs(text: str, message: str) -> None:
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace(".", r"\.")):
        parse_port_spec(text)


def test_port_pair_lists() -> None:
    assert parse_port_specs(["8080:80", ":81", "53/udp", "53:53"]) == (
        PortSpec(8080, 80),
        PortSpec(0, 81),
        PortSpec(53, 53, UDP),
        PortSpec(53, 53, TCP),  # the same number over TCP and UDP is two sockets
    )
    assert parse_port_specs([":80", ":80"]) == (PortSpec(0, 80), PortSpec(0, 80))
    with pytest.raises(SpecError, match="local port 8080/tcp is given twice"):
        parse_port_specs(["8080:80", "8080:81"])
    with pytest.raises(SpecError, match="at least one port pair"):
        parse_port_specs([])


@settings(max_examples=200, deadline=None)
@given(
    local=st.integers(0, 65535),
    remote=st.integers(1, 65535),
    protocol=st.sampled_from([TCP, UDP]),
)
def test_port_pair_round_trip(local: int, remote: int, protocol: Protocol) -> None:
    spec = PortSpec(local, remote, protocol)
    assert parse_port_spec(str(spec)) == spec


@pytest.mark.parametrize(
    ("text", "name"),
    [("web", "web"), ("pod/web", "web"), ("pods/web", "web"), ("po/web", "web"), ("Pod/x", "x")],
)
def test_targets(text: str, name: str) -> None:
    assert parse_target(text) == name


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("svc/web", "only pods are supported"),
        ("service/web", "only pods are supported"),
        ("deploy/web", "only pods are supported"),
        ("pod/", "expected pod/NAME or NAME"),
        ("pod/a/b", "expected pod/NAME or NAME"),
        ("", "expected pod/NAME or NAME"),
        ("a" * 254, "longer than 253"),
    ],
)
def test_bad_targets(text: str, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse_target(text)


def test_addresses() -> None:
    assert parse_addresses([]) == ("127.0.0.1",)
    assert parse_addresses(["localhost"]) == ("127.0.0.1", "::1")
    assert parse_addresses(["127.0.0.1", "localhost", "::1"]) == ("127.0.0.1", "::1")
    assert parse_addresses(["0.0.0.0,[::]"]) == ("0.0.0.0", "::")
    assert parse_addresses(["::0001"]) == ("::1",)
    with pytest.raises(SpecError, match=r"invalid --address 'example\.com'"):
        parse_addresses(["example.com"])


TARGETS_YAML = """
- pod: web
  ports: ["8080:80", ":9090"]
- namespace: infra
  pod: pod/dns
  ports: ["5353:53/udp", 53]
- pod: single
  ports: "7000"
"""


def test_targets_document() -> None:
    assert parse_targets_document(TARGETS_YAML) == [
        TargetSpec("web", (PortSpec(8080, 80), PortSpec(0, 9090)), None),
        TargetSpec("dns", (PortSpec(5353, 53, UDP), PortSpec(53, 53)), "infra"),
        TargetSpec("single", (PortSpec(7000, 7000),), None),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("pod: web", "expected a non-empty YAML list"),
        ("[]", "expected a non-empty YAML list"),
        ("- web", "entry 1: expected a map"),
        ("- {pod: web}", "entry 1: ports must be a non-empty list"),
        ("- {pod: web, ports: []}", "entry 1: ports must be a non-empty list"),
        ("- {ports: ['80']}", "entry 1: pod must be a string"),
        ("- {pod: web, ports: ['80'], port: 1}", "entry 1: unknown keys port"),
        ("- {pod: web, ports: ['80']}\n- {pod: svc/x, ports: ['80']}", "entry 2: .*only pods"),
        ("- {pod: web, ports: ['99999']}", "entry 1: .*not in 1..65535"),
        ("- {pod: web, namespace: '', ports: ['80']}", "namespace must be a non-empty string"),
        ("- [unclosed", "not valid YAML"),
    ],
)
def test_bad_targets_documents(text: str, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse_targets_document(text)


def test_targets_file(tmp_path: Path) -> None:
    path = tmp_path / "targets.yaml"
    path.write_text(TARGETS_YAML)
    assert [t.pod for t in load_targets_file(str(path))] == ["web", "dns", "single"]
    with pytest.raises(SpecError, match="cannot read targets file"):
        load_targets_file(str(tmp_path / "missing.yaml"))


def test_one_local_port_per_target() -> None:
    a = TargetSpec("a", (PortSpec(8080, 80),))
    b = TargetSpec("b", (PortSpec(8080, 81),))
    c = TargetSpec("c", (PortSpec(8080, 80, UDP), PortSpec(0, 80)))
    check_local_ports([a, c])  # TCP and UDP 8080 are different sockets; 0 is never taken
    with pytest.raises(SpecError, match=r"local port 8080/tcp is asked for twice \(/a and /b\)"):
        check_local_ports([a, b])
    with pytest.raises(SpecError, match="asked for twice"):
        check_local_ports([a, a])
