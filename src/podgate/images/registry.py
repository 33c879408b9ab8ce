"""OCI distribution v2 client: resolve references, fetch manifests and blobs (httpx, asyncio).

What it does, as containerd does it:
- endpoints per registry: configured mirrors in order, then the origin (unless disabled);
- HTTPS with the system CAs plus a per-registry CA file; plain HTTP only for loopback
  registries (when the server does not speak TLS) and for registries marked insecure;
- auth: anonymous, Basic, and Bearer tokens through the `WWW-Authenticate` challenge flow,
  with tokens cached per (realm, service, scope, credentials) until they expire; once a host
  has challenged, later requests carry the header up front;
- manifests fetched with containerd's `Accept` list, bounded in size, their type checked
  against the body, their digest checked against the request or `Docker-Content-Digest`;
- blobs streamed into the content store, hashed while they arrive, resumed with `Range`
  from a partial ingest, redirects followed without leaking credentials to another host.

Every limit is a named constant below. Deadlines are the caller's (`asyncio.timeout`).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import re
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol
from urllib.parse import urlencode, urljoin, urlsplit

import httpx

from podgate.images import content
from podgate.images.challenge import (
    Challenge,
    ChallengeError,
    Token,
    parse_challenges,
    parse_token_response,
)
from podgate.images.config import Credentials, Endpoint, RegistryConfig, is_loopback
from podgate.images.manifests import ACCEPT_MANIFESTS, Descriptor, ManifestError, detect_type
from podgate.images.reference import Reference

log = logging.getLogger(__name__)

# containerd's cap on a manifest or index body: 4·1048·1048 bytes.
MAX_MANIFEST_BYTES: Final = 4 * 1048 * 1048
# A token response is a small JSON document; anything larger is refused (bytes).
MAX_TOKEN_RESPONSE_BYTES: Final = 1024 * 1024
# Bytes of an error body read to quote the registry's message.
MAX_ERROR_BODY_BYTES: Final = 64 * 1024
# Characters of the registry's error message kept in an error.
MAX_ERROR_MESSAGE_CHARS: Final = 300
# Redirects followed for one request (registries redirect blobs to storage once).
MAX_REDIRECTS: Final = 10
# TCP+TLS connection set-up, seconds.
CONNECT_TIMEOUT_SECONDS: Final = 30.0
# Longest silence while reading a response (a stalled blob stream fails, a slow one does not).
READ_TIMEOUT_SECONDS: Final = 60.0
# Sending a request (they are small), seconds.
WRITE_TIMEOUT_SECONDS: Final = 30.0
# Waiting for a pooled connection, seconds.
POOL_TIMEOUT_SECONDS: Final = 60.0
# Connections kept per client: layer downloads run in parallel, bounded by the puller.
MAX_CONNECTIONS: Final = 64
# Tokens kept per client (one per registry, repository and credentials); past this the
# expired ones go first, then the oldest: a node pulls from far fewer repositories.
MAX_CACHED_TOKENS: Final = 1024
# OAuth client id sent with refresh-token grants (containerd sends its own name).
OAUTH_CLIENT_ID: Final = "podgate"
USER_AGENT: Final = "podgate"

_REDIRECT_CODES: Final = frozenset({301, 302, 303, 307, 308})
_CONTENT_RANGE: Final = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")

ProgressCallback = Callable[[int], None]


class Observer(Protocol):
    """Sees every request sent and every response head received (metrics, tests)."""

    def request(self, request: httpx.Request) -> None: ...

    def response(self, response: httpx.Response) -> None: ...


class RegistryError(Exception):
    """A pull step failed; `registry` names the registry (host[:port]) it talked to."""

    def __init__(self, registry: str, message: str) -> None:
        super().__init__(message)
        self.registry = registry


class NotFoundError(RegistryError):
    pass


class AuthError(RegistryError):
    pass


class UnavailableError(RegistryError):
    """Connection, TLS or protocol failure: the registry could not be used at all."""


class VerificationError(RegistryError):
    """Bytes that do not match their digest or size."""


@dataclass(frozen=True, slots=True)
class FetchedManifest:
    digest: str
    media_type: str
    body: bytes


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _origin(url: httpx.URL) -> tuple[str, str, int | None]:
    return (url.scheme, url.host, url.port)


def _ssl_context(ca_file: str, insecure: bool) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    if ca_file:
        ctx.load_verify_locations(cafile=ca_file)
    if insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _speaks_plain_http(exc: BaseException) -> bool:
    """A TLS handshake that failed because the peer answered without TLS (not a bad cert)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return False
        if isinstance(seen, ssl.SSLError):
            reason = (seen.reason or "").upper()
            return reason in {"WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "HTTP_REQUEST"} or (
                "PACKET_LENGTH_TOO_LONG" in reason
            )
        seen = seen.__cause__ or seen.__context__
    return False


