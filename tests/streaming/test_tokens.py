"""The streaming request cache: single use, 1 minute, at most 1000 outstanding."""

from __future__ import annotations

import itertools
import re

import pytest

from podgate.streaming.tokens import (
    MAX_OUTSTANDING_TOKENS,
    TOKEN_TTL_SECONDS,
    TokenCache,
    TooManyRequestsError,
)


def test_token_is_8_url_safe_characters_and_single_use() -> None:
    cache: TokenCache[str] = TokenCache()
    token = cache.insert("exec req", now=0.0)
    assert re.fullmatch(r"[A-Za-z0-9_-]{8}", token)
    assert cache.consume(token, now=1.0) == "exec req"
    assert cache.consume(token, now=1.0) is None  # reuse refused


def test_token_expires_after_one_minute() -> None:
    cache: TokenCache[str] = TokenCache()
    token = cache.insert("r", now=100.0)
    assert cache.consume(token, now=100.0 + TOKEN_TTL_SECONDS) is None
    token = cache.insert("r", now=100.0)
    assert cache.consume(token, now=100.0 + TOKEN_TTL_SECONDS - 0.001) == "r"


def test_unknown_token() -> None:
    assert TokenCache[str]().consume("AAAAAAAA", now=0.0) is None


def test_the_1001st_outstanding_request_is_refused_until_one_expires_or_is_used() -> None:
    cache: TokenCache[int] = TokenCache()
    tokens = [cache.insert(i, now=float(i) / 1000) for i in range(MAX_OUTSTANDING_TOKENS)]
    with pytest.raises(TooManyRequestsError, match="maximum number of in-flight requests"):
        cache.insert(1000, now=2.0)
    assert cache.consume(tokens[500], now=2.0) == 500  # using one frees a place
    cache.insert(1000, now=2.0)
    with pytest.raises(TooManyRequestsError):
        cache.insert(1001, now=2.0)
    # after the first ones expire, inserting purges them
    cache.insert(1001, now=TOKEN_TTL_SECONDS + 0.0005)
    assert len(cache) == MAX_OUTSTANDING_TOKENS


def test_colliding_random_tokens_are_redrawn() -> None:
    draws = itertools.chain([b"\x00" * 6, b"\x00" * 6], itertools.repeat(b"\x01" * 6))
    cache: TokenCache[str] = TokenCache(random_bytes=lambda n: next(draws))
    first = cache.insert("a", now=0.0)
    second = cache.insert("b", now=0.0)
    assert first != second
    assert cache.consume(first, 0.0) == "a" and cache.consume(second, 0.0) == "b"
