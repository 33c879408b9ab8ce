"""podgate's NRI schema against the bytes upstream Go plugins (containerd/nri v0.12.2 and
v0.10.0) actually sent: every plugin message decodes with no unknown field anywhere, and
re-encodes to the bytes on the wire."""

from __future__ import annotations

import pytest
from capture_support import SCENARIOS, load, unknown_field_paths

from podgate.nri import api_pb2 as api


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_plugin_message_decodes_without_unknown_fields(scenario: str) -> None:
    capture = load(scenario)
    plugin_messages = capture.plugin_messages()
    assert plugin_messages, "the capture holds plugin messages"
    for captured in plugin_messages:
        assert unknown_field_paths(captured.envelope) == [], captured.method
        if captured.message is not None:
            assert unknown_field_paths(captured.message) == [], captured.method


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_message_of_both_sides_decodes_without_unknown_fields(scenario: str) -> None:
    for captured in load(scenario).messages:
        if captured.message is not None:
            assert unknown_field_paths(captured.message) == [], (
                captured.direction,
                captured.method,
            )


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_plugin_payloads_reencode_byte_for_byte(scenario: str) -> None:
    for captured in load(scenario).plugin_messages():
        if captured.message is None:
            continue
        assert captured.message.SerializeToString() == captured.envelope.payload, captured.method


def test_device_injector_device_is_decoded() -> None:
    [reply] = load("2-device-injector").replies("CreateContainer")
    assert isinstance(reply.message, api.CreateContainerResponse)
    [device] = reply.message.adjust.linux.devices
    assert (device.path, device.type, device.major, device.minor) == ("/dev/nri-null", "c", 1, 3)


def test_unknown_field_check_bites() -> None:
    # A field the schema lacks, deep inside a nested message, and at the top.
    message = api.CreateContainerResponse()
    message.adjust.linux.devices.add(path="/dev/x")
    device = message.adjust.linux.devices[0].SerializeToString() + b"\xa8\x1f\x01"  # field 501
    linux = b"\x0a" + bytes([len(device)]) + device
    adjust = b"\x32" + bytes([len(linux)]) + linux
    data = b"\x0a" + bytes([len(adjust)]) + adjust + b"\xb0\x1f\x02"  # field 502
    parsed = api.CreateContainerResponse.FromString(data)
    assert parsed.adjust.linux.devices[0].path == "/dev/x"
    assert sorted(unknown_field_paths(parsed)) == [
        "CreateContainerResponse#502",
        "CreateContainerResponse.adjust.linux.devices[0]#501",
    ]