async def _read_limited(response: httpx.Response, limit: int) -> bytes | None:
    """The whole body, or None if it is longer than `limit` bytes."""
    chunks: list[bytes] = []
    total = 0
    async for chunk in response.aiter_bytes():
        total += len(chunk)
        if total > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


async def _error_detail(response: httpx.Response) -> str:
    """The registry's error message (distribution's `{"errors": [...]}`), bounded."""
    try:
        body = await _read_limited(response, MAX_ERROR_BODY_BYTES)
    except httpx.HTTPError:
        body = None
    text = ""
    if body:
        try:
            doc = json.loads(body)
            errors = doc.get("errors") if isinstance(doc, dict) else None
            if isinstance(errors, list) and errors and isinstance(errors[0], dict):
                text = f"{errors[0].get('code', '')}: {errors[0].get('message', '')}".strip(": ")
        except ValueError:
            text = body.decode(errors="replace").strip()
    text = text[:MAX_ERROR_MESSAGE_CHARS]
    return f"{response.status_code} {response.reason_phrase}" + (f" ({text})" if text else "")


def _denied(registry: str, detail: str) -> AuthError:
    return AuthError(
        registry,
        f"pull access denied, repository does not exist or may require authorization: "
        f"registry {registry} answered {detail}",
    )


class RegistryClient:
    """Talks to the registries of one config. Use as an async context manager."""

    def __init__(
        self,
        config: RegistryConfig | None = None,
        *,
        observer: Observer | None = None,
    ) -> None:
        self.config = config or RegistryConfig()
        self._observer = observer
        self._clients: dict[tuple[str, bool], httpx.AsyncClient] = {}
        # Endpoints found to speak plain HTTP (after the loopback fallback).
        self._plain: set[tuple[str, str]] = set()
        # The last challenge each host sent, so later requests authorise up front.
        self._challenges: dict[str, Challenge] = {}
        self._tokens: dict[tuple[str, str, str, str], Token] = {}
        self._token_locks: dict[tuple[str, str, str, str], asyncio.Lock] = {}

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            await c.aclose()

    # ------------------------------------------------------------------ endpoints

    def endpoints(self, ref: Reference, credentials: Credentials | None = None) -> list[Endpoint]:
        """Where `ref` is looked for, in order. Request credentials apply to the origin only."""
        host = self.config.host(ref.domain)
        out = []
        for ep in host.endpoints():
            if not ep.mirror and credentials:
                ep = Endpoint(
                    ep.scheme, ep.host, ep.prefix, ep.ca_file, ep.insecure, credentials, False
                )
            out.append(ep)
        return out

    def _client(self, ep: Endpoint) -> httpx.AsyncClient:
        key = (ep.ca_file, ep.insecure)
        client = self._clients.get(key)
        if client is None:
            client = httpx.AsyncClient(
                verify=_ssl_context(ep.ca_file, ep.insecure),
                timeout=httpx.Timeout(
                    connect=CONNECT_TIMEOUT_SECONDS,
                    read=READ_TIMEOUT_SECONDS,
                    write=WRITE_TIMEOUT_SECONDS,
                    pool=POOL_TIMEOUT_SECONDS,
                ),
                limits=httpx.Limits(
                    max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_CONNECTIONS
                ),
                follow_redirects=False,
                # No proxies or netrc from the environment: only what the config says.
                trust_env=False,
                headers={"User-Agent": USER_AGENT},
                event_hooks=self._hooks(),
            )
            self._clients[key] = client
        return client

    def _hooks(self) -> dict[str, list[Callable[..., Any]]]:
        observer = self._observer
        if observer is None:
            return {}

        async def on_request(request: httpx.Request) -> None:
            observer.request(request)

        async def on_response(response: httpx.Response) -> None:
            observer.response(response)

        return {"request": [on_request], "response": [on_response]}

    def _scheme(self, ep: Endpoint) -> str:
        return "http" if (ep.scheme, ep.host) in self._plain else ep.scheme

    def _url(self, ep: Endpoint, repository: str, kind: str, obj: str, registry: str) -> str:
        url = f"{ep.base_url(self._scheme(ep))}{repository}/{kind}/{obj}"
        if ep.mirror:
            # Tells a pull-through cache which upstream the repository belongs to.
            url += "?" + urlencode({"ns": registry})
        return url

    # ------------------------------------------------------------------ auth

    def _scope(self, repository: str) -> str:
        return f"repository:{repository}:pull"

    async def _authorization(
        self, ep: Endpoint, repository: str, registry: str, *, refresh: bool = False
    ) -> str | None:
        """The Authorization header for this endpoint and repository, if it asked for one."""
        challenge = self._challenges.get(ep.host)
        creds = ep.credentials
        if challenge is None:
            if creds.registry_token:
                return f"Bearer {creds.registry_token}"
            return None
        if challenge.scheme == "basic":
            if not creds.username:
                raise AuthError(
                    registry,
                    f"pull access denied for registry {registry}: it asks for basic "
                    "authentication and no credentials are configured",
                )
            raw = f"{creds.username}:{creds.password}".encode()
            return "Basic " + base64.b64encode(raw).decode()
        if challenge.scheme == "bearer":
            if creds.registry_token:
                return f"Bearer {creds.registry_token}"
            token = await self._token(ep, challenge, repository, registry, refresh=refresh)
            return f"Bearer {token.value}"
        raise AuthError(
            registry, f"registry {registry} asks for unsupported auth scheme {challenge.scheme!r}"
        )

    async def _token(
        self, ep: Endpoint, challenge: Challenge, repository: str, registry: str, *, refresh: bool
    ) -> Token:
        realm = challenge.params.get("realm", "")
        service = challenge.params.get("service", "")
        scopes = sorted({self._scope(repository), *challenge.params.get("scope", "").split()})
        scopes = [s for s in scopes if s]
        creds = ep.credentials
        # Keyed by the whole secret (hashed): another password for the same user must not
        # reuse a token it did not earn.
        secret = f"{creds.username}\0{creds.password}\0{creds.identity_token}".encode()
        who = hashlib.sha256(secret).hexdigest() if creds else ""
        key = (realm, service, " ".join(scopes), who)
        lock = self._token_locks.setdefault(key, asyncio.Lock())
        async with lock:
            cached = self._tokens.get(key)
            if cached is not None and cached.fresh() and not refresh:
                return cached
            token = await self._fetch_token(ep, realm, service, scopes, registry)
            self._tokens[key] = token
        self._prune_tokens()
        return token

    def _prune_tokens(self) -> None:
        if len(self._tokens) <= MAX_CACHED_TOKENS:
            return
        for key in [k for k, t in self._tokens.items() if not t.fresh()]:
            del self._tokens[key]
            self._token_locks.pop(key, None)
        # Dicts keep insertion order: the first keys are the oldest tokens.
        while len(self._tokens) > MAX_CACHED_TOKENS:
            key = next(iter(self._tokens))
            del self._tokens[key]
            self._token_locks.pop(key, None)

    async def _fetch_token(
        self, ep: Endpoint, realm: str, service: str, scopes: list[str], registry: str
    ) -> Token:
        parts = urlsplit(realm)
        if parts.scheme not in {"http", "https"} or not parts.netloc:
            raise AuthError(registry, f"registry {registry} sent an unusable token realm {realm!r}")
        if parts.scheme == "http" and not (ep.insecure or is_loopback(parts.netloc)):
            raise AuthError(
                registry, f"registry {registry}: refusing a plain-HTTP token realm {realm!r}"
            )
        creds = ep.credentials
        client = self._client(ep)
        headers = {"Accept": "application/json"}
        if creds.identity_token:
            form = {
                "grant_type": "refresh_token",
                "refresh_token": creds.identity_token,
                "service": service,
                "scope": " ".join(scopes),
                "client_id": OAUTH_CLIENT_ID,
            }
            request = client.build_request("POST", realm, data=form, headers=headers)
        else:
            query = [("service", service)] if service else []
            query += [("scope", s) for s in scopes]
            sep = "&" if parts.query else "?"
            url = realm + (sep + urlencode(query) if query else "")
            if creds.username:
                raw = f"{creds.username}:{creds.password}".encode()
                headers["Authorization"] = "Basic " + base64.b64encode(raw).decode()
            request = client.build_request("GET", url, headers=headers)
        try:
            response = await client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise UnavailableError(
                registry, f"token server {parts.netloc} for registry {registry}: {exc}"
            ) from exc
        try:
            if response.status_code in {401, 403}:
                detail = await _error_detail(response)
                raise AuthError(
                    registry,
                    f"pull access denied, repository does not exist or may require "
                    f"authorization: registry {registry}: token server refused the "
                    f"credentials: {detail}",
                )
            if response.status_code != 200:
                detail = await _error_detail(response)
                raise AuthError(registry, f"registry {registry}: token server answered {detail}")
            body = await _read_limited(response, MAX_TOKEN_RESPONSE_BYTES)
        finally:
            await response.aclose()
        if body is None:
            raise AuthError(
                registry, f"registry {registry}: token response over {MAX_TOKEN_RESPONSE_BYTES} B"
            )
        try:
            return parse_token_response(body)
        except ChallengeError as exc:
            raise AuthError(registry, f"registry {registry}: {exc}") from None

    # ------------------------------------------------------------------ requests

    async def _send(
        self,
        ep: Endpoint,
        method: str,
        url: str,
        headers: dict[str, str],
        registry: str,
    ) -> httpx.Response:
        """One request with redirects followed by hand; the plain-HTTP fallback for loopback."""
        client = self._client(ep)
        first_origin = _origin(httpx.URL(url))
        for _ in range(MAX_REDIRECTS + 1):
            target = httpx.URL(url)
            send_headers = dict(headers)
            if _origin(target) != first_origin:
                # Storage behind a redirect gets no registry credentials.
                send_headers.pop("Authorization", None)
            request = client.build_request(method, target, headers=send_headers)
            try:
                response = await client.send(request, stream=True)
            except httpx.ConnectError as exc:
                if (
                    target.scheme == "https"
                    and _origin(target) == first_origin
                    and ep.plain_http_allowed
                    and _speaks_plain_http(exc)
                ):
                    log.info("registry %s speaks plain HTTP; using http://", ep.host)
                    self._plain.add((ep.scheme, ep.host))
                    url = "http://" + url[len("https://") :]
                    first_origin = _origin(httpx.URL(url))
                    continue
                raise UnavailableError(registry, f"registry {registry} ({ep}): {exc}") from exc
            except httpx.HTTPError as exc:
                raise UnavailableError(registry, f"registry {registry} ({ep}): {exc}") from exc
            if response.status_code not in _REDIRECT_CODES:
                return response
            location = response.headers.get("Location", "")
            await response.aclose()
            if not location:
                raise UnavailableError(registry, f"registry {registry}: redirect without Location")
            nxt = urljoin(url, location)
            if target.scheme == "https" and nxt.startswith("http://"):
                raise UnavailableError(
                    registry, f"registry {registry}: refusing a redirect from HTTPS to {nxt}"
                )
            url = nxt
        raise UnavailableError(
            registry, f"registry {registry}: more than {MAX_REDIRECTS} redirects"
        )

    async def request(
        self,
        ep: Endpoint,
        repository: str,
        method: str,
        url: str,
        headers: dict[str, str],
        registry: str,
    ) -> httpx.Response:
        """Send with authorisation; on a 401 take the challenge, authorise and retry once."""
        auth = await self._authorization(ep, repository, registry)
        send_headers = dict(headers)
        if auth:
            send_headers["Authorization"] = auth
        response = await self._send(ep, method, url, send_headers, registry)
        if response.status_code != 401:
            return response
        challenges = parse_challenges(response.headers.get_list("WWW-Authenticate"))
        detail = await _error_detail(response)
        await response.aclose()
        usable = [c for c in challenges if c.scheme in {"bearer", "basic"}]
        if not usable:
            raise AuthError(
                registry,
                f"pull access denied, repository does not exist or may require authorization: "
                f"registry {registry} answered {detail} without a usable challenge",
            )
        # Bearer first: a registry offering both prefers tokens.
        usable.sort(key=lambda c: c.scheme != "bearer")
        previous = self._challenges.get(ep.host)
        self._challenges[ep.host] = usable[0]
        refresh = previous is not None and auth is not None
        auth = await self._authorization(ep, repository, registry, refresh=refresh)
        if auth:
            send_headers["Authorization"] = auth
        response = await self._send(ep, method, url, send_headers, registry)
        if response.status_code in {401, 403}:
            detail = await _error_detail(response)
            await response.aclose()
            who = f"as {ep.credentials.username!r}" if ep.credentials.username else "anonymously"
            raise AuthError(
                registry,
                f"pull access denied, repository does not exist or may require authorization: "
                f"registry {registry} refused {who}: {detail}",
            )
        return response

    # ------------------------------------------------------------------ manifests

    async def fetch_manifest(
        self, ep: Endpoint, repository: str, obj: str, registry: str
    ) -> FetchedManifest:
        """GET a manifest or index by tag or digest; its digest is checked, its type detected."""
        url = self._url(ep, repository, "manifests", obj, registry)
        response = await self.request(
            ep, repository, "GET", url, {"Accept": ACCEPT_MANIFESTS}, registry
        )
        try:
            if response.status_code == 404:
                await response.aread()
                raise NotFoundError(registry, f"{obj}: not found")
            if response.status_code == 403:
                raise _denied(registry, await _error_detail(response))
            if response.status_code != 200:
                detail = await _error_detail(response)
                raise UnavailableError(registry, f"registry {registry}: manifest {obj}: {detail}")
            declared_length = response.headers.get("Content-Length")
            if declared_length is not None and int(declared_length) > MAX_MANIFEST_BYTES:
                raise VerificationError(
                    registry, f"manifest {obj} is larger than {MAX_MANIFEST_BYTES} bytes"
                )
            body = await _read_limited(response, MAX_MANIFEST_BYTES)
            if body is None:
                raise VerificationError(
                    registry, f"manifest {obj} is larger than {MAX_MANIFEST_BYTES} bytes"
                )
            header_digest = response.headers.get("Docker-Content-Digest", "")
            content_type = response.headers.get("Content-Type", "")
        except httpx.HTTPError as exc:
            raise UnavailableError(registry, f"registry {registry}: manifest {obj}: {exc}") from exc
        finally:
            await response.aclose()
        actual = _sha256(body)
        if obj.startswith("sha256:") and actual != obj:
            raise VerificationError(
                registry, f"manifest {obj} from {registry} has digest {actual}: refused"
            )
        if header_digest and header_digest.startswith("sha256:") and header_digest != actual:
            raise VerificationError(
                registry,
                f"manifest {obj} from {registry}: Docker-Content-Digest {header_digest} "
                f"but the body is {actual}: refused",
            )
        try:
            media_type = detect_type(content_type, body)
        except ManifestError as exc:
            raise VerificationError(registry, f"manifest {obj} from {registry}: {exc}") from None
        return FetchedManifest(actual, media_type, body)

    # ------------------------------------------------------------------ blobs

    async def fetch_blob(
        self,
        ep: Endpoint,
        repository: str,
        desc: Descriptor,
        store: content.ContentStore,
        registry: str,
        progress: ProgressCallback | None = None,
    ) -> Path:
        """Stream a blob into the store (resuming a partial ingest); returns its path.

        The writer hashes every byte as it arrives and refuses more than `desc.size` bytes; the
        blob becomes visible only when size and sha256 match. On a mismatch the partial is
        deleted; on any other failure it is kept for the next attempt to resume.
        """
        if store.has(desc.digest):
            return store.blob_path(desc.digest)
        writer = store.writer(desc.digest, desc.size)
        try:
            await self._stream_blob(ep, repository, desc, writer, registry, progress)
            # The commit (fsync, rename) runs in a thread that a cancellation cannot stop: wait
            # for it, so no blob lands after the caller has moved on (and collected garbage).
            commit = asyncio.ensure_future(asyncio.to_thread(writer.commit))
            try:
                return await asyncio.shield(commit)
            except asyncio.CancelledError:
                await asyncio.wait([commit])
                if not commit.cancelled():
                    commit.exception()  # retrieved: the cancellation is what the caller sees
                raise
            except (content.DigestMismatchError, content.SizeMismatchError) as exc:
                raise VerificationError(
                    registry, f"blob {desc.digest} from {registry}: {exc}: refused"
                ) from None
        finally:
            writer.abort()

    async def _stream_blob(
        self,
        ep: Endpoint,
        repository: str,
        desc: Descriptor,
        writer: content.BlobWriter,
        registry: str,
        progress: ProgressCallback | None,
    ) -> None:
        url = self._url(ep, repository, "blobs", desc.digest, registry)
        resumed = writer.offset
        headers = {"Accept": "*/*"}
        if resumed:
            headers["Range"] = f"bytes={resumed}-"
        response = await self.request(ep, repository, "GET", url, headers, registry)
        skip = 0
        try:
            status = response.status_code
            if status == 404:
                raise NotFoundError(registry, f"blob {desc.digest}: not found")
            if status == 403:
                raise _denied(registry, await _error_detail(response))
            if status == 416 and resumed:
                # The partial is already whole (or wrong); let the writer's check decide.
                if resumed == desc.size:
                    return
                writer.abort(discard=True)
                raise UnavailableError(
                    registry, f"registry {registry}: range request refused for {desc.digest}"
                )
            if status == 206 and resumed:
                m = _CONTENT_RANGE.match(response.headers.get("Content-Range", ""))
                if m is None or int(m.group(1)) != resumed:
                    raise UnavailableError(
                        registry, f"registry {registry}: wrong Content-Range for {desc.digest}"
                    )
                log.info(
                    "resuming blob %s at %d of %d bytes",
                    desc.digest,
                    resumed,
                    desc.size,
                    extra={"digest": desc.digest, "offset": resumed, "size": desc.size},
                )
                if progress is not None and resumed:
                    progress(resumed)
            elif status == 200:
                # No range served (or none asked): what the partial holds is skipped, and the
                # final digest check covers both parts.
                skip = resumed
            else:
                detail = await _error_detail(response)
                raise UnavailableError(
                    registry, f"registry {registry}: blob {desc.digest}: {detail}"
                )
            try:
                async for data in response.aiter_bytes():
                    chunk = data
                    if skip:
                        chunk = data[skip:]
                        skip = max(0, skip - len(data))
                        if not chunk:
                            continue
                    try:
                        writer.write(chunk)
                    except content.SizeMismatchError as exc:
                        raise VerificationError(
                            registry, f"blob {desc.digest} from {registry}: {exc}: refused"
                        ) from None
                    if progress is not None:
                        progress(len(chunk))
            except httpx.HTTPError as exc:
                raise UnavailableError(
                    registry, f"registry {registry}: blob {desc.digest}: {exc}"
                ) from exc
        finally:
            await response.aclose()
