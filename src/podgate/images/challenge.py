"""Registry authentication, sans-IO: `WWW-Authenticate` challenges and token responses.

Grammar (RFC 7235): `scheme` then comma-separated `key=value` or `key="quoted value"`
parameters; a response may carry several challenges (several headers, or one header with
several schemes). Token responses are the Docker token spec's JSON.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Final

# The Docker token spec's lifetime for a token whose response gives none, seconds.
DEFAULT_TOKEN_LIFETIME_SECONDS: Final = 60
# A token is renewed this long before it expires, so a request never carries a stale one.
TOKEN_RENEW_MARGIN_SECONDS: Final = 5

_TOKEN68_OR_PARAM: Final = re.compile(
    r"""\s*(?P<key>[!#$%&'*+.^_`|~0-9A-Za-z-]+)\s*=\s*(?:"(?P<quoted>(?:[^"\\]|\\.)*)"|(?P<bare>[^\s,]*))\s*,?"""
)
_SCHEME: Final = re.compile(r"\s*(?P<scheme>[!#$%&'*+.^_`|~0-9A-Za-z-]+)(?:\s+|$)")


class ChallengeError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Challenge:
    scheme: str  # lower case: "bearer", "basic"
    params: dict[str, str] = field(default_factory=dict)


def parse_challenges(headers: list[str]) -> list[Challenge]:
    """Every challenge in the given `WWW-Authenticate` header values."""
    out: list[Challenge] = []
    for header in headers:
        pos = 0
        while pos < len(header):
            m = _SCHEME.match(header, pos)
            if m is None:
                break
            scheme = m["scheme"].lower()
            pos = m.end()
            params: dict[str, str] = {}
            while pos < len(header):
                p = _TOKEN68_OR_PARAM.match(header, pos)
                if p is None:
                    break
                value = p["quoted"] if p["quoted"] is not None else p["bare"]
                params[p["key"].lower()] = re.sub(r"\\(.)", r"\1", value)
                pos = p.end()
            out.append(Challenge(scheme, params))
            # Skip a stray separator before the next scheme.
            while pos < len(header) and header[pos] in ", ":
                pos += 1
    return out


@dataclass(frozen=True, slots=True)
class Token:
    value: str
    expires_at: float  # time.monotonic() seconds

    def fresh(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return now + TOKEN_RENEW_MARGIN_SECONDS < self.expires_at


def parse_token_response(body: bytes, now: float | None = None) -> Token:
    """`token` or `access_token`, with `expires_in` (default 60 s)."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise ChallengeError("token response is not JSON") from None
    if not isinstance(doc, dict):
        raise ChallengeError("token response is not a JSON object")
    value = doc.get("token") or doc.get("access_token")
    if not isinstance(value, str) or not value:
        raise ChallengeError("token response has no token")
    lifetime = doc.get("expires_in")
    if not isinstance(lifetime, int) or isinstance(lifetime, bool) or lifetime <= 0:
        lifetime = DEFAULT_TOKEN_LIFETIME_SECONDS
    now = time.monotonic() if now is None else now
    return Token(value, now + lifetime)
