"""One-time streaming tokens, as the CRI streaming server's request cache hands them out.

A CRI Exec/Attach/PortForward call stores its request and returns a URL holding a token; the
first connection to that URL takes the request out. No I/O here: time and randomness are
passed in, so expiry and the cap are tested without sleeping.
"""

from __future__ import annotations

import base64
import collections
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

# 6 random bytes → 8 URL-safe base64 characters (48 bits), as k8s.io/kubelet's request cache.
TOKEN_BYTES = 6
TOKEN_LENGTH = 8
# The client (kubelet/gateway) must connect within a minute of the CRI call.
TOKEN_TTL_SECONDS = 60.0
# Outstanding requests at most; past that CRI answers ResourceExhausted.
MAX_OUTSTANDING_TOKENS = 1000

T = TypeVar("T")


class TooManyRequestsError(Exception):
    """The cache is full of live tokens."""

    def __init__(self) -> None:
        super().__init__("maximum number of in-flight requests exceeded")


@dataclass(slots=True)
class _Entry(Generic[T]):
    token: str
    request: T
    expires: float


class TokenCache(Generic[T]):
    """Single-use tokens with a TTL and a cap on how many are outstanding."""

    def __init__(
        self,
        *,
        ttl: float = TOKEN_TTL_SECONDS,
        max_outstanding: int = MAX_OUTSTANDING_TOKENS,
        random_bytes: Callable[[int], bytes] = os.urandom,
    ) -> None:
        self._ttl = ttl
        self._max = max_outstanding
        self._random = random_bytes
        # Insertion order is expiry order (constant TTL), so purging pops from the left.
        self._entries: collections.OrderedDict[str, _Entry[T]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def insert(self, request: T, now: float) -> str:
        """Store `request`; return its token. TooManyRequestsError when full."""
        self._purge(now)
        if len(self._entries) >= self._max:
            raise TooManyRequestsError
        while True:
            token = base64.urlsafe_b64encode(self._random(TOKEN_BYTES)).decode()[:TOKEN_LENGTH]
            if token not in self._entries:
                break
        self._entries[token] = _Entry(token, request, now + self._ttl)
        return token

    def consume(self, token: str, now: float) -> T | None:
        """The request for `token`, once; None if unknown, used or expired."""
        entry = self._entries.pop(token, None)
        if entry is None or entry.expires <= now:
            return None
        return entry.request

    def _purge(self, now: float) -> None:
        while self._entries:
            first = next(iter(self._entries.values()))
            if first.expires > now:
                break
            self._entries.popitem(last=False)
