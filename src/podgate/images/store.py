"""Image records over the content store and the snapshots: the image service's local half.

Layout under ``<state dir>/images``:

    content/     blobs by digest (content.py)
    snapshots/   unpacked layers by chain ID (snapshots.py)
    records/<config hex>.json   one record per image ID, written atomically

An image becomes visible only through `register()`, called by a pull or an import after every
blob is stored and verified: it unpacks what is missing, then writes the record in one rename.
A crash before that leaves blobs and snapshots no record names; `ImageStore.__init__` removes
them, with half-written records, partial ingests and snapshot temp dirs (`recover()`).
Lookups follow containerd (../shared/docs/reference/images-and-oci.md §2.1): an image ID,
else a normalised name (tag or ``name@digest``), else a unique ID prefix.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from podgate.images.content import ContentStore, parse_digest
from podgate.images.reference import InvalidReferenceError, Reference, is_image_id, parse_normalized
from podgate.images.snapshots import SnapshotStore, chain_ids
from podgate.linux.proc import atomic_write_json

__all__ = [
    "DEFAULT_MAX_LAYER_BYTES",
    "FsUsage",
    "ImageConfig",
    "ImageError",
    "ImageRecord",
    "ImageStore",
    "parse_user",
]

log = logging.getLogger(__name__)

# Largest uncompressed layer accepted (bytes); `[images] max_layer_bytes` in the config file.
# Large enough for CUDA-sized layers, small enough that a gzip bomb cannot fill the disk.
DEFAULT_MAX_LAYER_BYTES: Final = 16 * 1024**3
# containerd's manifest size cap (4·1048·1048 bytes); configs are JSON of the same order.
MAX_MANIFEST_BYTES: Final = 4 * 1048 * 1048
MAX_CONFIG_BYTES: Final = 8 * 1024 * 1024

MANIFEST_TYPES: Final = frozenset(
    {
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.docker.distribution.manifest.v2+json",
    }
)
# How long after a records change the cache is re-read anyway: file system timestamps come
# from a clock that ticks every few milliseconds, so two changes can share one mtime.
MTIME_SETTLE_NS: Final = 2_000_000_000
_UID_RE: Final = re.compile(r"^[0-9]+$")
_HEX_PREFIX_RE: Final = re.compile(r"^(?:sha256:)?([a-f0-9]{1,64})$")


class ImageError(Exception):
    """The image cannot be registered (bad manifest or config, missing blob)."""


@dataclass(frozen=True)
class ImageConfig:
    """What a container needs of the image config (`config` of the OCI image config)."""

    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    env: list[str] = field(default_factory=list)
    working_dir: str = ""
    user: str = ""
    exposed_ports: list[str] = field(default_factory=list)
    volumes: list[str] = field(default_factory=list)
    stop_signal: str = ""
    labels: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_oci(cls, doc: Mapping[str, Any]) -> ImageConfig:
        c = doc.get("config") or {}
        return cls(
            entrypoint=list(c.get("Entrypoint") or []),
            cmd=list(c.get("Cmd") or []),
            env=list(c.get("Env") or []),
            working_dir=str(c.get("WorkingDir") or ""),
            user=str(c.get("User") or ""),
            exposed_ports=sorted(c.get("ExposedPorts") or {}),
            volumes=sorted(c.get("Volumes") or {}),
            stop_signal=str(c.get("StopSignal") or ""),
            labels=dict(c.get("Labels") or {}),
        )


def parse_user(user: str) -> tuple[int | None, str]:
    """(uid, username) from the config's ``User`` as containerd reports them (§2.2)."""
    name = user.split(":", 1)[0]
    if not name:
        return None, ""
    if _UID_RE.match(name) and int(name) < 2**63:
        return int(name), ""
    return None, name


@dataclass
class ImageRecord:
    id: str  # sha256 digest of the config blob
    repo_tags: list[str]
    repo_digests: list[str]
    manifest_digest: str
    config_digest: str
    layers: list[str]  # compressed layer digests, base first
    diff_ids: list[str]
    chain_ids: list[str]
    size: int
    uid: int | None
    username: str
    pinned: bool
    config: ImageConfig
    spec: dict[str, Any]  # the whole config document, for verbose status
    created_ns: int
    # An index / manifest list the image was selected from (its digest is the repo digest).
    index_digest: str | None = None

    def names(self) -> list[str]:
        return [*self.repo_tags, *self.repo_digests]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ImageRecord:
        d = dict(d)
        d["config"] = ImageConfig(**d["config"])
        return cls(**d)


@dataclass(frozen=True)
class FsUsage:
    mountpoint: str
    used_bytes: int
    inodes_used: int


