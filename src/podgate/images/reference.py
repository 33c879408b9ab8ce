"""Image references, parsed and normalised as containerd and docker do.

Grammar (distribution/reference): ``[domain/]path[:tag][@digest]``. The first path component is
a registry host only when it contains ``.`` or ``:``, is ``localhost``, or has upper-case
letters; otherwise the host is ``docker.io`` and a one-component path gets ``library/``.
A reference without tag or digest gets ``:latest``; with both, the tag is dropped (containerd
keeps the digest only). See ../shared/docs/reference/images-and-oci.md §1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

__all__ = [
    "DEFAULT_DOMAIN",
    "DEFAULT_TAG",
    "InvalidReferenceError",
    "Reference",
    "is_image_id",
    "parse",
    "parse_normalized",
]

DEFAULT_DOMAIN: Final = "docker.io"
LEGACY_DEFAULT_DOMAIN: Final = "index.docker.io"
OFFICIAL_REPO_PREFIX: Final = "library/"
DEFAULT_TAG: Final = "latest"
# distribution/reference's NameTotalLengthMax: domain + path, in characters.
NAME_TOTAL_LENGTH_MAX: Final = 255

_ALNUM: Final = r"[a-z0-9]+"
_SEPARATOR: Final = r"(?:[._]|__|[-]+)"
_PATH_COMPONENT: Final = rf"{_ALNUM}(?:{_SEPARATOR}{_ALNUM})*"
_DOMAIN_COMPONENT: Final = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_IPV6: Final = r"\[(?:[a-fA-F0-9:]+)\]"
_DOMAIN: Final = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|{_IPV6})(?::[0-9]+)?"
_TAG: Final = r"[\w][\w.-]{0,127}"
_DIGEST: Final = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"

_REFERENCE_RE: Final = re.compile(
    rf"^(?P<name>(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*)"
    rf"(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?$"
)
_DOMAIN_RE: Final = re.compile(rf"^{_DOMAIN}$")
_HEX64_RE: Final = re.compile(r"^[a-f0-9]{64}$")
_ID_RE: Final = re.compile(r"^sha256:[a-f0-9]{64}$")
_SHA256_HEX_RE: Final = re.compile(r"^[a-f0-9]{64}$")


class InvalidReferenceError(ValueError):
    """The string is not an image reference; the message says why, as containerd words it."""


@dataclass(frozen=True)
class Reference:
    domain: str
    path: str
    tag: str | None = None
    digest: str | None = None

    @property
    def name(self) -> str:
        """The repository: ``docker.io/library/busybox``."""
        return f"{self.domain}/{self.path}"

    def __str__(self) -> str:
        s = self.name
        if self.tag is not None:
            s += f":{self.tag}"
        if self.digest is not None:
            s += f"@{self.digest}"
        return s

    def with_digest(self, digest: str) -> Reference:
        return Reference(self.domain, self.path, None, digest)

    def with_tag(self, tag: str) -> Reference:
        return Reference(self.domain, self.path, tag, None)

    @property
    def object(self) -> str:
        """What the registry is asked for: the digest if there is one, else the tag."""
        return self.digest or self.tag or DEFAULT_TAG


def is_image_id(s: str) -> bool:
    """``sha256:<64 hex>``: an image ID (the config digest), never a name."""
    return _ID_RE.match(s) is not None


def _split_domain(name: str) -> tuple[str, str]:
    first, sep, rest = name.partition("/")
    if not sep or (
        "." not in first and ":" not in first and first != "localhost" and first == first.lower()
    ):
        domain, remainder = DEFAULT_DOMAIN, name
    else:
        domain, remainder = first, rest
    if domain == LEGACY_DEFAULT_DOMAIN:
        domain = DEFAULT_DOMAIN
    if domain == DEFAULT_DOMAIN and "/" not in remainder:
        remainder = OFFICIAL_REPO_PREFIX + remainder
    return domain, remainder


def parse(s: str) -> Reference:
    """Parse and normalise a reference without adding a default tag (tag+digest kept)."""
    if not s:
        raise InvalidReferenceError("invalid reference format: empty reference")
    if _HEX64_RE.match(s):
        raise InvalidReferenceError(
            f"invalid repository name ({s}), cannot specify 64-byte hexadecimal strings"
        )
    # Split off digest and tag before the domain so `host:port/x` is not mistaken for a tag.
    rest, _, digest = s.partition("@")
    name, tag = rest, None
    colon = rest.rfind(":")
    if colon > rest.rfind("/"):
        name, tag = rest[:colon], rest[colon + 1 :]
    domain, path = _split_domain(name)
    if path.lower() != path:
        raise InvalidReferenceError(
            f"invalid reference format: repository name ({path}) must be lowercase"
        )
    full = f"{domain}/{path}"
    if tag is not None:
        full += f":{tag}"
    if digest:
        full += f"@{digest}"
    m = _REFERENCE_RE.match(full)
    if m is None or _DOMAIN_RE.match(domain) is None or (s.count("@") > 1):
        raise InvalidReferenceError(f"invalid reference format: {s!r}")
    if len(m.group("name")) > NAME_TOTAL_LENGTH_MAX:
        raise InvalidReferenceError(
            f"invalid reference format: repository name must not be more than "
            f"{NAME_TOTAL_LENGTH_MAX} characters"
        )
    dg = m.group("digest")
    if dg is not None:
        algo, _, hexpart = dg.partition(":")
        if algo == "sha256" and _SHA256_HEX_RE.match(hexpart) is None:
            raise InvalidReferenceError(f"invalid checksum digest format: {dg!r}")
        if algo != "sha256":
            raise InvalidReferenceError(f"unsupported digest algorithm: {dg!r}")
    return Reference(domain, path, m.group("tag"), dg)


def parse_normalized(s: str) -> Reference:
    """containerd's normalisation: ``:latest`` when no tag/digest; digest wins over a tag."""
    ref = parse(s)
    if ref.digest is not None:
        return Reference(ref.domain, ref.path, None, ref.digest)
    if ref.tag is None:
        return Reference(ref.domain, ref.path, DEFAULT_TAG, None)
    return ref
