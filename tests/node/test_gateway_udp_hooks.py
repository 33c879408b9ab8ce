"""The gateway's per-stream hooks with UDP: policy by protocol, the audit record's "protocol"
field, and the forwards metric labelled by protocol and outcome (no network)."""

from __future__ import annotations

import json
from pathlib import Path

from podgate.node.auth import Authenticator, UserInfo
from podgate.node.gateway import AuditLog, Caller, Gate, GateStream, Metrics
from podgate.node.kubeapi import PodView
from podgate.node.policy import Policy
from podgate.proto.upgrade import UpgradeRequest
from podgate.streaming.hooks import ForwardRecord

POLICY = """
[[rule]]
users = ["u"]
namespaces = ["ns"]
pods = ["p"]
verbs = ["portforward"]
ports = ["53/udp", 8080]
"""


def test_hooks_authorize_audit_and_count_by_protocol(tmp_path: Path) -> None:
    audit_path = tmp_path / "audit.log"
    metrics = Metrics()
    gate = Gate(Authenticator(None), Policy.loads(POLICY), AuditLog(str(audit_path)), metrics)
    who = Caller(UserInfo("u", (), "token"), "127.0.0.1:1")
    request = UpgradeRequest("POST", "/api/v1/namespaces/ns/pods/p/portforward", ())
    stream = GateStream(gate, who, "portforward", PodView("ns", "p", "uid"), None, request)
    try:
        assert stream.check_port(53, "udp") is None
        assert (
            stream.check_port(53) == 'port 53 is not allowed for user "u" on pods/p in namespace ns'
        )
        assert stream.check_port(8080, "udp") == (
            'port 8080/udp is not allowed for user "u" on pods/p in namespace ns'
        )
        record = ForwardRecord(53, "udp", bytes_in=10, bytes_out=12)
        stream.forward_started(record)
        stream.forward_finished(record)
        denied = ForwardRecord(8080, "udp", outcome="denied", reason="no")
        stream.forward_started(denied)
        stream.forward_finished(denied)
    finally:
        stream.finish("completed")
        gate.audit.close()
    entries = [json.loads(line) for line in audit_path.read_text().splitlines()]
    forwards = [e for e in entries if "port" in e]
    assert [(e["port"], e["protocol"], e["outcome"]) for e in forwards] == [
        (53, "udp", "allowed"),
        (8080, "udp", "denied"),
    ]
    assert (forwards[0]["bytes_in"], forwards[0]["bytes_out"]) == (10, 12)

    def sample(**labels: str) -> float | None:
        return metrics.registry.get_sample_value("podgate_portforward_forwards_total", labels)

    assert sample(protocol="udp", outcome="allowed") == 1.0
    assert sample(protocol="udp", outcome="denied") == 1.0
    assert sample(protocol="tcp", outcome="allowed") is None
