"""`podgate images import FILE`: an OCI image layout (directory or tar) or a ``docker save``
archive into the image store, for nodes without a registry.

Every blob is copied through the content store's verifying writer (an OCI layout's blob must
hash to its name; a docker archive's files get the digest of their bytes), every layer's diff
ID is checked on unpack, and the images become visible only by `ImageStore.register`. A tar is
first extracted with tarfile's ``data`` filter (no absolute names, no ``..``, no links out,
no devices) into a temporary directory inside the store, removed afterwards.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from podgate.images.builder import CONTAINERD_NAME_ANNOTATION, REF_NAME_ANNOTATION, host_arch
from podgate.images.content import READ_CHUNK_BYTES, parse_digest
from podgate.images.reference import InvalidReferenceError, parse_normalized
from podgate.images.store import ImageError, ImageRecord, ImageStore

__all__ = ["ArchiveError", "import_archive"]

# index.json and manifest.json are small JSON documents; anything bigger is not one (bytes).
MAX_INDEX_BYTES: Final = 4 * 1024 * 1024
DOCKER_MANIFEST: Final = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG: Final = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER: Final = "application/vnd.docker.image.rootfs.diff.tar"
INDEX_TYPES: Final = frozenset(
    {
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
    }
)


class ArchiveError(ImageError):
    """The archive is not an image archive podgate can load."""


@dataclass(frozen=True)
class _Found:
    manifest_digest: str
    names: list[str]
    index_digest: str | None = None


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise ArchiveError(f"{path.name} is missing")
    with open(path, "rb") as f:
        data = f.read(MAX_INDEX_BYTES + 1)
    if len(data) > MAX_INDEX_BYTES:
        raise ArchiveError(f"{path.name} is larger than {MAX_INDEX_BYTES} bytes")
    try:
        return json.loads(data)
    except ValueError as e:
        raise ArchiveError(f"{path.name} is not JSON: {e}") from None


def _member(root: Path, name: str) -> Path:
    """A file of the archive; symlinks (docker save links repeated layers) must stay inside."""
    path = (root / name).resolve()
    if not path.is_relative_to(root.resolve()):
        raise ArchiveError(f"{name!r} points outside the archive")
    return path


def _copy_blob(store: ImageStore, src: Path, digest: str) -> None:
    if store.content.has(digest):
        return
    if not src.is_file():
        raise ArchiveError(f"blob {digest} is missing from the archive")
    w = store.content.writer(digest, src.stat().st_size)
    if w.offset:  # a stale partial from an earlier import: start over from the file
        w.abort(discard=True)
        w = store.content.writer(digest, src.stat().st_size)
    with open(src, "rb") as f:
        while chunk := f.read(READ_CHUNK_BYTES):
            w.write(chunk)
    w.commit()


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK_BYTES):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _names_from(annotations: dict[str, str]) -> list[str]:
    for key in (CONTAINERD_NAME_ANNOTATION, REF_NAME_ANNOTATION):
        name = annotations.get(key)
        if not name:
            continue
        try:
            return [str(parse_normalized(name))]
        except InvalidReferenceError:
            continue  # a bare tag ("latest") in ref.name names nothing by itself
    return []


def _oci(store: ImageStore, root: Path) -> list[_Found]:
    index = _read_json(root / "index.json")
    found: list[_Found] = []

    def blob(digest: str) -> Path:
        return _member(root, "blobs/sha256/" + parse_digest(digest))

    def walk(desc: dict[str, Any], names: list[str], index_digest: str | None) -> None:
        digest = desc["digest"]
        _copy_blob(store, blob(digest), digest)
        if desc.get("mediaType") in INDEX_TYPES:
            doc = json.loads(store.content.read_bytes(digest, MAX_INDEX_BYTES))
            wanted = [
                m
                for m in doc.get("manifests", [])
                if (m.get("platform") or {}).get("os", "linux") == "linux"
                and (m.get("platform") or {}).get("architecture", host_arch()) == host_arch()
            ]
            if not wanted:
                raise ArchiveError(f"no manifest for linux/{host_arch()} in index {digest}")
            walk(wanted[0], names, digest)
            return
        manifest = json.loads(store.content.read_bytes(digest, MAX_INDEX_BYTES))
        for d in [manifest["config"], *manifest.get("layers", [])]:
            _copy_blob(store, blob(d["digest"]), d["digest"])
        found.append(_Found(digest, names, index_digest))

    for desc in index.get("manifests", []):
        names = _names_from(desc.get("annotations") or {})
        walk(desc, names, None)
    return found


def _docker(store: ImageStore, root: Path) -> list[_Found]:
    entries = _read_json(root / "manifest.json")
    if not isinstance(entries, list):
        raise ArchiveError("manifest.json is not a list")
    found: list[_Found] = []
    for e in entries:
        cfg_path = _member(root, e["Config"])
        cfg_digest = _file_digest(cfg_path)
        _copy_blob(store, cfg_path, cfg_digest)
        layers = []
        for name in e.get("Layers") or []:
            p = _member(root, name)
            d = _file_digest(p)
            _copy_blob(store, p, d)
            layers.append({"mediaType": DOCKER_LAYER, "digest": d, "size": p.stat().st_size})
        manifest = {
            "schemaVersion": 2,
            "mediaType": DOCKER_MANIFEST,
            "config": {
                "mediaType": DOCKER_CONFIG,
                "digest": cfg_digest,
                "size": cfg_path.stat().st_size,
            },
            "layers": layers,
        }
        man = json.dumps(manifest, indent=3).encode()
        man_digest = store.content.write_blob(man)
        names = []
        for t in e.get("RepoTags") or []:
            try:
                names.append(str(parse_normalized(t)))
            except InvalidReferenceError as exc:
                raise ArchiveError(f"bad tag {t!r} in manifest.json: {exc}") from None
        found.append(_Found(man_digest, names))
    return found


def _load_dir(store: ImageStore, root: Path) -> list[_Found]:
    if (root / "oci-layout").is_file() and (root / "index.json").is_file():
        return _oci(store, root)
    if (root / "manifest.json").is_file():
        return _docker(store, root)
    raise ArchiveError("neither an OCI image layout (oci-layout, index.json) nor a docker archive")


def import_archive(store: ImageStore, path: Path) -> list[ImageRecord]:
    """Load every image of the layout or archive at `path`; returns the registered records."""
    path = Path(path)
    with store.ingesting():
        try:
            if path.is_dir():
                found = _load_dir(store, path)
            else:
                tmp = Path(tempfile.mkdtemp(prefix=".tmp-import-", dir=store.root))
                try:
                    try:
                        with tarfile.open(path, "r:*") as tf:
                            tf.extractall(tmp, filter="data")
                    except (tarfile.TarError, OSError) as e:
                        raise ArchiveError(f"cannot read {path}: {e}") from None
                    found = _load_dir(store, tmp)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
        except (KeyError, TypeError) as e:
            raise ArchiveError(f"malformed image archive: missing {e}") from None
        return [store.register(f.manifest_digest, f.names, f.index_digest) for f in found]
