"""The registry client against real docker-registry instances on loopback.

Plain HTTP (anonymous), TLS with a test CA + htpasswd basic auth, and token auth with the
tests' token server. Every blob that lands in the content store is checked by sha256.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from registry_support import (
    OCI_INDEX,
    LoopbackCA,
    Pusher,
    Registry,
    TokenServer,
    busybox_image,
    make_index,
    push_image,
    running_registry,
)

from podgate.images.config import (
    Credentials,
    Endpoint,
    RegistryConfig,
    RegistryHost,
)
from podgate.images.content import ContentStore
from podgate.images.manifests import DOCKER_MANIFEST, OCI_MANIFEST, parse_index, parse_manifest
from podgate.images.platforms import Platform, choose, host_platform
from podgate.images.reference import parse_normalized
from podgate.images.registry import (
    AuthError,
    NotFoundError,
    RegistryClient,
    UnavailableError,
    VerificationError,
)

USER, PASSWORD = "puller", "s3cret-pass"


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with running_registry(tmp_path_factory.mktemp("plain") / "reg") as reg:
        yield reg


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> LoopbackCA:
    return LoopbackCA.create(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def tls_basic(tmp_path_factory: pytest.TempPathFactory, ca: LoopbackCA) -> Iterator[Registry]:
    root = tmp_path_factory.mktemp("tls") / "reg"
    with running_registry(root, tls=ca, users={USER: PASSWORD}) as reg:
        yield reg


@pytest.fixture(scope="module")
def token_registry(tmp_path_factory: pytest.TempPathFactory, ca: LoopbackCA) -> Iterator[Registry]:
    server = TokenServer(ca, {USER: PASSWORD})
    server.start()
    try:
        with running_registry(tmp_path_factory.mktemp("tok") / "reg", token=server) as reg:
            yield reg
    finally:
        server.stop()


class Recorder:
    """Every request the client sends and every answer's status (a RegistryClient observer)."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []
        self.answers: list[tuple[httpx.Request, int]] = []

    def request(self, request: httpx.Request) -> None:
        self.requests.append(request)

    def response(self, response: httpx.Response) -> None:
        self.answers.append((response.request, response.status_code))

    def statuses(self) -> list[int]:
        return [status for _, status in self.answers]


def _store_is_empty(store: ContentStore) -> bool:
    return not store.digests() and not store.ingests()


async def _pull_blobs(
    client: RegistryClient, ref_text: str, store: ContentStore, creds: Credentials | None = None
) -> tuple[str, str]:
    ref = parse_normalized(ref_text)
    ep = client.endpoints(ref, creds)[0]
    fetched = await client.fetch_manifest(ep, ref.path, ref.object, ref.domain)
    manifest = parse_manifest(fetched.body, fetched.media_type)
    for desc in (manifest.config, *manifest.layers):
        path = await client.fetch_blob(ep, ref.path, desc, store, ref.domain)
        assert "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest() == desc.digest
        assert path.stat().st_size == desc.size
    return fetched.digest, fetched.media_type


@pytest.mark.parametrize("docker", [False, True], ids=["oci", "docker-schema2"])
async def test_plain_http_pull_by_tag_and_digest(
    plain: Registry, tmp_path: Path, docker: bool
) -> None:
    image = busybox_image(docker=docker, label=f"tag-{docker}")
    push_image(plain, "test/bytag", f"v-{docker}", image)
    store = ContentStore(tmp_path / "content")
    async with RegistryClient() as client:
        digest, media_type = await _pull_blobs(client, f"{plain.host}/test/bytag:v-{docker}", store)
        assert digest == image.digest
        assert media_type == (DOCKER_MANIFEST if docker else OCI_MANIFEST)
        by_digest, _ = await _pull_blobs(
            client, f"{plain.host}/test/bytag@{image.digest}", ContentStore(tmp_path / "c2")
        )
        assert by_digest == image.digest
    assert set(store.digests()) == {d for d, _ in image.blobs()}
    assert store.ingests() == []


async def test_missing_tag_is_not_found(plain: Registry) -> None:
    ref = parse_normalized(f"{plain.host}/test/nothing:here")
    async with RegistryClient() as client:
        [ep] = client.endpoints(ref)
        with pytest.raises(NotFoundError, match="here: not found"):
            await client.fetch_manifest(ep, ref.path, ref.object, ref.domain)


