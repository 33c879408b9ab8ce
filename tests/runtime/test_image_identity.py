"""How a container reports its image, and which signal stops it (no processes involved)."""

from __future__ import annotations

import signal

import pytest

from podgate.model import ContainerMetadata, ContainerRecord, ContainerSpec, ContainerState
from podgate.runtime.cri import convert
from podgate.runtime.runtime import _stop_signal

IMAGE_ID = "sha256:" + "ab" * 32
REPO_DIGEST = "localhost/podgate/hello@sha256:" + "cd" * 32


def record(spec: ContainerSpec) -> ContainerRecord:
    return ContainerRecord(
        id="c" * 64,
        pod_id="p" * 64,
        metadata=ContainerMetadata("web"),
        spec=spec,
        state=ContainerState.RUNNING,
        created_at=1,
    )


def test_status_names_the_stores_image_not_the_requested_string() -> None:
    # The kubelet creates by ID; the status carries the tag, the repo digest and the ID.
    spec = ContainerSpec(
        image=IMAGE_ID,
        image_id=IMAGE_ID,
        image_ref=REPO_DIGEST,
        image_name="localhost/podgate/hello:latest",
    )
    status = convert.container_status(record(spec))
    assert status.image.image == "localhost/podgate/hello:latest"
    assert (status.image_ref, status.image_id) == (REPO_DIGEST, IMAGE_ID)
    listed = convert.container(record(spec))
    assert (listed.image.image, listed.image_ref, listed.image_id) == (
        "localhost/podgate/hello:latest",
        REPO_DIGEST,
        IMAGE_ID,
    )


def test_status_without_a_stored_image_repeats_the_reference() -> None:
    status = convert.container_status(record(ContainerSpec(image="/srv/root", command=["sh"])))
    assert (status.image.image, status.image_ref, status.image_id) == ("/srv/root",) * 3


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (None, signal.SIGTERM),
        ("", signal.SIGTERM),
        ("SIGQUIT", signal.SIGQUIT),
        ("usr1", signal.SIGUSR1),
        ("9", signal.SIGKILL),
        ("SIGNOPE", signal.SIGTERM),  # not a signal: containerd's default
        ("999", signal.SIGTERM),
    ],
)
def test_stop_signal_from_the_image_config(name: str | None, expected: signal.Signals) -> None:
    assert _stop_signal(name) is expected
