"""The Puller: reference → manifest → config and layers in the content store → a registered image.

Order of a pull (containerd's): resolve the reference on the registry's endpoints (mirrors,
then the origin); an index picks the node's platform; the manifest, the config and every
layer are fetched and verified by digest (layers in parallel, bounded); only then does the
image store unpack the layers and write the image record, in one step. Until that step
nothing names the new blobs, so an interrupted pull (killed daemon, lost registry, full disk)
never leaves an image that ImageStatus reports; its partial downloads stay in the content
store's ingest area (a resumed pull continues them with `Range`, a restarted daemon drops
them).

Concurrent pulls of one reference share one flight, and concurrent downloads of one blob
(two images sharing a layer) share one download. A flight is cancelled when its last waiter
leaves (a deadline, a client gone), and the puller owns every flight it starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol, TypeVar

from podgate.images.config import (
    DEFAULT_MAX_CONCURRENT_DOWNLOADS,
    Credentials,
    Endpoint,
    RegistryConfig,
)
from podgate.images.manifests import (
    INDEX_TYPES,
    Descriptor,
    ManifestError,
    diff_ids,
    parse_index,
    parse_manifest,
)
from podgate.images.platforms import Platform, choose, host_platform
from podgate.images.reference import Reference, parse_normalized
from podgate.images.registry import (
    FetchedManifest,
    NotFoundError,
    RegistryClient,
    RegistryError,
    UnavailableError,
    VerificationError,
)
from podgate.images.snapshots import chain_ids
from podgate.images.store import MAX_CONFIG_BYTES, ImageError, ImageRecord, ImageStore
from podgate.images.unpack import LayerError

log = logging.getLogger(__name__)
T = TypeVar("T")

# Seconds between two progress lines of one pull in the log (layer completions are logged too).
PROGRESS_LOG_INTERVAL_SECONDS: Final = 5.0


class PullError(RegistryError):
    """A pull failed for a reason that is not the registry's (disk full, a bad image)."""


class ResourceError(PullError):
    """The node ran out of something (disk space) while pulling."""


class UnpackError(PullError):
    """The image's layers cannot be applied here (hostile entries, over the size cap, a
    wrong diff ID) or its manifest and config do not fit together."""


async def _uncancellable(work: Awaitable[T]) -> T:
    """Await work running in a thread; on cancellation wait for the thread to finish first,
    so nothing it writes lands after the pull has cleaned up."""
    future = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait([future])
        if not future.cancelled():
            future.exception()  # retrieved: the cancellation is what the caller sees
        raise


class PullProgress(Protocol):
    """What a pull reports as it goes (the CLI's progress bar, the daemon's log)."""

    def resolved(self, reference: str, digest: str, layers: Sequence[Descriptor]) -> None: ...

    def advanced(self, digest: str, nbytes: int) -> None: ...

    def layer_done(self, digest: str, cached: bool) -> None: ...

    def unpacking(self) -> None: ...


@dataclass
class _Broadcast:
    """Fans one flight's progress out to every waiter."""

    listeners: list[PullProgress] = field(default_factory=list)

    def resolved(self, reference: str, digest: str, layers: Sequence[Descriptor]) -> None:
        for p in self.listeners:
            p.resolved(reference, digest, layers)

    def advanced(self, digest: str, nbytes: int) -> None:
        for p in self.listeners:
            p.advanced(digest, nbytes)

    def layer_done(self, digest: str, cached: bool) -> None:
        for p in self.listeners:
            p.layer_done(digest, cached)

    def unpacking(self) -> None:
        for p in self.listeners:
            p.unpacking()


