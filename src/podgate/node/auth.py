"""Who is asking: client certificates signed by our CA, or bearer tokens from a static file.

The rules follow kube-apiserver's: an x509 identity is the subject CN with every O as a group,
and the token file is the `--token-auth-file` CSV. The certificate wins when both are present,
as the apiserver's union authenticator tries x509 before tokens.
"""

from __future__ import annotations

import csv
import hashlib
import hmac
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from podgate.node.watched import WatchedFile
from podgate.proto.k8s import http_status_body

log = logging.getLogger(__name__)

AuthMethod = Literal["x509", "token"]

ANONYMOUS: Final = None
"""What `Authenticator.authenticate` returns for a request that carries no valid credential."""


@dataclass(frozen=True, slots=True)
class UserInfo:
    name: str
    groups: tuple[str, ...]
    method: AuthMethod


class TokenFileError(ValueError):
    """The token file cannot be used; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class _Entry:
    digest: bytes  # sha256 of the token: fixed length, so comparing leaks nothing about length
    user: UserInfo
    uid: str


class TokenFile:
    """kube-apiserver's static token file: `token,user,uid[,"group1,group2"]` per line.

    Blank lines and lines starting with `#` are skipped. Unlike the apiserver, empty and
    duplicate tokens are errors rather than warnings, since both are certainly mistakes in a
    file of secrets. The file is re-read when it changes; an unreadable or invalid new version
    is logged and the previous entries stay in force.
    """

    def __init__(self, entries: Sequence[_Entry] = (), path: Path | None = None) -> None:
        self._entries: tuple[_Entry, ...] = tuple(entries)
        self._file = WatchedFile(path, _parse, TokenFileError, "token file") if path else None

    @classmethod
    def load(cls, path: Path | str) -> TokenFile:
        tokens = cls(path=Path(path))
        tokens._reload(raise_errors=True)
        return tokens

    @classmethod
    def parse(cls, text: str, source: str = "<tokens>") -> TokenFile:
        return cls(_parse(text, source))

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, token: str) -> UserInfo | None:
        """The user owning `token`, or None. Takes the same time whichever entry matches."""
        self._maybe_reload()
        candidate = hashlib.sha256(token.encode("utf-8")).digest()
        found: UserInfo | None = None
        for entry in self._entries:
            # No early exit: every entry is compared, so timing does not reveal which matched.
            if hmac.compare_digest(entry.digest, candidate):
                found = entry.user
        return found

    def _maybe_reload(self) -> None:
        if self._file is not None:
            self._reload(raise_errors=False)

    def _reload(self, *, raise_errors: bool) -> None:
        assert self._file is not None
        entries = self._file.reload(raise_errors=raise_errors)
        if entries is not None:
            self._entries = tuple(entries)
            log.info("loaded %d tokens from %s", len(entries), self._file.path)


def _parse(text: str, source: str) -> list[_Entry]:
    entries: list[_Entry] = []
    seen: dict[bytes, int] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        where = f"{source}:{lineno}"
        try:
            fields = next(csv.reader([stripped], strict=True))
        except csv.Error as exc:
            raise TokenFileError(f"{where}: not valid CSV: {exc}") from None
        fields = [f.strip() for f in fields]
        if len(fields) < 3:
            raise TokenFileError(
                f"{where}: expected token,user,uid[,groups]; found {len(fields)} column(s)"
            )
        if len(fields) > 4:
            raise TokenFileError(
                f'{where}: {len(fields)} columns; quote the groups column: "group1,group2"'
            )
        token, name, uid = fields[:3]
        if not token:
            raise TokenFileError(f"{where}: empty token")
        if any(c.isspace() for c in token):
            raise TokenFileError(f"{where}: token contains whitespace")
        if not name:
            raise TokenFileError(f"{where}: empty user name")
        groups = (
            tuple(g.strip() for g in fields[3].split(",") if g.strip()) if len(fields) > 3 else ()
        )
        digest = hashlib.sha256(token.encode("utf-8")).digest()
        if digest in seen:
            raise TokenFileError(f"{where}: duplicate token (first seen on line {seen[digest]})")
        seen[digest] = lineno
        entries.append(_Entry(digest, UserInfo(name, groups, "token"), uid))
    return entries


class Authenticator:
    """Turns a request's TLS peer certificate and headers into a `UserInfo` or `ANONYMOUS`."""

    def __init__(self, tokens: TokenFile | None) -> None:
        self._tokens = tokens

    def authenticate(
        self, headers: Sequence[tuple[bytes, bytes]], peercert: dict[str, Any] | None
    ) -> UserInfo | None:
        """`peercert` is `getpeercert()` of the TLS connection: it is only non-empty when the
        client certificate verified against our CA."""
        user = x509_user(peercert)
        if user is not None:
            return user
        if self._tokens is None:
            return ANONYMOUS
        token = bearer_token(headers)
        if token is None:
            return ANONYMOUS
        return self._tokens.lookup(token)


def x509_user(peercert: dict[str, Any] | None) -> UserInfo | None:
    """CN is the user and every O a group; no CN (or several) gives no identity."""
    if not peercert:
        return None
    cns: list[str] = []
    orgs: list[str] = []
    for rdn in peercert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                cns.append(value)
            elif key == "organizationName":
                orgs.append(value)
    if len(cns) != 1 or not cns[0]:
        return None
    return UserInfo(cns[0], tuple(orgs), "x509")


def bearer_token(headers: Sequence[tuple[bytes, bytes]]) -> str | None:
    """The token of the one `Authorization: Bearer <token>` header, or None.

    As RFC 6750 §2.1: the scheme is case-insensitive and followed by one or more spaces. No
    header, two headers, another scheme, an empty token or anything after the token is None.
    """
    values = [v for k, v in headers if k.lower() == b"authorization"]
    if len(values) != 1:
        return None
    try:
        value = values[0].decode("ascii").strip()
    except UnicodeDecodeError:
        return None
    scheme, sep, rest = value.partition(" ")
    if not sep or scheme.lower() != "bearer":
        return None
    token = rest.lstrip(" ")
    if not token or any(c.isspace() for c in token):
        return None
    return token


def unauthorized_body() -> bytes:
    """The 401 body kube-apiserver sends; kubectl then prints "You must be logged in"."""
    return http_status_body(401, "Unauthorized", "Unauthorized")