async def test_index_selects_the_host_platform(plain: Registry, tmp_path: Path) -> None:
    node = host_platform()
    foreign = "arm64" if node.architecture != "arm64" else "amd64"
    native_img = busybox_image(architecture=node.architecture, label="native")
    foreign_img = busybox_image(architecture=foreign, label="foreign")
    index = make_index([foreign_img, native_img])
    pusher = Pusher(plain)
    try:
        pusher.index("test/multi", "v1", index)
    finally:
        pusher.close()
    ref = parse_normalized(f"{plain.host}/test/multi:v1")
    async with RegistryClient() as client:
        [ep] = client.endpoints(ref)
        fetched = await client.fetch_manifest(ep, ref.path, ref.object, ref.domain)
        assert fetched.media_type == OCI_INDEX
        assert fetched.digest == index.digest
        parsed = parse_index(fetched.body, fetched.media_type)
        chosen = choose([d.platform for d in parsed.manifests], node)
        assert chosen == 1
        assert parsed.manifests[0].platform == Platform("linux", foreign)
        inner = await client.fetch_manifest(
            ep, ref.path, parsed.manifests[chosen].digest, ref.domain
        )
        assert inner.digest == native_img.digest


async def test_tls_basic_auth_with_the_configured_ca(
    tls_basic: Registry, ca: LoopbackCA, tmp_path: Path
) -> None:
    image = busybox_image(label="tls")
    push_image(tls_basic, "test/tls", "v1", image, username=USER, password=PASSWORD)
    config = RegistryConfig(
        {
            tls_basic.host: RegistryHost(
                tls_basic.host, ca_file=str(ca.ca_file), credentials=Credentials(USER, PASSWORD)
            )
        }
    )
    store = ContentStore(tmp_path / "content")
    recorder = Recorder()
    async with RegistryClient(config, observer=recorder) as client:
        digest, _ = await _pull_blobs(client, f"{tls_basic.host}/test/tls:v1", store)
    assert digest == image.digest
    assert all(r.url.scheme == "https" for r in recorder.requests)
    # One challenge, then every request carries the credentials up front.
    assert recorder.statuses().count(401) == 1


async def test_tls_wrong_password_names_the_registry(
    tls_basic: Registry, ca: LoopbackCA, tmp_path: Path
) -> None:
    push_image(
        tls_basic, "test/tls", "v1", busybox_image(label="tls"), username=USER, password=PASSWORD
    )
    config = RegistryConfig(
        {
            tls_basic.host: RegistryHost(
                tls_basic.host, ca_file=str(ca.ca_file), credentials=Credentials(USER, "wrong")
            )
        }
    )
    store = ContentStore(tmp_path / "content")
    async with RegistryClient(config) as client:
        with pytest.raises(AuthError) as info:
            await _pull_blobs(client, f"{tls_basic.host}/test/tls:v1", store)
    assert tls_basic.host in str(info.value)
    assert "pull access denied" in str(info.value)
    assert info.value.registry == tls_basic.host
    assert _store_is_empty(store)


async def test_tls_without_credentials_is_refused(
    tls_basic: Registry, ca: LoopbackCA, tmp_path: Path
) -> None:
    config = RegistryConfig({tls_basic.host: RegistryHost(tls_basic.host, ca_file=str(ca.ca_file))})
    async with RegistryClient(config) as client:
        with pytest.raises(AuthError, match=tls_basic.host):
            await _pull_blobs(client, f"{tls_basic.host}/test/tls:v1", ContentStore(tmp_path / "c"))


async def test_tls_unknown_ca_fails_without_plain_http_fallback(
    tls_basic: Registry, tmp_path: Path
) -> None:
    recorder = Recorder()
    async with RegistryClient(observer=recorder) as client:
        with pytest.raises(UnavailableError, match="CERTIFICATE_VERIFY_FAILED"):
            await _pull_blobs(
                client,
                f"{tls_basic.host}/test/tls:v1",
                ContentStore(tmp_path / "c"),
                Credentials(USER, PASSWORD),
            )
    assert [r.url.scheme for r in recorder.requests] == ["https"]


