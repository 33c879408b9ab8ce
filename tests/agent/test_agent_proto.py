"""The agent API: committed modules match agent.proto, and the proto matches the contract."""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor

from podgate.agent import agent_pb2
from podgate.agent.agent import SERVICE


def _fields(message: object) -> dict[str, tuple[int, int]]:
    descriptor = message.DESCRIPTOR  # type: ignore[attr-defined]
    return {f.name: (f.number, f.type) for f in descriptor.fields}


def test_port_forward_request_keeps_katas_field_numbers() -> None:
    # Kata PR #5979's agent PortForwardRequest: container_id=1 string, port=2 uint32,
    # vsock_port=3 uint32 (reference §2.3).
    t = FieldDescriptor
    assert (
        agent_pb2.PortForwardRequest.DESCRIPTOR.full_name == "podgate.agent.v1.PortForwardRequest"
    )
    # protocol (request 4, response 1) is podgate's UDP extension; empty for TCP. nonce (5) is
    # podgate's dial-back pairing, written first on the dial-back connection.
    assert _fields(agent_pb2.PortForwardRequest) == {
        "container_id": (1, t.TYPE_STRING),
        "port": (2, t.TYPE_UINT32),
        "vsock_port": (3, t.TYPE_UINT32),
        "protocol": (4, t.TYPE_STRING),
        "nonce": (5, t.TYPE_BYTES),
    }
    assert _fields(agent_pb2.PortForwardResponse) == {"protocol": (1, t.TYPE_STRING)}
    assert _fields(agent_pb2.HealthRequest) == {}
    assert _fields(agent_pb2.HealthResponse) == {"status": (1, t.TYPE_STRING)}


def test_service_methods() -> None:
    service = agent_pb2.DESCRIPTOR.services_by_name["Agent"]
    assert service.full_name == SERVICE == "podgate.agent.v1.Agent"
    methods = {m.name: (m.input_type.name, m.output_type.name) for m in service.methods}
    assert methods == {
        "PortForward": ("PortForwardRequest", "PortForwardResponse"),
        "Health": ("HealthRequest", "HealthResponse"),
    }


def test_wire_bytes() -> None:
    # Protobuf encoding by hand: field 1 LEN (tag 0x0a) "c1"; field 2 varint (tag 0x10)
    # 8080 = 0x1f90 -> 90 3f; field 3 varint (tag 0x18) 5000 = 0x1388 -> 88 27.
    request = agent_pb2.PortForwardRequest(container_id="c1", port=8080, vsock_port=5000)
    assert request.SerializeToString() == bytes.fromhex("0a 02 63 31 10 90 3f 18 88 27")
    assert agent_pb2.HealthResponse(status="ok").SerializeToString() == bytes.fromhex("0a 02 6f 6b")
    assert agent_pb2.PortForwardResponse().SerializeToString() == b""
    # field 4 LEN (tag 0x22) "udp"; the reply's field 1 LEN (tag 0x0a) "udp".
    udp = agent_pb2.PortForwardRequest(container_id="c1", port=53, vsock_port=5000, protocol="udp")
    assert udp.SerializeToString() == bytes.fromhex("0a 02 63 31 10 35 18 88 27 22 03 75 64 70")
    reply = agent_pb2.PortForwardResponse(protocol="udp")
    assert reply.SerializeToString() == bytes.fromhex("0a 03 75 64 70")
