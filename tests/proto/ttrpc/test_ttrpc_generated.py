"""The committed envelope modules match their protos, and the protos match the wire spec."""

from __future__ import annotations

import ast
from pathlib import Path

from google.protobuf.descriptor import FieldDescriptor

from podgate.proto.ttrpc import envelope_pb2, status_pb2


def _fields(message: object) -> dict[str, tuple[int, int, bool]]:
    descriptor = message.DESCRIPTOR  # type: ignore[attr-defined]
    return {f.name: (f.number, f.type, f.is_repeated) for f in descriptor.fields}


def test_envelope_fields_match_the_reference() -> None:
    t = FieldDescriptor
    assert envelope_pb2.Request.DESCRIPTOR.full_name == "ttrpc.Request"
    assert _fields(envelope_pb2.Request) == {
        "service": (1, t.TYPE_STRING, False),
        "method": (2, t.TYPE_STRING, False),
        "payload": (3, t.TYPE_BYTES, False),
        "timeout_nano": (4, t.TYPE_INT64, False),
        "metadata": (5, t.TYPE_MESSAGE, True),
    }
    assert _fields(envelope_pb2.Response) == {
        "status": (1, t.TYPE_MESSAGE, False),
        "payload": (2, t.TYPE_BYTES, False),
    }
    status_type = envelope_pb2.Response.DESCRIPTOR.fields_by_name["status"].message_type
    assert status_type is not None
    assert status_type.full_name == "google.rpc.Status"
    assert _fields(envelope_pb2.KeyValue) == {
        "key": (1, t.TYPE_STRING, False),
        "value": (2, t.TYPE_STRING, False),
    }
    assert _fields(envelope_pb2.StringList) == {"list": (1, t.TYPE_STRING, True)}
    assert _fields(status_pb2.Status) == {
        "code": (1, t.TYPE_INT32, False),
        "message": (2, t.TYPE_STRING, False),
        "details": (3, t.TYPE_MESSAGE, True),
    }
    details_type = status_pb2.Status.DESCRIPTOR.fields_by_name["details"].message_type
    assert details_type is not None
    assert details_type.full_name == "google.protobuf.Any"


FORBIDDEN = {"asyncio", "socket", "threading", "subprocess", "time", "selectors"}


def test_protocol_modules_do_no_io() -> None:
    for name in ("connection", "frames", "events", "errors", "__init__"):
        tree = ast.parse((Path(envelope_pb2.__file__).parent / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {(node.module or "").split(".")[0]}
            else:
                continue
            assert not roots & FORBIDDEN, f"{name}.py imports {roots & FORBIDDEN}"
