"""podgate records -> NRI messages, and merged adjustments applied back to a ContainerSpec."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from podgate.cri import api_pb2 as cri
from podgate.model import (
    ContainerMetadata,
    ContainerRecord,
    ContainerSpec,
    ContainerState,
    NamespaceMode,
    PodMetadata,
    PodRecord,
    PodState,
    ProcessRef,
)
from podgate.nri import api_pb2 as api
from podgate.nri.convert import (
    apply_adjustment,
    container,
    mount_from_nri,
    mount_to_nri,
    pod_sandbox,
)
from podgate.runtime.cri.convert import mount_to_dict


def make_pod(**changes: Any) -> PodRecord:
    pod = PodRecord(
        id="pod1",
        metadata=PodMetadata(name="web", namespace="default", uid="uid-1", attempt=0),
        state=PodState.READY,
        created_at=1_700_000_000_000_000_000,
        runtime_handler="runsc",
        labels={"app": "web"},
        annotations={"team": "a"},
        ns_process=ProcessRef(pid=4242, start_time=7),
        ip="192.0.2.10",
        additional_ips=["2001:db8::10"],
    )
    for key, value in changes.items():
        setattr(pod, key, value)
    return pod


def cri_mount(**fields: Any) -> dict[str, Any]:
    """A spec mount exactly as the CRI layer stores one."""
    return mount_to_dict(cri.Mount(**fields))


def make_container(**changes: Any) -> ContainerRecord:
    record = ContainerRecord(
        id="ctr1",
        pod_id="pod1",
        metadata=ContainerMetadata(name="app", attempt=1),
        spec=ContainerSpec(
            command=["/bin/sh", "-c"],
            args=["sleep 1"],
            envs={"PATH": "/bin", "FOO": "1"},
            mounts=[
                cri_mount(container_path="/data", host_path="/srv/data"),
                cri_mount(
                    container_path="/ro",
                    host_path="/srv/ro",
                    readonly=True,
                    propagation=cri.PROPAGATION_HOST_TO_CONTAINER,
                ),
            ],
        ),
        state=ContainerState.EXITED,
        created_at=11,
        started_at=22,
        finished_at=33,
        exit_code=137,
        reason="Error",
        message="killed",
        process=ProcessRef(pid=5151, start_time=9),
        labels={"l": "1"},
        annotations={"a": "1"},
    )
    for key, value in changes.items():
        setattr(record, key, value)
    return record


# ----------------------------------------------------------------------------- to NRI


def test_pod_sandbox_message() -> None:
    message = pod_sandbox(
        make_pod(), netns_path="/proc/77/ns/net", ips=["192.0.2.10", "", "2001:db8::10"]
    )
    assert message == api.PodSandbox(
        id="pod1",
        name="web",
        uid="uid-1",
        namespace="default",
        labels={"app": "web"},
        annotations={"team": "a"},
        runtime_handler="runsc",
        pid=4242,
        ips=["192.0.2.10", "2001:db8::10"],
        linux=api.LinuxPodSandbox(
            namespaces=[
                api.LinuxNamespace(type="network", path="/proc/77/ns/net"),
                api.LinuxNamespace(type="ipc", path="/proc/4242/ns/ipc"),
            ]
        ),
    )


def test_host_network_pod_has_no_network_namespace() -> None:
    pod = make_pod(network_mode=NamespaceMode.NODE, pid_mode=NamespaceMode.POD, ns_process=None)
    message = pod_sandbox(pod, netns_path="/proc/1/ns/net", ips=[])
    assert list(message.linux.namespaces) == []
    assert message.pid == 0
    assert list(message.ips) == []


def test_shared_pid_namespace_is_listed() -> None:
    message = pod_sandbox(make_pod(pid_mode=NamespaceMode.POD), netns_path="", ips=[])
    assert [(ns.type, ns.path) for ns in message.linux.namespaces] == [
        ("ipc", "/proc/4242/ns/ipc"),
        ("pid", "/proc/4242/ns/pid"),
    ]


def test_container_message() -> None:
    message = container(make_container())
    assert message == api.Container(
        id="ctr1",
        pod_sandbox_id="pod1",
        name="app",
        state=api.CONTAINER_STOPPED,
        labels={"l": "1"},
        annotations={"a": "1"},
        args=["/bin/sh", "-c", "sleep 1"],
        env=["PATH=/bin", "FOO=1"],
        mounts=[
            api.Mount(
                destination="/data",
                type="bind",
                source="/srv/data",
                options=["rbind", "rprivate", "rw"],
            ),
            api.Mount(
                destination="/ro", type="bind", source="/srv/ro", options=["rbind", "rslave", "ro"]
            ),
        ],
        pid=5151,
        created_at=11,
        started_at=22,
        finished_at=33,
        exit_code=137,
        status_reason="Error",
        status_message="killed",
    )


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        (ContainerState.CREATED, api.CONTAINER_CREATED),
        (ContainerState.RUNNING, api.CONTAINER_RUNNING),
        (ContainerState.EXITED, api.CONTAINER_STOPPED),
        (ContainerState.UNKNOWN, api.CONTAINER_UNKNOWN),
    ],
)
def test_container_states(state: ContainerState, expected: int) -> None:
    assert container(make_container(state=state, process=None)).state == expected


@pytest.mark.parametrize(
    ("readonly", "recursive", "propagation"),
    list(
        itertools.product(
            [False, True],
            [False, True],
            [
                cri.PROPAGATION_PRIVATE,
                cri.PROPAGATION_HOST_TO_CONTAINER,
                cri.PROPAGATION_BIDIRECTIONAL,
            ],
        )
    ),
)
def test_mounts_round_trip(readonly: bool, recursive: bool, propagation: int) -> None:
    spec_mount = cri_mount(
        container_path="/c",
        host_path="/h",
        readonly=readonly or recursive,
        recursive_read_only=recursive,
        propagation=propagation,
    )
    assert mount_from_nri(mount_to_nri(spec_mount)) == spec_mount


# ----------------------------------------------------------------------------- back to the spec


def test_apply_adjustment() -> None:
    record = make_container()
    annotations = {"a": "1", "gone": "x"}
    adjust = api.ContainerAdjustment(
        env=[
            api.KeyValue(key="-FOO"),
            api.KeyValue(key="NEW", value="v"),
            api.KeyValue(key="PATH", value="/usr/bin"),
        ],
        args=["/bin/true", "--flag"],
        mounts=[
            api.Mount(destination="-/ro"),
            api.Mount(destination="/data", type="bind", source="/other", options=["rbind", "ro"]),
            api.Mount(
                destination="/extra", type="bind", source="/srv/x", options=["rbind", "rshared"]
            ),
        ],
        annotations={"-gone": "", "b": "2"},
    )
    apply_adjustment(record.spec, annotations, adjust)
    assert record.spec.envs == {"PATH": "/usr/bin", "NEW": "v"}
    assert (record.spec.command, record.spec.args) == (["/bin/true", "--flag"], [])
    assert record.spec.mounts == [
        cri_mount(container_path="/data", host_path="/other", readonly=True),
        cri_mount(
            container_path="/extra",
            host_path="/srv/x",
            propagation=cri.PROPAGATION_BIDIRECTIONAL,
        ),
    ]
    assert annotations == {"a": "1", "b": "2"}


def test_removal_then_set_in_one_adjustment_sets() -> None:
    spec = ContainerSpec(envs={"FOO": "old"})
    annotations = {"k": "old"}
    adjust = api.ContainerAdjustment(
        env=[api.KeyValue(key="FOO", value="new"), api.KeyValue(key="-FOO")],
        annotations={"k": "new", "-k": ""},
    )
    apply_adjustment(spec, annotations, adjust)
    assert spec.envs == {"FOO": "new"}
    assert annotations == {"k": "new"}


def test_empty_adjustment_changes_nothing() -> None:
    record = make_container()
    before = (dict(record.spec.envs), list(record.spec.command), list(record.spec.mounts))
    annotations = {"a": "1"}
    apply_adjustment(record.spec, annotations, api.ContainerAdjustment())
    assert (record.spec.envs, record.spec.command, record.spec.mounts) == before
    assert annotations == {"a": "1"}


def test_args_replacement_marker_is_not_an_argument() -> None:
    spec = ContainerSpec(command=["/a"], args=["x"])
    apply_adjustment(spec, {}, api.ContainerAdjustment(args=["", "/b", "y"]))
    assert (spec.command, spec.args) == (["/b", "y"], [])
