"""Registry answers a real registry never gives: a small scripted HTTP server on loopback.

The client is real; only the server is scripted, so each hostile or unusual answer (a
digest header that lies, an oversized manifest, a type that contradicts the body, a
redirect to another host) can be produced on purpose.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from podgate.images.config import Credentials, RegistryConfig, RegistryHost
from podgate.images.content import ContentStore
from podgate.images.manifests import OCI_INDEX, OCI_MANIFEST, Descriptor
from podgate.images.reference import parse_normalized
from podgate.images.registry import (
    MAX_MANIFEST_BYTES,
    AuthError,
    RegistryClient,
    VerificationError,
)

BLOB = b"layer bytes " * 1000
BLOB_DIGEST = "sha256:" + hashlib.sha256(BLOB).hexdigest()


@dataclass
class Script:
    """path → (status, headers, body); every request's path and headers are recorded."""

    routes: dict[str, tuple[int, dict[str, str], bytes]] = field(default_factory=dict)
    seen: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None
    # When set, a request without exactly this Authorization gets a Basic challenge.
    authorization: str | None = None

    @property
    def host(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def scripted() -> Iterator[tuple[Script, Script]]:
    """Two servers: the registry and the storage it redirects to."""
    scripts = (Script(), Script())
    for script in scripts:

        class Handler(BaseHTTPRequestHandler):
            owner = script

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                self.owner.seen.append((path, dict(self.headers.items())))
                status, headers, body = self.owner.routes.get(path, (404, {}, b"{}"))
                wanted = self.owner.authorization
                if wanted is not None and self.headers.get("Authorization") != wanted:
                    status, headers, body = 401, {"WWW-Authenticate": 'Basic realm="r"'}, b"{}"
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        script.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=script.server.serve_forever, daemon=True).start()
    try:
        yield scripts
    finally:
        for script in scripts:
            assert script.server is not None
            script.server.shutdown()
            script.server.server_close()


def _manifest() -> bytes:
    return json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": BLOB_DIGEST,
                "size": len(BLOB),
            },
            "layers": [],
        }
    ).encode()


async def _fetch(host: str, obj: str, config: RegistryConfig | None = None) -> None:
    ref = parse_normalized(f"{host}/x/y:{obj}")
    async with RegistryClient(config) as client:
        [ep] = client.endpoints(ref)
        await client.fetch_manifest(ep, ref.path, ref.object, ref.domain)


async def test_lying_digest_header_is_refused(scripted: tuple[Script, Script]) -> None:
    registry, _ = scripted
    body = _manifest()
    registry.routes["/v2/x/y/manifests/t"] = (
        200,
        {"Content-Type": OCI_MANIFEST, "Docker-Content-Digest": "sha256:" + "0" * 64},
        body,
    )
    with pytest.raises(VerificationError, match="Docker-Content-Digest"):
        await _fetch(registry.host, "t")


async def test_manifest_body_of_another_digest_is_refused(scripted: tuple[Script, Script]) -> None:
    registry, _ = scripted
    wanted = "sha256:" + "1" * 64
    registry.routes[f"/v2/x/y/manifests/{wanted}"] = (
        200,
        {"Content-Type": OCI_MANIFEST},
        _manifest(),
    )
    ref = parse_normalized(f"{registry.host}/x/y@{wanted}")
    async with RegistryClient() as client:
        [ep] = client.endpoints(ref)
        with pytest.raises(VerificationError, match="refused"):
            await client.fetch_manifest(ep, ref.path, ref.object, ref.domain)


async def test_oversized_manifest_is_refused(scripted: tuple[Script, Script]) -> None:
    registry, _ = scripted
    registry.routes["/v2/x/y/manifests/big"] = (
        200,
        {"Content-Type": OCI_MANIFEST},
        b" " * (MAX_MANIFEST_BYTES + 1),
    )
    with pytest.raises(VerificationError, match="larger than"):
        await _fetch(registry.host, "big")


async def test_index_served_as_a_manifest_is_refused(scripted: tuple[Script, Script]) -> None:
    registry, _ = scripted
    index = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": []}).encode()
    registry.routes["/v2/x/y/manifests/mixed"] = (200, {"Content-Type": OCI_MANIFEST}, index)
    with pytest.raises(VerificationError, match="expected manifest but found index"):
        await _fetch(registry.host, "mixed")


async def test_blob_redirect_to_storage_carries_no_credentials(
    scripted: tuple[Script, Script], tmp_path: Path
) -> None:
    registry, storage = scripted
    basic = "Basic " + base64.b64encode(b"u:p").decode()
    registry.authorization = basic
    registry.routes[f"/v2/x/y/blobs/{BLOB_DIGEST}"] = (
        307,
        {"Location": f"http://{storage.host}/storage/blob?sig=1"},
        b"",
    )
    storage.routes["/storage/blob"] = (200, {"Content-Type": "application/octet-stream"}, BLOB)
    # The registry asks for basic auth on /v2/ requests; storage does not.
    config = RegistryConfig(
        {registry.host: RegistryHost(registry.host, credentials=Credentials("u", "p"))}
    )
    store = ContentStore(tmp_path / "c")
    ref = parse_normalized(f"{registry.host}/x/y:t")
    async with RegistryClient(config) as client:
        [ep] = client.endpoints(ref)
        desc = Descriptor("application/octet-stream", BLOB_DIGEST, len(BLOB))
        path = await client.fetch_blob(ep, ref.path, desc, store, ref.domain)
    assert path.read_bytes() == BLOB
    # Challenged once, then the credentials; the storage host never sees them.
    assert [h.get("Authorization") for p, h in registry.seen] == [None, basic]
    [(_, storage_headers)] = storage.seen
    assert "Authorization" not in storage_headers


async def test_forbidden_is_an_auth_error_naming_the_registry(
    scripted: tuple[Script, Script],
) -> None:
    registry, _ = scripted
    registry.routes["/v2/x/y/manifests/t"] = (
        403,
        {"Content-Type": "application/json"},
        json.dumps(
            {
                "errors": [
                    {"code": "DENIED", "message": "requested access to the resource is denied"}
                ]
            }
        ).encode(),
    )
    with pytest.raises(AuthError) as info:
        await _fetch(registry.host, "t")
    assert registry.host in str(info.value)
    assert "DENIED: requested access to the resource is denied" in str(info.value)