def _load_json(data: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except ValueError as e:
        raise ImageError(f"{what} is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ImageError(f"{what} is not a JSON object")
    return doc


class ImageStore:
    def __init__(
        self,
        state_dir: str | Path,
        max_layer_bytes: int = DEFAULT_MAX_LAYER_BYTES,
        pinned: Iterable[str] = (),
    ) -> None:
        self.root = Path(state_dir) / "images"
        self.records_dir = self.root / "records"
        self.records_dir.mkdir(parents=True, exist_ok=True)
        self.content = ContentStore(self.root / "content")
        self.snapshots = SnapshotStore(self.root / "snapshots")
        self.max_layer_bytes = max_layer_bytes
        self.pinned = {str(parse_normalized(p)) for p in pinned}
        # Writers are serialised twice: an RLock between the daemon's worker threads and an
        # flock on `lock` between processes (`podgate images import --state-dir` next to a
        # running daemon). Pulls and imports in flight hold `ingest.lock` shared from their
        # first blob to register(): their blobs are named by no record yet, so garbage
        # collection and crash cleanup run only when they get it exclusively.
        self._lock = threading.RLock()
        self._depth = 0
        self._flock_fd = -1
        self._records: dict[str, ImageRecord] = {}
        self._records_mtime = -1
        self._busy = 0
        self.recovered = self.recover()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                self._flock_fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
                fcntl.flock(self._flock_fd, fcntl.LOCK_EX)
            self._depth += 1
            try:
                self._refresh()
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    os.close(self._flock_fd)  # releases the flock
                    self._flock_fd = -1

    @contextlib.contextmanager
    def _no_ingest_running(self) -> Iterator[bool]:
        """True when no pull or import (here or in another process) is in flight."""
        if self._busy:
            yield False
            return
        fd = os.open(self.root / "ingest.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)

    def _refresh(self) -> None:
        """Reload the records when another process changed them."""
        mtime = self.records_dir.stat().st_mtime_ns
        # Directory mtimes tick coarsely: a change in the last moments may not show yet.
        if mtime == self._records_mtime and time.time_ns() - mtime > MTIME_SETTLE_NS:
            return
        self._records_mtime = mtime
        records: dict[str, ImageRecord] = {}
        for p in self.records_dir.glob("*.json"):
            if p.name.startswith("."):
                continue
            try:
                rec = ImageRecord.from_json(json.loads(p.read_text()))
            except FileNotFoundError:
                continue
            except (ValueError, TypeError, KeyError) as e:
                log.warning("ignoring unreadable image record %s: %s", p, e)
                continue
            records[rec.id] = rec
        self._records = records

    # -- start-up --------------------------------------------------------------------------------

    def recover(self) -> int:
        """Drop what a crash left half-done; returns how many leftovers were removed.

        Skipped (0) while another process is pulling or importing into the same store.
        """
        with self._locked(), self._no_ingest_running() as idle:
            if not idle:
                return 0
            n = 0
            for p in self.records_dir.iterdir():
                if p.name.startswith(".") or not p.name.endswith(".json"):
                    p.unlink(missing_ok=True)  # an atomic write that never got renamed
                    n += 1
                elif "sha256:" + p.stem not in self._records:
                    p.unlink(missing_ok=True)  # unreadable: _refresh() logged why
                    n += 1
            for p in self.root.glob(".tmp-*"):  # an import's extraction directory
                shutil.rmtree(p, ignore_errors=True)
                n += 1
            n += self.content.clean_ingests()
            n += self.snapshots.clean()
            n += self._collect()
            if n:
                log.info("image store: removed %d leftovers of an interrupted operation", n)
            return n

    # -- lookups ---------------------------------------------------------------------------------

    def images(self) -> list[ImageRecord]:
        with self._locked():
            return sorted(self._records.values(), key=lambda r: r.created_ns)

    def get(self, ref: str) -> ImageRecord | None:
        """Resolve an ID, a name (normalised) or a unique ID prefix; None when unknown."""
        with self._locked():
            if is_image_id(ref):
                return self._records.get(ref)
            try:
                name = str(parse_normalized(ref))
            except InvalidReferenceError:
                name = None
            if name is not None:
                for rec in self._records.values():
                    if name in rec.repo_tags or name in rec.repo_digests:
                        return rec
            m = _HEX_PREFIX_RE.match(ref)
            if m is None:
                return None
            hits = [r for r in self._records.values() if r.id[7:].startswith(m.group(1))]
            return hits[0] if len(hits) == 1 else None

    def lowerdirs(self, image_id: str) -> list[Path]:
        rec = self._records[image_id]
        return self.snapshots.lowerdirs(rec.chain_ids)

    def acquire(self, ref: str, lease: str) -> tuple[ImageRecord, list[Path]] | None:
        """A container takes the image `ref` names: its record and its snapshots' overlay
        lower dirs, held under `lease` until `release(lease)` (RemoveImage and garbage
        collection keep leased snapshots). None when no image has that name, digest or ID."""
        with self._locked():
            rec = self.get(ref)
            if rec is None:
                return None
            return rec, self.snapshots.acquire(lease, rec.chain_ids)

    def release_unknown(self, known: Iterable[str]) -> list[str]:
        """Drop the leases of containers not in `known` (a crash between taking a lease and
        recording the container); returns their ids."""
        keep = set(known)
        with self._locked():
            stale = [lease for lease in self.snapshots.leases() if lease not in keep]
            for lease in stale:
                self.snapshots.release(lease)
            if stale:
                self._gc()
        return stale

    def release(self, lease: str) -> None:
        """Drop a container's lease; snapshots no image and no lease uses go."""
        with self._locked():
            self.snapshots.release(lease)
            self._gc()

    # -- registration ----------------------------------------------------------------------------

    def _read_manifest(self, manifest_digest: str) -> tuple[dict[str, Any], dict[str, Any], str]:
        if not self.content.has(manifest_digest):
            raise ImageError(f"manifest {manifest_digest} is not in the content store")
        manifest = _load_json(
            self.content.read_bytes(manifest_digest, MAX_MANIFEST_BYTES), "manifest"
        )
        mt = manifest.get("mediaType")
        if mt is not None and mt not in MANIFEST_TYPES:
            raise ImageError(f"manifest {manifest_digest} has media type {mt!r}")
        cfg = manifest.get("config")
        if not isinstance(cfg, dict) or not isinstance(cfg.get("digest"), str):
            raise ImageError(f"manifest {manifest_digest} has no config descriptor")
        config_digest = cfg["digest"]
        parse_digest(config_digest)
        if not self.content.has(config_digest):
            raise ImageError(f"config {config_digest} is not in the content store")
        config = _load_json(self.content.read_bytes(config_digest, MAX_CONFIG_BYTES), "config")
        return manifest, config, config_digest

    def unpack(self, manifest_digest: str) -> list[str]:
        """Unpack every layer of the manifest not yet unpacked; returns the chain IDs."""
        manifest, config, _ = self._read_manifest(manifest_digest)
        layers = manifest.get("layers") or []
        diff_ids = list((config.get("rootfs") or {}).get("diff_ids") or [])
        if len(layers) != len(diff_ids):
            raise ImageError(
                f"manifest has {len(layers)} layers but the config {len(diff_ids)} diff ids"
            )
        chain = chain_ids(diff_ids)
        for i, desc in enumerate(layers):
            if self.snapshots.has(chain[i]):
                continue
            digest = desc["digest"]
            if not self.content.has(digest):
                raise ImageError(f"layer {digest} is not in the content store")
            with open(self.content.blob_path(digest), "rb") as f:
                self.snapshots.prepare(
                    chain[i], chain[i - 1] if i else None, f, diff_ids[i], self.max_layer_bytes
                )
        return chain

    def register(
        self,
        manifest_digest: str,
        names: Sequence[str | Reference],
        index_digest: str | None = None,
    ) -> ImageRecord:
        """Make an image visible under `names` (tags and ``name@digest``), all blobs verified.

        Unpacks missing layers first; the record is written last, in one atomic rename. A tag
        that named another image moves here; an image left with no name at all is removed.
        The caller holds `ingesting()`, so the unpack runs outside the store lock (lookups
        are not held up by it) without its blobs being collected meanwhile.
        """
        chain = self.unpack(manifest_digest)
        with self._locked():
            manifest, config, config_digest = self._read_manifest(manifest_digest)
            layers = [d["digest"] for d in manifest.get("layers") or []]
            diff_ids = list((config.get("rootfs") or {}).get("diff_ids") or [])
            size = sum(int(d.get("size", 0)) for d in manifest.get("layers") or [])
            size += self.content.size(config_digest)
            tags: list[str] = []
            digests: list[str] = []
            for n in names:
                ref = n if isinstance(n, Reference) else parse_normalized(n)
                if ref.digest is not None:
                    digests.append(str(ref.with_digest(ref.digest)))
                else:
                    tags.append(str(ref))
            old = self._records.get(config_digest)
            if old is not None:
                tags = sorted({*old.repo_tags, *tags})
                digests = sorted({*old.repo_digests, *digests})
            uid, username = parse_user(ImageConfig.from_oci(config).user)
            rec = ImageRecord(
                id=config_digest,
                repo_tags=sorted(set(tags)),
                repo_digests=sorted(set(digests)),
                manifest_digest=manifest_digest,
                config_digest=config_digest,
                layers=layers,
                diff_ids=diff_ids,
                chain_ids=chain,
                size=size,
                uid=uid,
                username=username,
                pinned=False,
                config=ImageConfig.from_oci(config),
                spec=config,
                created_ns=old.created_ns if old else time.time_ns(),
                index_digest=index_digest or (old.index_digest if old else None),
            )
            rec.pinned = any(n in self.pinned for n in rec.names())
            # Names move: a tag (or digest name) belongs to one image only.
            for other in list(self._records.values()):
                if other.id == rec.id:
                    continue
                moved = set(other.names()) & set(rec.names())
                if moved:
                    other.repo_tags = [t for t in other.repo_tags if t not in moved]
                    other.repo_digests = [d for d in other.repo_digests if d not in moved]
                    if other.names():
                        self._save(other)
                    else:
                        self._delete_record(other.id)
            self._save(rec)
            self._gc()
            return rec

    def _save(self, rec: ImageRecord) -> None:
        path = self.records_dir / f"{parse_digest(rec.id)}.json"
        atomic_write_json(str(path), rec.to_json())
        self._records[rec.id] = rec

    def _delete_record(self, image_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.records_dir / f"{parse_digest(image_id)}.json").unlink()
        self._records.pop(image_id, None)

    # -- removal ---------------------------------------------------------------------------------

    def remove(self, ref: str) -> ImageRecord | None:
        """RemoveImage: resolve `ref`, drop every name of that image, collect garbage."""
        with self._locked():
            rec = self.get(ref)
            if rec is None:
                return None
            self._delete_record(rec.id)
            self._gc()
            return rec

    def untag(self, ref: str) -> ImageRecord | None:
        """Drop one name; the image goes with its last name."""
        with self._locked():
            rec = self.get(ref)
            if rec is None:
                return None
            try:
                name = str(parse_normalized(ref))
            except InvalidReferenceError:
                name = ""
            if name not in rec.names() or len(rec.names()) == 1:
                return self.remove(rec.id)
            rec.repo_tags = [t for t in rec.repo_tags if t != name]
            rec.repo_digests = [d for d in rec.repo_digests if d != name]
            self._save(rec)
            return rec

    @contextlib.contextmanager
    def ingesting(self) -> Iterator[None]:
        """Held by a pull or an import from its first blob to `register()`: defers GC."""
        fd = os.open(self.root / "ingest.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            with self._lock:
                self._busy += 1
            try:
                yield
            finally:
                with self._lock:
                    self._busy -= 1
        finally:
            os.close(fd)
            with self._locked():
                self._gc()  # also after a failed pull: its blobs are garbage now

    def _gc(self) -> int:
        """Delete blobs and snapshots no record (and no container lease) uses."""
        with self._no_ingest_running() as idle:
            return self._collect() if idle else 0

    def _collect(self) -> int:
        blobs: set[str] = set()
        snaps: set[str] = set()
        for rec in self._records.values():
            blobs.update((rec.manifest_digest, rec.config_digest, *rec.layers))
            if rec.index_digest:
                blobs.add(rec.index_digest)
            snaps.update(rec.chain_ids)
        n = 0
        for d in self.content.digests():
            if d not in blobs:
                self.content.delete(d)
                n += 1
        n += len(self.snapshots.gc(snaps))
        return n

    def gc(self) -> int:
        with self._locked():
            return self._gc()

    # -- usage -----------------------------------------------------------------------------------

    def fs_info(self) -> FsUsage:
        """Bytes allocated and inodes used under the store, each inode counted once."""
        seen: set[int] = set()
        used = 0
        for dirpath, dirnames, filenames in os.walk(self.root):
            for n in (dirpath, *(os.path.join(dirpath, f) for f in (*dirnames, *filenames))):
                with contextlib.suppress(FileNotFoundError):
                    st = os.lstat(n)
                    if st.st_ino not in seen:
                        seen.add(st.st_ino)
                        used += st.st_blocks * 512
        return FsUsage(str(self.root), used, len(seen))

    def verbose_info(self, rec: ImageRecord) -> dict[str, str]:
        """ImageStatus verbose `info`, shaped like containerd's."""
        info = {"chainID": rec.chain_ids[-1] if rec.chain_ids else "", "imageSpec": rec.spec}
        return {"info": json.dumps(info, sort_keys=True)}
