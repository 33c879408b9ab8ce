"""Sans-IO parts of the registry side: the config file, challenges, manifests, platforms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from podgate.images.challenge import (
    DEFAULT_TOKEN_LIFETIME_SECONDS,
    ChallengeError,
    parse_challenges,
    parse_token_response,
)
from podgate.images.config import ConfigError, is_loopback, load_config, parse_config
from podgate.images.manifests import (
    DOCKER_MANIFEST,
    DOCKER_MANIFEST_LIST,
    OCI_INDEX,
    OCI_MANIFEST,
    ManifestError,
    detect_type,
)
from podgate.images.platforms import Platform, choose, host_platform, normalize

DIGEST = "sha256:" + "a" * 64


def test_full_config_example(tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_text("not checked here")
    path = tmp_path / "runtime.toml"
    path.write_text(
        """
[images]
max_concurrent_downloads = 4
max_layer_bytes = 1073741824

[registries."docker.io"]
mirrors = ["http://127.0.0.1:5000", { url = "https://127.0.0.1:5443", ca_file = "ca.pem" }]
origin = false

[registries."registry.internal:5443"]
ca_file = "ca.pem"
username = "puller"
password = "secret"
"""
    )
    cfg = load_config(path)
    assert cfg.images.max_concurrent_downloads == 4
    assert cfg.images.max_layer_bytes == 1 << 30
    hub = cfg.registries.host("docker.io")
    assert [str(e) for e in hub.endpoints()] == ["http://127.0.0.1:5000", "https://127.0.0.1:5443"]
    assert hub.mirrors[1].ca_file == str(tmp_path / "ca.pem")
    internal = cfg.registries.host("registry.internal:5443")
    assert [str(e) for e in internal.endpoints()] == ["https://registry.internal:5443"]
    assert internal.credentials.username == "puller"
    assert "secret" not in repr(internal.credentials)
    # Unconfigured hosts: the origin only; Docker Hub's API host for docker.io.
    assert [str(e) for e in cfg.registries.host("quay.io").endpoints()] == ["https://quay.io"]
    assert [str(e) for e in parse_config("").registries.host("docker.io").endpoints()] == [
        "https://registry-1.docker.io"
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[images]\nmax_concurrent_downloads = 0", "images.max_concurrent_downloads: must be"),
        ("[images]\nmax_concurrent_downloads = true", "images.max_concurrent_downloads: must be"),
        ("[images]\ncolour = 1", "images.colour: unknown key"),
        ("[other]\n", "other: unknown key"),
        (
            '[registries."docker.io"]\nmirrors = "x"',
            'registries."docker.io".mirrors: must be a list',
        ),
        (
            '[registries."docker.io"]\nmirrors = ["http://mirror.internal:5000"]',
            "registries.\"docker.io\".mirrors[0].url: 'http://mirror.internal:5000' is plain HTTP",
        ),
        (
            '[registries."docker.io"]\nmirrors = [{ url = "https://m", ca_file = "missing.pem" }]',
            'registries."docker.io".mirrors[0].ca_file: ',
        ),
        ('[registries."docker.io"]\norigin = false', "origin: false, but no mirrors"),
        (
            '[registries."r.io"]\npassword = "x"',
            'registries."r.io".password: given without username',
        ),
        (
            '[registries."r.io"]\ninsecure = "yes"',
            'registries."r.io".insecure: must be true or false',
        ),
        ('[registries."r.io/path"]\n', "a registry is named by host[:port] only"),
        ("[images\n", "not valid TOML"),
    ],
)
def test_config_errors_name_the_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: ")
    assert message in str(info.value)


def test_insecure_allows_plain_http_to_any_host() -> None:
    cfg = parse_config(
        '[registries."docker.io"]\nmirrors = [{ url = "http://mirror.internal", insecure = true }]'
    )
    [mirror, _origin] = cfg.registries.host("docker.io").endpoints()
    assert mirror.scheme == "http" and mirror.plain_http_allowed


def test_loopback_names() -> None:
    assert is_loopback("127.0.0.1:5000")
    assert is_loopback("127.3.4.5")
    assert is_loopback("localhost:443")
    assert is_loopback("[::1]:5000")
    assert not is_loopback("10.0.0.1:5000")
    assert not is_loopback("registry.internal")


def test_challenges() -> None:
    [bearer] = parse_challenges(
        [
            'Bearer realm="https://auth.example/token",service="registry.example",'
            'scope="repository:library/busybox:pull"'
        ]
    )
    assert bearer.scheme == "bearer"
    assert bearer.params == {
        "realm": "https://auth.example/token",
        "service": "registry.example",
        "scope": "repository:library/busybox:pull",
    }
    basic, second = parse_challenges(['Basic realm="r \\"quoted\\""', "Bearer realm=x"])
    assert basic.scheme == "basic" and basic.params["realm"] == 'r "quoted"'
    assert second.params == {"realm": "x"}


def test_token_responses() -> None:
    token = parse_token_response(b'{"access_token": "abc", "expires_in": 300}', now=100.0)
    assert token.value == "abc" and token.expires_at == 400.0
    assert (
        parse_token_response(b'{"token": "t"}', now=0.0).expires_at
        == DEFAULT_TOKEN_LIFETIME_SECONDS
    )
    with pytest.raises(ChallengeError):
        parse_token_response(b"{}")
    with pytest.raises(ChallengeError):
        parse_token_response(b"<html>")


def _manifest(**extra: object) -> bytes:
    doc = {
        "schemaVersion": 2,
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": DIGEST,
            "size": 1,
        },
        "layers": [],
        **extra,
    }
    return json.dumps(doc).encode()


def test_media_type_detection_follows_containerd() -> None:
    index = json.dumps({"schemaVersion": 2, "manifests": []}).encode()
    assert detect_type(OCI_MANIFEST, _manifest()) == OCI_MANIFEST
    assert detect_type(DOCKER_MANIFEST + "; charset=utf-8", _manifest()) == DOCKER_MANIFEST
    assert detect_type("application/json", _manifest(mediaType=DOCKER_MANIFEST)) == DOCKER_MANIFEST
    assert detect_type("", index) == OCI_INDEX
    assert detect_type(DOCKER_MANIFEST_LIST, index) == DOCKER_MANIFEST_LIST
    with pytest.raises(ManifestError, match="expected manifest but found index"):
        detect_type(OCI_MANIFEST, index)
    with pytest.raises(ManifestError, match="expected index but found manifest"):
        detect_type(OCI_INDEX, _manifest())
    with pytest.raises(ManifestError, match="schema 1 not supported"):
        detect_type("application/json", json.dumps({"fsLayers": []}).encode())
    with pytest.raises(ManifestError, match="not JSON"):
        detect_type(OCI_MANIFEST, b"\xff")


def test_platform_choice() -> None:
    amd64 = normalize("linux", "x86_64")
    assert amd64 == Platform("linux", "amd64")
    candidates = [
        Platform("unknown", "unknown"),
        Platform("linux", "386"),
        Platform("linux", "arm64"),
        Platform("linux", "amd64"),
        None,
    ]
    assert choose(candidates, amd64) == 3
    assert choose(candidates[:3], amd64) == 1  # 386 runs on amd64
    arm64 = host_platform("aarch64")
    assert arm64 == Platform("linux", "arm64", "v8")
    assert choose([Platform("linux", "arm", "v7"), Platform("linux", "arm64")], arm64) == 1
    assert choose([Platform("linux", "arm", "v6"), Platform("linux", "arm", "v7")], arm64) == 1
    assert choose([Platform("linux", "s390x")], amd64) is None
    # Ties keep index order.
    assert choose([Platform("linux", "amd64"), Platform("linux", "amd64")], amd64) == 0


def test_the_readme_example_is_a_valid_config(tmp_path: Path) -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("### Registries") :]
    block = section[section.index("```toml\n") + len("```toml\n") :]
    text = block[: block.index("```")]
    (tmp_path / "mirror-ca.pem").write_text("ca")
    (tmp_path / "registry-ca.pem").write_text("ca")
    text = text.replace("/etc/podgate/registry-ca.pem", str(tmp_path / "registry-ca.pem"))
    path = tmp_path / "runtime.toml"
    path.write_text(text)
    cfg = load_config(path)
    hub = cfg.registries.host("docker.io")
    assert [str(e) for e in hub.endpoints()] == [
        "http://127.0.0.1:5000",
        "https://mirror.internal:5443",
    ]
    assert hub.mirrors[1].credentials.username == "m"
    assert cfg.registries.host("legacy.internal:5000").insecure