class LogProgress:
    """Progress of one pull as log lines with fields: layers and bytes, at most every 5 s."""

    def __init__(self, logger: logging.Logger = log, clock: Callable[[], float] = time.monotonic):
        self.log = logger
        self.clock = clock
        self.reference = ""
        self.total_bytes = 0
        self.done_bytes = 0
        self.layers = 0
        self.layers_done = 0
        self.started = clock()
        self.last = self.started

    def _fields(self) -> dict[str, object]:
        return {
            "image": self.reference,
            "layers_done": self.layers_done,
            "layers": self.layers,
            "bytes_done": self.done_bytes,
            "bytes": self.total_bytes,
            "seconds": round(self.clock() - self.started, 3),
        }

    def _line(self, what: str) -> None:
        f = self._fields()
        self.log.info(
            "pull %s: %s (%d/%d layers, %d/%d bytes)",
            self.reference,
            what,
            self.layers_done,
            self.layers,
            self.done_bytes,
            self.total_bytes,
            extra=f,
        )

    def resolved(self, reference: str, digest: str, layers: Sequence[Descriptor]) -> None:
        self.reference = reference
        self.layers = len(layers)
        self.total_bytes = sum(d.size for d in layers)
        self._line(f"resolved to {digest}")

    def advanced(self, digest: str, nbytes: int) -> None:
        self.done_bytes += nbytes
        now = self.clock()
        if now - self.last >= PROGRESS_LOG_INTERVAL_SECONDS:
            self.last = now
            self._line("downloading")

    def layer_done(self, digest: str, cached: bool) -> None:
        self.layers_done += 1
        self._line(f"layer {digest} {'present' if cached else 'downloaded'}")

    def unpacking(self) -> None:
        self._line("unpacking")


@dataclass
class _Flight:
    task: asyncio.Task[ImageRecord]
    progress: _Broadcast
    waiters: int = 0


def _credentials_key(creds: Credentials | None) -> tuple[str, ...]:
    if not creds:
        return ()
    return (creds.username, creds.password, creds.identity_token, creds.registry_token)


