"""Reference normalisation: the table of the shared reference docs and the names critest uses."""

from __future__ import annotations

import pytest

from podgate.images.reference import InvalidReferenceError, is_image_id, parse, parse_normalized

H = "9700f9a2f5bf2c45f2f605a0bd3bce7cf37420ec9d3ed50ac2758413308766bf"
CT = "gcr.io/k8s-staging-cri-tools"

NORMALISED = [
    ("busybox", "docker.io/library/busybox:latest"),
    ("busybox:1.36", "docker.io/library/busybox:1.36"),
    ("library/busybox", "docker.io/library/busybox:latest"),
    ("docker.io/busybox", "docker.io/library/busybox:latest"),
    ("index.docker.io/busybox", "docker.io/library/busybox:latest"),
    ("myorg/app:v1", "docker.io/myorg/app:v1"),
    ("localhost/app", "localhost/app:latest"),
    ("localhost:5000/app", "localhost:5000/app:latest"),
    ("localhost:5000/x", "localhost:5000/x:latest"),
    (
        "127.0.0.1:5000/e2e-test-images/busybox:1.29-2",
        "127.0.0.1:5000/e2e-test-images/busybox:1.29-2",
    ),
    ("registry.k8s.io/pause:3.10", "registry.k8s.io/pause:3.10"),
    (
        "registry.k8s.io/e2e-test-images/busybox:1.29-2",
        "registry.k8s.io/e2e-test-images/busybox:1.29-2",
    ),
    (f"{CT}/test-image-latest", f"{CT}/test-image-latest:latest"),
    (f"{CT}/test-image-tag:test", f"{CT}/test-image-tag:test"),
    (f"{CT}/test-image-tags:2", f"{CT}/test-image-tags:2"),
    (f"{CT}/test-image-user-uid-group", f"{CT}/test-image-user-uid-group:latest"),
    (f"{CT}/test-image-digest@sha256:{H}", f"{CT}/test-image-digest@sha256:{H}"),
    (f"busybox:1.36@sha256:{H}", f"docker.io/library/busybox@sha256:{H}"),
    (f"busybox@sha256:{H}", f"docker.io/library/busybox@sha256:{H}"),
    ("org/a.b-c_d__e---f", "docker.io/org/a.b-c_d__e---f:latest"),
    ("[::1]:5000/img:v", "[::1]:5000/img:v"),
    ("Registry.Example/x", "Registry.Example/x:latest"),
]


@pytest.mark.parametrize(("given", "want"), NORMALISED)
def test_normalised(given: str, want: str) -> None:
    assert str(parse_normalized(given)) == want
    # Normalisation is idempotent.
    assert str(parse_normalized(want)) == want


def test_parts() -> None:
    r = parse(f"localhost:5000/a/b:t@sha256:{H}")
    assert (r.domain, r.path, r.tag, r.digest) == ("localhost:5000", "a/b", "t", f"sha256:{H}")
    assert r.name == "localhost:5000/a/b"
    n = parse_normalized(str(r))
    assert n.tag is None and n.object == f"sha256:{H}"
    assert parse_normalized("busybox").object == "latest"


BAD = [
    ("", "empty"),
    ("Busybox", "must be lowercase"),
    ("docker.io/Library/busybox", "must be lowercase"),
    ("localhost:5000/App", "must be lowercase"),
    (H, "64-byte hexadecimal"),
    ("busybox:", "invalid reference format"),
    ("busybox:-tag", "invalid reference format"),
    ("busybox:" + "t" * 129, "invalid reference format"),
    ("bus//box", "invalid reference format"),
    ("bus box", "invalid reference format"),
    ("busybox@sha256:abc", "invalid reference format"),
    (f"busybox@sha256:{H.upper()}", "invalid checksum digest"),
    (f"busybox@sha256:{H}@sha256:{H}", "invalid reference format"),
    ("-busybox", "invalid reference format"),
    ("x_y.z/a", "invalid reference format"),
    ("busybox_", "invalid reference format"),
    ("x/" + "a" * 255, "more than 255"),
]


@pytest.mark.parametrize(("given", "why"), BAD)
def test_rejected(given: str, why: str) -> None:
    with pytest.raises(InvalidReferenceError, match=why):
        parse_normalized(given)


def test_image_ids() -> None:
    assert is_image_id(f"sha256:{H}")
    assert not is_image_id(H)
    assert not is_image_id("busybox")
    assert not is_image_id(f"sha256:{H[:-1]}")
