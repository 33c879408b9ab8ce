"""OCI and Docker schema 2 manifests and indexes: media types, parsing, checks (sans-IO).

A registry names a document's type in `Content-Type`; the body must agree with it
(containerd refuses an index served as a manifest and the reverse, and every schema 1
document). Only what a pull needs is kept: descriptors, the config, the layers, platforms.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from podgate.images.platforms import Platform

# Manifests and indexes.
OCI_MANIFEST: Final = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX: Final = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST: Final = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_MANIFEST_LIST: Final = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_SCHEMA1: Final = "application/vnd.docker.distribution.manifest.v1+json"
DOCKER_SCHEMA1_SIGNED: Final = "application/vnd.docker.distribution.manifest.v1+prettyjws"
MANIFEST_TYPES: Final = frozenset({OCI_MANIFEST, DOCKER_MANIFEST})
INDEX_TYPES: Final = frozenset({OCI_INDEX, DOCKER_MANIFEST_LIST})
# What containerd sends in `Accept` when resolving a reference, in its order.
ACCEPT_MANIFESTS: Final = ", ".join(
    (DOCKER_MANIFEST, DOCKER_MANIFEST_LIST, OCI_MANIFEST, OCI_INDEX, "*/*")
)

# Configs.
OCI_CONFIG: Final = "application/vnd.oci.image.config.v1+json"
DOCKER_CONFIG: Final = "application/vnd.docker.container.image.v1+json"
CONFIG_TYPES: Final = frozenset({OCI_CONFIG, DOCKER_CONFIG})

# Layers podgate can unpack (the non-distributable ones are deprecated but still pulled).
LAYER_TYPES: Final = frozenset(
    {
        "application/vnd.oci.image.layer.v1.tar",
        "application/vnd.oci.image.layer.v1.tar+gzip",
        "application/vnd.oci.image.layer.v1.tar+zstd",
        "application/vnd.oci.image.layer.nondistributable.v1.tar",
        "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
        "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
        "application/vnd.docker.image.rootfs.diff.tar",
        "application/vnd.docker.image.rootfs.diff.tar.gzip",
        "application/vnd.docker.image.rootfs.diff.tar.zstd",
    }
)
# Windows base layers live outside the registry; podgate runs Linux images only.
FOREIGN_LAYER_TYPES: Final = frozenset(
    {
        "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
        "application/vnd.docker.image.rootfs.foreign.diff.tar",
    }
)

_DIGEST_RE: Final = re.compile(r"^sha256:[a-f0-9]{64}$")
# Generic types some registries and file servers use; the body then decides.
_GENERIC_TYPES: Final = frozenset(
    {"", "application/json", "text/plain", "application/octet-stream"}
)


class ManifestError(ValueError):
    """A manifest or index that podgate cannot use; the message says why."""


@dataclass(frozen=True, slots=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    platform: Platform | None = None
    urls: tuple[str, ...] = ()
    annotations: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Manifest:
    media_type: str
    config: Descriptor
    layers: tuple[Descriptor, ...]


@dataclass(frozen=True, slots=True)
class Index:
    media_type: str
    manifests: tuple[Descriptor, ...]


def _descriptor(obj: Any, where: str) -> Descriptor:
    if not isinstance(obj, dict):
        raise ManifestError(f"{where}: not an object")
    media_type = obj.get("mediaType", "")
    digest = obj.get("digest")
    size = obj.get("size")
    if not isinstance(media_type, str):
        raise ManifestError(f"{where}: mediaType is not a string")
    if not isinstance(digest, str) or _DIGEST_RE.match(digest) is None:
        raise ManifestError(f"{where}: unsupported or malformed digest {digest!r}")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ManifestError(f"{where}: size must be a non-negative integer")
    plat = None
    raw_platform = obj.get("platform")
    if isinstance(raw_platform, dict):
        os_name = raw_platform.get("os", "")
        arch = raw_platform.get("architecture", "")
        variant = raw_platform.get("variant", "")
        if all(isinstance(v, str) for v in (os_name, arch, variant)):
            plat = Platform(os_name, arch, variant)
    urls = obj.get("urls") or []
    annotations = obj.get("annotations") or {}
    if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
        raise ManifestError(f"{where}: urls must be a list of strings")
    if not isinstance(annotations, dict):
        raise ManifestError(f"{where}: annotations must be an object")
    return Descriptor(media_type, digest, size, plat, tuple(urls), annotations)


def _load(body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"manifest is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ManifestError("manifest is not a JSON object")
    return doc


def detect_type(content_type: str, body: bytes) -> str:
    """The document's media type: the response's, checked against the body (containerd's rules)."""
    declared = content_type.split(";", 1)[0].strip().lower()
    doc = _load(body)
    if declared in {DOCKER_SCHEMA1, DOCKER_SCHEMA1_SIGNED} or "fsLayers" in doc:
        raise ManifestError("media-type: schema 1 not supported")
    in_body = doc.get("mediaType", "")
    looks_like_index = "manifests" in doc
    looks_like_manifest = "layers" in doc or "config" in doc
    if declared in _GENERIC_TYPES:
        if isinstance(in_body, str) and in_body in MANIFEST_TYPES | INDEX_TYPES:
            declared = in_body
        elif looks_like_index:
            declared = OCI_INDEX
        elif looks_like_manifest:
            declared = OCI_MANIFEST
        else:
            raise ManifestError("media-type: cannot tell a manifest from an index")
    if declared in MANIFEST_TYPES and (looks_like_index or in_body in INDEX_TYPES):
        raise ManifestError(f"media-type: expected manifest but found index ({declared})")
    if declared in INDEX_TYPES and (looks_like_manifest or in_body in MANIFEST_TYPES):
        raise ManifestError(f"media-type: expected index but found manifest ({declared})")
    if declared not in MANIFEST_TYPES | INDEX_TYPES:
        raise ManifestError(f"unsupported manifest media type {declared!r}")
    return declared


def parse_manifest(body: bytes, media_type: str) -> Manifest:
    doc = _load(body)
    if doc.get("schemaVersion") != 2:
        raise ManifestError("manifest schemaVersion is not 2")
    config = _descriptor(doc.get("config"), "config")
    raw_layers = doc.get("layers")
    if not isinstance(raw_layers, list):
        raise ManifestError("manifest has no layers list")
    layers = tuple(_descriptor(d, f"layers[{i}]") for i, d in enumerate(raw_layers))
    for i, layer in enumerate(layers):
        if layer.media_type in FOREIGN_LAYER_TYPES:
            raise ManifestError(f"layers[{i}]: foreign (non-Linux) layer {layer.media_type}")
        if layer.media_type not in LAYER_TYPES:
            raise ManifestError(f"layers[{i}]: unsupported layer media type {layer.media_type!r}")
    if config.media_type and config.media_type not in CONFIG_TYPES:
        raise ManifestError(f"config: unsupported media type {config.media_type!r}")
    return Manifest(media_type, config, layers)


def parse_index(body: bytes, media_type: str) -> Index:
    doc = _load(body)
    if doc.get("schemaVersion") != 2:
        raise ManifestError("index schemaVersion is not 2")
    raw = doc.get("manifests")
    if not isinstance(raw, list):
        raise ManifestError("index has no manifests list")
    return Index(media_type, tuple(_descriptor(d, f"manifests[{i}]") for i, d in enumerate(raw)))


def diff_ids(config_body: bytes) -> tuple[str, ...]:
    """`rootfs.diff_ids` of an image config (one per layer, base first)."""
    doc = _load(config_body)
    rootfs = doc.get("rootfs")
    ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(ids, list) or not all(
        isinstance(d, str) and _DIGEST_RE.match(d) for d in ids
    ):
        raise ManifestError("image config has no valid rootfs.diff_ids")
    return tuple(ids)