async def test_token_auth_pulls_and_caches_the_token(
    token_registry: Registry, tmp_path: Path
) -> None:
    image = busybox_image(label="token")
    push_image(token_registry, "test/tok", "v1", image, username=USER, password=PASSWORD)
    server = token_registry.token_server
    assert server is not None
    before = len(server.requests)
    config = RegistryConfig(
        {
            token_registry.host: RegistryHost(
                token_registry.host, credentials=Credentials(USER, PASSWORD)
            )
        }
    )
    store = ContentStore(tmp_path / "content")
    async with RegistryClient(config) as client:
        digest, _ = await _pull_blobs(client, f"{token_registry.host}/test/tok:v1", store)
        assert digest == image.digest
        # Manifest + config + two layers on one token.
        issued = server.requests[before:]
        assert [r["ok"] for r in issued] == [True]
        assert issued[0]["user"] == USER
        assert issued[0]["scope"] == ["repository:test/tok:pull"]


async def test_token_auth_wrong_password_names_the_registry(
    token_registry: Registry, tmp_path: Path
) -> None:
    config = RegistryConfig(
        {
            token_registry.host: RegistryHost(
                token_registry.host, credentials=Credentials(USER, "nope")
            )
        }
    )
    store = ContentStore(tmp_path / "content")
    async with RegistryClient(config) as client:
        with pytest.raises(AuthError) as info:
            await _pull_blobs(client, f"{token_registry.host}/test/tok:v1", store)
    assert token_registry.host in str(info.value)
    assert "token server refused" in str(info.value)
    assert _store_is_empty(store)


async def test_request_credentials_override_and_registry_token(
    token_registry: Registry, tmp_path: Path
) -> None:
    push_image(
        token_registry,
        "test/tok",
        "v1",
        busybox_image(label="token"),
        username=USER,
        password=PASSWORD,
    )
    server = token_registry.token_server
    assert server is not None
    bearer = server.sign(USER, [{"type": "repository", "name": "test/tok", "actions": ["pull"]}])
    before = len(server.requests)
    async with RegistryClient() as client:
        await _pull_blobs(
            client,
            f"{token_registry.host}/test/tok:v1",
            ContentStore(tmp_path / "c"),
            Credentials(registry_token=bearer),
        )
    # A registry token is used as it is: the token server is not asked.
    assert len(server.requests) == before


async def test_tampered_blob_is_refused_and_nothing_is_stored(
    plain: Registry, tmp_path: Path
) -> None:
    image = busybox_image(label="tampered")
    push_image(plain, "test/tampered", "v1", image)
    layer = image.layers[1]  # its own layer: the busybox one is shared with other tests
    data_file = plain.blob_data_path(layer.digest)
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    store = ContentStore(tmp_path / "content")
    ref = parse_normalized(f"{plain.host}/test/tampered:v1")
    async with RegistryClient() as client:
        [ep] = client.endpoints(ref)
        fetched = await client.fetch_manifest(ep, ref.path, ref.object, ref.domain)
        manifest = parse_manifest(fetched.body, fetched.media_type)
        assert manifest.layers[1].digest == layer.digest
        with pytest.raises(VerificationError, match="digest mismatch"):
            await client.fetch_blob(ep, ref.path, manifest.layers[1], store, ref.domain)
    assert _store_is_empty(store)


async def test_partial_ingest_resumes_with_range(plain: Registry, tmp_path: Path) -> None:
    image = busybox_image(label="resume")
    push_image(plain, "test/resume", "v1", image)
    layer = image.layers[0]
    store = ContentStore(tmp_path / "content")
    half = len(layer.blob) // 2
    writer = store.writer(layer.digest, len(layer.blob))
    writer.write(layer.blob[:half])
    writer.abort()  # kept for resume
    ref = parse_normalized(f"{plain.host}/test/resume:v1")
    recorder = Recorder()
    seen: list[int] = []
    async with RegistryClient(observer=recorder) as client:
        [ep] = client.endpoints(ref)
        fetched = await client.fetch_manifest(ep, ref.path, ref.object, ref.domain)
        desc = parse_manifest(fetched.body, fetched.media_type).layers[0]
        path = await client.fetch_blob(ep, ref.path, desc, store, ref.domain, seen.append)
    assert path.read_bytes() == layer.blob
    [(blob_request, status)] = [(r, s) for r, s in recorder.answers if "/blobs/" in r.url.path]
    assert blob_request.headers["Range"] == f"bytes={half}-"
    assert status == 206
    assert sum(seen) == len(layer.blob)
    assert store.ingests() == []


