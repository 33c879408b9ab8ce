"""Golden replays: the bytes upstream Go NRI plugins sent (tests/nri/captures), replayed against
podgate's real NRI runtime side on its unix socket. podgate must answer and ask exactly as the
capture shows (its own bytes there are the regression baseline), and the plugins' adjustments
must all arrive in the merged result, owned by the plugin — and what the runtime cannot apply
yet is refused by name, never dropped."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from capture_support import RESPONSE, load
from replay_support import Replay, replay, synchronized

from podgate.nri import api_pb2 as api
from podgate.nri.adaptation import Adaptation, NriConfig
from podgate.nri.convert import APPLIED_FIELDS, oci_adjustment
from podgate.nri.merge import MergeResult, unapplied
from podgate.oci.adjust import apply
from podgate.proto.ttrpc import envelope_pb2

# What podgate was when the captures were made: its Configure carries these (README).
RUNTIME_NAME, RUNTIME_VERSION = "podgate", "0.1.0"
# An OK reply without payload, as podgate and Go ttrpc write it: no status, no payload field.
EMPTY_REPLY = bytes.fromhex("0000000a00000000000000010200")
SHARED_BUDGET = frozenset({"Synchronize", "StateChange"})
REQUEST_TIMEOUT_NS = 2_000_000_000


@pytest.fixture
def short_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="nri-")  # unix socket paths must stay short
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def run_replay(short_dir: str) -> AsyncIterator[Callable[[str], Any]]:
    started: list[Adaptation] = []

    async def run(name: str) -> tuple[Replay, Adaptation]:
        capture = load(name)
        world = synchronized(capture)
        config = NriConfig(
            socket_path=os.path.join(short_dir, f"{name}.sock"),
            plugin_path=os.path.join(short_dir, "plugins"),
            plugin_config_path=os.path.join(short_dir, "conf.d"),
        )
        adaptation = Adaptation(
            config,
            runtime_name=RUNTIME_NAME,
            runtime_version=RUNTIME_VERSION,
            sync=lambda: world,
        )
        started.append(adaptation)
        await adaptation.start()
        return await replay(capture, adaptation, config.socket_path), adaptation

    try:
        yield run
    finally:
        for adaptation in started:
            await adaptation.stop()


def assert_podgate_side_matches(result: Replay) -> None:
    """podgate sent what the capture shows it sending: the same frames in the same order with
    the same envelopes and the same NRI messages, field for field. Not byte for byte: protobuf
    writes map entries (labels, annotations) in no fixed order, and `timeout_nano` is what is
    left of a budget where podgate shares one (Synchronize, a StateChange fallback)."""
    captured = [m for m in result.capture.messages if not m.from_plugin]
    assert len(result.sent) == len(captured)
    for sent, expected in zip(result.sent, captured, strict=True):
        assert (sent.conn, sent.stream_id, sent.kind) == (
            expected.conn,
            expected.stream_id,
            expected.kind,
        )
        assert sent.frame[8 + 9] == expected.frame[8 + 9]  # ttrpc flags
        if isinstance(expected.envelope, envelope_pb2.Response):
            assert sent.frame == expected.frame  # podgate's only replies: RegisterPlugin's
            continue
        assert isinstance(sent.envelope, envelope_pb2.Request)
        envelope = envelope_pb2.Request()
        envelope.CopyFrom(sent.envelope)
        if expected.method in SHARED_BUDGET:
            assert 0 < envelope.timeout_nano <= REQUEST_TIMEOUT_NS
            envelope.timeout_nano = expected.envelope.timeout_nano
        payload_type = type(expected.message)
        assert payload_type.FromString(envelope.payload) == expected.message, expected.method
        envelope.payload = expected.envelope.payload
        assert envelope == expected.envelope, expected.method


SCENARIOS = (
    "1-logger-v0.12.2",
    "2-device-injector",
    "3-ulimit-adjuster",
    "4-logger-v0.10.0",
    "5-template",
)


@pytest.mark.parametrize("scenario", SCENARIOS)
async def test_podgate_answers_and_asks_as_captured(run_replay: Any, scenario: str) -> None:
    result, _ = await run_replay(scenario)
    assert_podgate_side_matches(result)
    [register_reply] = [s for s in result.sent if s.conn == 2]
    assert register_reply.kind == RESPONSE
    assert register_reply.frame == bytes.fromhex("00000002") + EMPTY_REPLY
    [configure] = result.requests("Configure")
    assert configure.frame.hex() == (
        "00000001000000590000004f0000000101000a1b6e72692e706b672e6170692e7631616c706861312e"
        "506c7567696e1209436f6e6669677572651a1f1207706f64676174651a05302e312e302088272"
        "8d00f320776302e31322e302080a8d6b907"
    )


async def test_logger_adjustment_is_merged_and_validated(run_replay: Any) -> None:
    result, _ = await run_replay("1-logger-v0.12.2")
    [merged] = result.results["CreateContainer"]
    assert isinstance(merged, MergeResult)
    [reply] = result.capture.replies("CreateContainer")
    assert isinstance(reply.message, api.CreateContainerResponse)
    pid_value = reply.message.adjust.annotations["x.example/added"]
    assert pid_value.startswith("logger-pid-")
    assert dict(merged.adjust.annotations) == {"x.example/added": pid_value}
    # -FOO then FOO from one plugin: a replacement, which the merge shows as the new value.
    assert [(kv.key, kv.value) for kv in merged.adjust.env] == [
        ("LOGGER_ADD_ENV", pid_value),
        ("FOO", pid_value),
    ]
    owners = merged.owners.owners[reply_container_id(result)]
    assert dict(owners.compound[api.Env].owners) == {
        "LOGGER_ADD_ENV": "10-logger",
        "FOO": "10-logger",
    }
    assert dict(owners.compound[api.Annotations].owners) == {"x.example/added": "10-logger"}
    # The validator (the logger itself) got exactly that, and accepted it.
    [validate] = result.requests("ValidateContainerAdjustment")
    assert isinstance(validate.envelope, envelope_pb2.Request)
    request = api.ValidateContainerAdjustmentRequest.FromString(validate.envelope.payload)
    assert request.adjust == merged.adjust
    assert request.owners == merged.owners
    assert [(p.name, p.index) for p in request.plugins] == [("logger", "10")]
    # annotations and env are applied to containers: nothing to refuse
    assert unapplied(merged.claims, APPLIED_FIELDS) == []


def reply_container_id(result: Replay) -> str:
    [create] = result.capture.requests("CreateContainer")
    assert isinstance(create.message, api.CreateContainerRequest)
    return create.message.container.id


async def test_device_injector_device_and_mount_reach_the_merge(run_replay: Any) -> None:
    result, _ = await run_replay("2-device-injector")
    [merged] = result.results["CreateContainer"]
    assert isinstance(merged, MergeResult)
    [device] = merged.adjust.linux.devices
    assert (device.path, device.type, device.major, device.minor) == ("/dev/nri-null", "c", 1, 3)
    [mount] = merged.adjust.mounts
    assert (mount.destination, mount.source, list(mount.options)) == (
        "/mnt",
        "/_SCRATCH_/mntsrc",
        ["bind", "ro"],
    )
    owners = merged.owners.owners[reply_container_id(result)]
    assert dict(owners.compound[api.Devices].owners) == {"/dev/nri-null": "20-device-injector"}
    assert dict(owners.compound[api.Mounts].owners) == {"/mnt": "20-device-injector"}
    # The device reaches the container's OCI spec: a node and a cgroup rule allowing it.
    assert unapplied(merged.claims, APPLIED_FIELDS) == []
    config: dict[str, Any] = {"linux": {"resources": {"devices": [{"allow": False}]}}}
    apply(config, oci_adjustment(merged.adjust))
    [node] = config["linux"]["devices"]
    assert (node["path"], node["type"], node["major"], node["minor"]) == (
        "/dev/nri-null",
        "c",
        1,
        3,
    )
    assert config["linux"]["resources"]["devices"][-1] == {
        "allow": True,
        "type": "c",
        "major": 1,
        "minor": 3,
        "access": "rw",
    }


async def test_ulimit_adjuster_rlimits_are_owned_by_the_plugin(run_replay: Any) -> None:
    result, _ = await run_replay("3-ulimit-adjuster")
    [merged] = result.results["CreateContainer"]
    assert isinstance(merged, MergeResult)
    assert [(r.type, r.soft, r.hard) for r in merged.adjust.rlimits] == [
        ("RLIMIT_NOFILE", 1024, 4096),
        ("RLIMIT_NPROC", 9000, 9000),
    ]
    owners = merged.owners.owners[reply_container_id(result)]
    assert dict(owners.compound[api.Rlimits].owners) == {
        "RLIMIT_NOFILE": "30-ulimit-adjuster",
        "RLIMIT_NPROC": "30-ulimit-adjuster",
    }
    # Applied to the process: they replace the spec's own limits of the same type.
    assert unapplied(merged.claims, APPLIED_FIELDS) == []
    process = {"rlimits": [{"type": "RLIMIT_NOFILE", "hard": 20000, "soft": 20000}]}
    config: dict[str, Any] = {"process": process}
    apply(config, oci_adjustment(merged.adjust))
    assert config["process"]["rlimits"] == [
        {"type": "RLIMIT_NOFILE", "hard": 4096, "soft": 1024},
        {"type": "RLIMIT_NPROC", "hard": 9000, "soft": 9000},
    ]


async def test_old_logger_gets_every_event_through_state_change(run_replay: Any) -> None:
    result, _ = await run_replay("4-logger-v0.10.0")
    state_changes = [
        api.StateChangeEvent.FromString(s.envelope.payload).event
        for s in result.requests("StateChange")
        if isinstance(s.envelope, envelope_pb2.Request)
    ]
    assert state_changes == [
        api.RUN_POD_SANDBOX,
        api.POST_CREATE_CONTAINER,
        api.START_CONTAINER,
        api.POST_START_CONTAINER,
        api.REMOVE_CONTAINER,
        api.STOP_POD_SANDBOX,
        api.REMOVE_POD_SANDBOX,
    ]
    [merged] = result.results["CreateContainer"]
    assert merged.adjust == api.ContainerAdjustment() and merged.claims == ()


async def test_template_sees_every_event_and_adjusts_nothing(run_replay: Any) -> None:
    result, _ = await run_replay("5-template")
    methods = [
        s.envelope.method for s in result.sent if isinstance(s.envelope, envelope_pb2.Request)
    ]
    assert methods == [
        "Configure",
        "Synchronize",
        "RunPodSandbox",
        "CreateContainer",
        "PostCreateContainer",
        "StartContainer",
        "PostStartContainer",
        "StopContainer",
        "RemoveContainer",
        "StopPodSandbox",
        "RemovePodSandbox",
    ]
    [merged] = result.results["CreateContainer"]
    assert merged.adjust == api.ContainerAdjustment() and merged.claims == ()