class Puller:
    """Pulls images into an ImageStore. `aclose()` cancels what is still running."""

    def __init__(
        self,
        store: ImageStore,
        registries: RegistryConfig | None = None,
        *,
        max_concurrent_downloads: int = DEFAULT_MAX_CONCURRENT_DOWNLOADS,
        platform: Platform | None = None,
        client: RegistryClient | None = None,
    ) -> None:
        self.store = store
        self.client = client or RegistryClient(registries)
        self.platform = platform or host_platform()
        self.downloads = asyncio.Semaphore(max_concurrent_downloads)
        self._flights: dict[tuple[str, tuple[str, ...]], _Flight] = {}
        self._blobs: dict[str, asyncio.Task[None]] = {}

    async def aclose(self) -> None:
        tasks = [f.task for f in self._flights.values()] + list(self._blobs.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self.client.aclose()

    # ------------------------------------------------------------------ the CRI seam

    async def pull(self, reference: str, credentials: Credentials | None = None) -> str:
        """Pull and register `reference`; returns the image ID (the config digest)."""
        return (await self.pull_image(reference, credentials)).id

    async def pull_image(
        self,
        reference: str,
        credentials: Credentials | None = None,
        progress: PullProgress | None = None,
    ) -> ImageRecord:
        ref = parse_normalized(reference)
        key = (str(ref), _credentials_key(credentials))
        flight = self._flights.get(key)
        if flight is not None and (flight.task.done() or flight.task.cancelling()):
            # A flight being torn down: let its clean-up finish, then start afresh.
            await asyncio.wait([flight.task])
            if self._flights.get(key) is flight:
                del self._flights[key]
            flight = None
        if flight is None:
            broadcast = _Broadcast([LogProgress()])
            task = asyncio.create_task(self._pull(ref, credentials, broadcast), name=f"pull {ref}")
            flight = _Flight(task, broadcast)
            self._flights[key] = flight
            task.add_done_callback(lambda t: self._landed(key, flight, t))
        else:
            log.info("pull %s: joining the pull already running", ref)
        if progress is not None:
            flight.progress.listeners.append(progress)
        flight.waiters += 1
        try:
            return await asyncio.shield(flight.task)
        finally:
            flight.waiters -= 1
            if progress is not None:
                with contextlib.suppress(ValueError):
                    flight.progress.listeners.remove(progress)
            if flight.waiters == 0 and not flight.task.done():
                # Nobody waits any more (deadline, client gone): stop downloading.
                flight.task.cancel()

    def _landed(
        self, key: tuple[str, tuple[str, ...]], flight: _Flight, task: asyncio.Task[ImageRecord]
    ) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]
        if not task.cancelled() and task.exception() is not None and flight.waiters == 0:
            log.debug("pull %s failed with nobody waiting: %s", key[0], task.exception())

    # ------------------------------------------------------------------ one pull

    async def _pull(
        self, ref: Reference, credentials: Credentials | None, progress: _Broadcast
    ) -> ImageRecord:
        name = str(ref)
        try:
            with self.store.ingesting():
                return await self._pull_locked(ref, credentials, progress)
        except NotFoundError as exc:
            raise NotFoundError(
                exc.registry,
                f'failed to pull and unpack image "{name}": failed to resolve reference '
                f'"{name}": {exc}',
            ) from None
        except RegistryError as exc:
            raise type(exc)(
                exc.registry, f'failed to pull and unpack image "{name}": {exc}'
            ) from None
        except ManifestError as exc:
            raise VerificationError(
                ref.domain, f'failed to pull and unpack image "{name}": {exc}'
            ) from None
        except (LayerError, ImageError) as exc:
            raise UnpackError(
                ref.domain, f'failed to pull and unpack image "{name}": {exc}'
            ) from None
        except OSError as exc:
            if exc.errno in {errno.ENOSPC, errno.EDQUOT}:
                raise ResourceError(
                    ref.domain, f'failed to pull and unpack image "{name}": {exc}'
                ) from None
            raise

    async def _resolve(
        self, ref: Reference, credentials: Credentials | None
    ) -> tuple[Endpoint, FetchedManifest]:
        """The first endpoint that has the reference; not-found only if every one says so."""
        first_error: RegistryError | None = None
        for ep in self.client.endpoints(ref, credentials):
            try:
                fetched = await self.client.fetch_manifest(ep, ref.path, ref.object, ref.domain)
                return ep, fetched
            except NotFoundError as exc:
                log.debug("pull %s: not on %s", ref, ep)
                first_error = first_error or exc
            except RegistryError as exc:
                log.warning("pull %s: endpoint %s failed: %s", ref, ep, exc)
                if not isinstance(first_error, RegistryError) or isinstance(
                    first_error, NotFoundError
                ):
                    first_error = exc
        if first_error is None:
            raise UnavailableError(ref.domain, f"no endpoint is configured for {ref.domain}")
        if isinstance(first_error, NotFoundError):
            raise NotFoundError(first_error.registry, f"{ref}: not found")
        raise first_error

    async def _pull_locked(
        self, ref: Reference, credentials: Credentials | None, progress: _Broadcast
    ) -> ImageRecord:
        content = self.store.content
        ep, top = await self._resolve(ref, credentials)
        index_digest: str | None = None
        fetched = top
        if top.media_type in INDEX_TYPES:
            index = parse_index(top.body, top.media_type)
            chosen = choose([d.platform for d in index.manifests], self.platform)
            if chosen is None:
                raise NotFoundError(
                    ref.domain, f"no match for platform in manifest {top.digest}: not found"
                )
            fetched = await self.client.fetch_manifest(
                ep, ref.path, index.manifests[chosen].digest, ref.domain
            )
            if fetched.media_type in INDEX_TYPES:
                raise VerificationError(ref.domain, f"index {top.digest} points at another index")
            await asyncio.to_thread(content.write_blob, top.body, top.digest)
            index_digest = top.digest
        manifest = parse_manifest(fetched.body, fetched.media_type)
        progress.resolved(str(ref), top.digest, manifest.layers)
        if manifest.config.size > MAX_CONFIG_BYTES:
            raise VerificationError(
                ref.domain, f"image config is {manifest.config.size} bytes (> {MAX_CONFIG_BYTES})"
            )
        await self._blob(ep, ref, manifest.config, progress, report=False)
        config_body = content.read_bytes(manifest.config.digest, MAX_CONFIG_BYTES)
        ids = diff_ids(config_body)
        if len(ids) != len(manifest.layers):
            raise VerificationError(
                ref.domain,
                f"manifest has {len(manifest.layers)} layers but the config {len(ids)} diff IDs",
            )
        # Layers download in parallel; each is unpacked as soon as it and the layers below it
        # are verified, so unpacking overlaps the downloads still running.
        chain = chain_ids(list(ids))
        landed = [asyncio.Event() for _ in manifest.layers]

        async def fetch(i: int, desc: Descriptor) -> None:
            await self._blob(ep, ref, desc, progress, report=True)
            landed[i].set()

        async def unpack_in_order() -> None:
            for i, desc in enumerate(manifest.layers):
                await landed[i].wait()
                if i == 0:
                    progress.unpacking()
                parent = chain[i - 1] if i else None
                began = time.monotonic()
                await _uncancellable(
                    asyncio.to_thread(self._unpack_layer, desc.digest, chain[i], parent, ids[i])
                )
                unpacking[0] += time.monotonic() - began

        unpacking = [0.0]  # seconds spent applying layers (and registering), for the log
        try:
            async with asyncio.TaskGroup() as tg:
                for i, desc in enumerate(manifest.layers):
                    tg.create_task(fetch(i, desc))
                tg.create_task(unpack_in_order())
        except* (RegistryError, OSError, LayerError) as group:
            # One failure stops the rest; the caller sees the first one.
            raise group.exceptions[0] from None
        # The manifest goes in last: everything it names is there and verified.
        await asyncio.to_thread(content.write_blob, fetched.body, fetched.digest)
        names: list[str | Reference] = [ref.with_digest(top.digest)]
        if ref.tag is not None:
            names.append(ref)
        began = time.monotonic()
        record = await _uncancellable(
            asyncio.to_thread(self.store.register, fetched.digest, names, index_digest)
        )
        unpacking[0] += time.monotonic() - began
        log.info(
            "pull %s: image %s registered (unpacked in %.3fs)",
            ref,
            record.id,
            unpacking[0],
            extra={
                "image": str(ref),
                "id": record.id,
                "digest": top.digest,
                "unpack_seconds": round(unpacking[0], 3),
            },
        )
        return record

    async def _blob(
        self, ep: Endpoint, ref: Reference, desc: Descriptor, progress: _Broadcast, *, report: bool
    ) -> None:
        """Download one blob unless present; one download per digest across all pulls."""
        while True:
            if self.store.content.has(desc.digest):
                if report:
                    progress.layer_done(desc.digest, cached=True)
                return
            running = self._blobs.get(desc.digest)
            if running is not None and running.done():
                self._blobs.pop(desc.digest, None)
                if not running.cancelled() and running.exception() is not None:
                    raise running.exception()  # type: ignore[misc]
                continue
            if running is None:
                running = asyncio.create_task(
                    self._download(ep, ref, desc, progress if report else None),
                    name=f"blob {desc.digest}",
                )
                self._blobs[desc.digest] = running
                running.add_done_callback(functools.partial(self._blob_landed, desc.digest))
                try:
                    await asyncio.shield(running)
                except asyncio.CancelledError:
                    # Let the download stop before the pull leaves `ingesting()`, so what it
                    # committed meanwhile is collected with the rest.
                    running.cancel()
                    await asyncio.wait([running])
                    raise
                if report:
                    progress.layer_done(desc.digest, cached=False)
                return
            try:
                await asyncio.shield(running)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                # The pull that owned the download was cancelled; download it ourselves.
                continue
            if report:
                progress.layer_done(desc.digest, cached=False)
            return

    def _unpack_layer(self, digest: str, chain_id: str, parent: str | None, diff_id: str) -> None:
        """Apply one verified layer as snapshot `chain_id` (a no-op when it exists)."""
        snapshots = self.store.snapshots
        if snapshots.has(chain_id):
            return
        with open(self.store.content.blob_path(digest), "rb") as f:
            snapshots.prepare(chain_id, parent, f, diff_id, self.store.max_layer_bytes)

    def _blob_landed(self, digest: str, task: asyncio.Task[None]) -> None:
        if self._blobs.get(digest) is task:
            del self._blobs[digest]
        if not task.cancelled():
            task.exception()  # retrieved here; the waiters re-raise it

    async def _download(
        self, ep: Endpoint, ref: Reference, desc: Descriptor, progress: _Broadcast | None
    ) -> None:
        async with self.downloads:
            on_bytes = (lambda n: progress.advanced(desc.digest, n)) if progress else None
            await self.client.fetch_blob(
                ep, ref.path, desc, self.store.content, ref.domain, on_bytes
            )