async def test_docker_io_mirror_without_origin_contacts_only_the_mirror(
    plain: Registry, tmp_path: Path
) -> None:
    image = busybox_image(label="mirror")
    push_image(plain, "library/busybox", "1.36", image)
    mirror = Endpoint("http", plain.host, mirror=True)
    config = RegistryConfig(
        {"docker.io": RegistryHost("docker.io", mirrors=(mirror,), origin=False)}
    )
    recorder = Recorder()
    store = ContentStore(tmp_path / "content")
    async with RegistryClient(config, observer=recorder) as client:
        ref = parse_normalized("busybox:1.36")
        assert [str(e) for e in client.endpoints(ref)] == [f"http://{plain.host}"]
        digest, _ = await _pull_blobs(client, "busybox:1.36", store)
    assert digest == image.digest
    assert recorder.requests
    assert {(r.url.host, r.url.port) for r in recorder.requests} == {("127.0.0.1", plain.port)}
    assert all(r.url.params.get("ns") == "docker.io" for r in recorder.requests)


async def test_identity_token_is_exchanged_with_an_oauth_post(
    token_registry: Registry, tmp_path: Path
) -> None:
    image = busybox_image(label="oauth")
    push_image(token_registry, "test/oauth", "v1", image, username=USER, password=PASSWORD)
    server = token_registry.token_server
    assert server is not None
    server.refresh_tokens["refresh-123"] = USER
    before = len(server.requests)
    async with RegistryClient() as client:
        digest, _ = await _pull_blobs(
            client,
            f"{token_registry.host}/test/oauth:v1",
            ContentStore(tmp_path / "c"),
            Credentials(identity_token="refresh-123"),
        )
    assert digest == image.digest
    assert server.requests[before:] == [{"user": USER, "ok": True, "post": True}]


async def test_anonymous_token_pull(token_registry: Registry, tmp_path: Path) -> None:
    image = busybox_image(label="anon")
    push_image(token_registry, "test/anon", "v1", image, username=USER, password=PASSWORD)
    server = token_registry.token_server
    assert server is not None
    before = len(server.requests)
    async with RegistryClient() as client:
        with pytest.raises(AuthError, match=token_registry.host):
            await _pull_blobs(
                client, f"{token_registry.host}/test/anon:v1", ContentStore(tmp_path / "a")
            )
    server.anonymous_pull = True
    try:
        async with RegistryClient() as client:
            digest, _ = await _pull_blobs(
                client, f"{token_registry.host}/test/anon:v1", ContentStore(tmp_path / "b")
            )
    finally:
        server.anonymous_pull = False
    assert digest == image.digest
    assert [r["user"] for r in server.requests[before:] if r["ok"]] == [""]


async def test_insecure_registry_skips_verification(tls_basic: Registry, tmp_path: Path) -> None:
    image = busybox_image(label="insecure")
    push_image(tls_basic, "test/insecure", "v1", image, username=USER, password=PASSWORD)
    config = RegistryConfig(
        {
            tls_basic.host: RegistryHost(
                tls_basic.host, insecure=True, credentials=Credentials(USER, PASSWORD)
            )
        }
    )
    recorder = Recorder()
    async with RegistryClient(config, observer=recorder) as client:
        digest, _ = await _pull_blobs(
            client, f"{tls_basic.host}/test/insecure:v1", ContentStore(tmp_path / "c")
        )
    assert digest == image.digest
    # Still TLS (the server speaks it), just unverified: no fallback to plain HTTP.
    assert {r.url.scheme for r in recorder.requests} == {"https"}


async def test_a_cached_token_is_not_reused_for_other_credentials(
    token_registry: Registry, tmp_path: Path
) -> None:
    push_image(
        token_registry,
        "test/tok",
        "v1",
        busybox_image(label="token"),
        username=USER,
        password=PASSWORD,
    )
    ref = f"{token_registry.host}/test/tok:v1"
    async with RegistryClient() as client:
        await _pull_blobs(client, ref, ContentStore(tmp_path / "a"), Credentials(USER, PASSWORD))
        with pytest.raises(AuthError, match="token server refused"):
            await _pull_blobs(client, ref, ContentStore(tmp_path / "b"), Credentials(USER, "guess"))
