"""Authentication: the static token file, bearer header parsing, x509 identities and the
401 body."""

from __future__ import annotations

import hmac
import logging
import os
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import podgate.node.auth as auth
from podgate.node.auth import (
    ANONYMOUS,
    Authenticator,
    TokenFile,
    TokenFileError,
    UserInfo,
    bearer_token,
    unauthorized_body,
    x509_user,
)
from podgate.node.pki import ensure_pki

HANDSHAKE_TIMEOUT = 10.0  # seconds; loopback handshakes take milliseconds

TOKENS = """\
# token,user,uid,groups
abc123,alice,1001,"devs,ops"

  def456 , bob , 1002
ghi789,carol,1003,""
jkl012,dave,1004,"  devs , , qa "
"""


def bump_mtime(path: Path, step_ns: int = 1_000_000_000) -> None:
    """Move the mtime on explicitly: coarse filesystem clocks can leave it unchanged."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + step_ns))


# --- the token file ---------------------------------------------------------------------------


def test_token_file_parses_every_form() -> None:
    tokens = TokenFile.parse(TOKENS)
    assert len(tokens) == 4
    assert tokens.lookup("abc123") == UserInfo("alice", ("devs", "ops"), "token")
    assert tokens.lookup("def456") == UserInfo("bob", (), "token")
    assert tokens.lookup("ghi789") == UserInfo("carol", (), "token")
    assert tokens.lookup("jkl012") == UserInfo("dave", ("devs", "qa"), "token")


def test_token_file_accepts_crlf() -> None:
    tokens = TokenFile.parse('abc,alice,1,"a,b"\r\nxyz,bob,2\r\n')
    assert tokens.lookup("abc") == UserInfo("alice", ("a", "b"), "token")
    assert tokens.lookup("xyz") == UserInfo("bob", (), "token")


@pytest.mark.parametrize(
    "token",
    ["", "abc12", "abc1234", "ABC123", " abc123", "alice", "1001", "abc123,alice"],
)
def test_unknown_tokens_are_refused(token: str) -> None:
    assert TokenFile.parse(TOKENS).lookup(token) is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("abc,alice", r"<tokens>:1: expected token,user,uid\[,groups\]; found 2 column"),
        ("# c\n\nabc", r"<tokens>:3: expected token,user,uid\[,groups\]; found 1 column"),
        ("abc,alice,1,devs,ops", r"<tokens>:1: 5 columns; quote the groups column"),
        ("ok,a,1\n,alice,1", r"<tokens>:2: empty token"),
        ("abc,,1", r"<tokens>:1: empty user name"),
        ("a b,alice,1", r"<tokens>:1: token contains whitespace"),
        ('abc,alice,1,"devs', r"<tokens>:1: not valid CSV"),
        ("abc,alice,1\nx,y,2\nabc,bob,3", r"<tokens>:3: duplicate token \(first seen on line 1\)"),
    ],
)
def test_bad_token_files(text: str, message: str) -> None:
    with pytest.raises(TokenFileError, match=message):
        TokenFile.parse(text)


def test_load_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "tokens.csv"
    path.write_text("x,alice,1\nbroken\n")
    with pytest.raises(TokenFileError, match=r"tokens\.csv:2: "):
        TokenFile.load(path)
    with pytest.raises(TokenFileError, match="No such file"):
        TokenFile.load(tmp_path / "missing.csv")


def test_lookup_compares_every_entry_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []
    compare = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((len(a), len(b)))
        return compare(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    tokens = TokenFile.parse(TOKENS)
    for candidate, found in [
        ("abc123", True),
        ("jkl012", True),
        ("nope", False),
        ("x" * 500, False),
    ]:
        calls.clear()
        assert (tokens.lookup(candidate) is not None) is found
        # Every entry, whichever matched, always on 32-byte SHA-256 digests.
        assert calls == [(32, 32)] * 4


@settings(max_examples=100, deadline=None)
@given(
    table=st.dictionaries(
        st.text("abcdefghijklmnopqrstuvwxyz0123456789-._~+/=", min_size=1, max_size=12),
        st.text("abcdefghij", min_size=1, max_size=6),
        max_size=8,
    ),
    probe=st.text("abcdefghijklmnopqrstuvwxyz0123456789-._~+/=", min_size=1, max_size=12),
)
def test_lookup_finds_exactly_the_listed_tokens(table: dict[str, str], probe: str) -> None:
    text = "".join(f"{token},{user},uid\n" for token, user in table.items())
    tokens = TokenFile.parse(text)
    for token, user in table.items():
        assert tokens.lookup(token) == UserInfo(user, (), "token")
    expected = UserInfo(table[probe], (), "token") if probe in table else None
    assert tokens.lookup(probe) == expected


def test_reload_on_change(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "tokens.csv"
    path.write_text("old,alice,1\n")
    tokens = TokenFile.load(path)
    assert tokens.lookup("old") == UserInfo("alice", (), "token")

    path.write_text("new,alice,1\n")
    bump_mtime(path)
    assert tokens.lookup("old") is None
    assert tokens.lookup("new") == UserInfo("alice", (), "token")

    # An invalid version is logged once and the previous tokens stay.
    caplog.set_level(logging.ERROR, logger="podgate.node.auth")
    path.write_text("broken\n")
    bump_mtime(path)
    assert tokens.lookup("new") == UserInfo("alice", (), "token")
    assert tokens.lookup("new") == UserInfo("alice", (), "token")
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "tokens.csv:1" in errors[0].getMessage()

    path.write_text("newer,bob,2\n")
    bump_mtime(path)
    assert tokens.lookup("new") is None
    assert tokens.lookup("newer") == UserInfo("bob", (), "token")


def test_same_stamp_is_not_reread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tokens.csv"
    path.write_text("old,alice,1\n")
    tokens = TokenFile.load(path)
    reads: list[str] = []
    parse = auth._parse

    def counting_parse(text: str, source: str) -> Any:
        reads.append(text)
        return parse(text, source)

    monkeypatch.setattr(auth, "_parse", counting_parse)
    for _ in range(3):
        assert tokens.lookup("old") is not None
    assert reads == []


def test_deleted_file_revokes_every_token(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "tokens.csv"
    path.write_text("tok,alice,1\n")
    tokens = TokenFile.load(path)
    caplog.set_level(logging.WARNING, logger="podgate.node.watched")
    path.unlink()
    assert tokens.lookup("tok") is None
    assert tokens.lookup("tok") is None
    loud = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    assert len(loud) == 1, "one loud line, not one per request"
    assert "deleted" in loud[0].getMessage() and "no tokens" in loud[0].getMessage()
    # Back again: its tokens count again.
    path.write_text("tok,alice,1\n")
    assert tokens.lookup("tok") == UserInfo("alice", (), "token")


def test_same_size_edit_within_the_timestamp_is_seen(tmp_path: Path) -> None:
    path = tmp_path / "tokens.csv"
    path.write_text("aaaa,alice,1\n")
    tokens = TokenFile.load(path)
    before = path.stat()
    with open(path, "r+b") as f:  # in place: same inode, same size
        f.write(b"bbbb")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # and the same mtime
    assert path.stat().st_ino == before.st_ino and path.stat().st_size == before.st_size
    assert tokens.lookup("aaaa") is None
    assert tokens.lookup("bbbb") == UserInfo("alice", (), "token")


def test_a_half_written_version_never_takes_effect(tmp_path: Path) -> None:
    path = tmp_path / "tokens.csv"
    path.write_text("tok,alice,1\n")
    tokens = TokenFile.load(path)
    # A writer truncated the file and got one column out: invalid, so the old tokens stay.
    path.write_text("tok2")
    assert tokens.lookup("tok") == UserInfo("alice", (), "token")
    assert tokens.lookup("tok2") is None
    path.write_text("tok2,bob,2\n")
    assert tokens.lookup("tok2") == UserInfo("bob", (), "token")


# --- bearer headers ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "token"),
    [
        ([(b"authorization", b"Bearer abc123")], "abc123"),
        ([(b"Authorization", b"Bearer abc123")], "abc123"),
        ([(b"authorization", b"bearer abc123")], "abc123"),
        ([(b"authorization", b"BEARER abc123")], "abc123"),
        # RFC 6750: 1*SP between scheme and token.
        ([(b"authorization", b"Bearer   abc123")], "abc123"),
        ([(b"authorization", b"  Bearer abc123  ")], "abc123"),
        ([(b"host", b"x"), (b"authorization", b"Bearer a.b-c_d~e+f/g==")], "a.b-c_d~e+f/g=="),
        ([], None),
        ([(b"authorization", b"")], None),
        ([(b"authorization", b"Bearer")], None),
        ([(b"authorization", b"Bearer ")], None),
        ([(b"authorization", b"Bearer    ")], None),
        ([(b"authorization", b"Bearerabc123")], None),
        ([(b"authorization", b"Bearer\tabc123")], None),
        ([(b"authorization", b"Bearer abc123 extra")], None),
        ([(b"authorization", b"Basic YWxpY2U6cHc=")], None),
        ([(b"authorization", b"Bearer abc\xff")], None),
        ([(b"authorization", b"Bearer abc123"), (b"Authorization", b"Bearer abc123")], None),
        ([(b"authorization", b"Bearer abc123"), (b"authorization", b"Bearer def456")], None),
    ],
)
def test_bearer_token(headers: list[tuple[bytes, bytes]], token: str | None) -> None:
    assert bearer_token(headers) == token


# --- x509 identities --------------------------------------------------------------------------

ADMIN_PEERCERT: dict[str, Any] = {
    "subject": ((("organizationName", "system:masters"),), (("commonName", "admin"),)),
    "issuer": ((("commonName", "podgate-ca"),),),
}


@pytest.mark.parametrize(
    ("peercert", "user"),
    [
        (ADMIN_PEERCERT, UserInfo("admin", ("system:masters",), "x509")),
        (
            {
                "subject": (
                    (("countryName", "DE"),),
                    (("organizationName", "a"),),
                    (("organizationName", "b"),),
                    (("commonName", "n1"),),
                )
            },
            UserInfo("n1", ("a", "b"), "x509"),
        ),
        ({"subject": ((("commonName", "solo"),),)}, UserInfo("solo", (), "x509")),
        (None, None),
        ({}, None),
        ({"subject": ((("organizationName", "devs"),),)}, None),
        ({"subject": ((("commonName", ""),),)}, None),
        ({"subject": ((("commonName", "a"),), (("commonName", "b"),))}, None),
    ],
)
def test_x509_user(peercert: dict[str, Any] | None, user: UserInfo | None) -> None:
    assert x509_user(peercert) == user


def _real_peercert(tmp_path: Path) -> dict[str, Any] | None:
    """getpeercert() of a real TLS connection presenting a certificate issued for `dev`."""
    pki = ensure_pki(tmp_path / "pki")
    crt, key = pki.issue_client_cert("dev", ["devs", "ops"], tmp_path / "users")
    client_ctx = pki.client_ssl_context(crt, key)
    seen: list[dict[str, Any] | None] = []
    a, b = socket.socketpair()
    a.settimeout(HANDSHAKE_TIMEOUT)
    b.settimeout(HANDSHAKE_TIMEOUT)

    def serve() -> None:
        with pki.server_ssl_context().wrap_socket(a, server_side=True) as tls:
            seen.append(tls.getpeercert())
            tls.sendall(tls.recv(10))

    thread = threading.Thread(target=serve, name="tls-server")
    thread.start()
    with client_ctx.wrap_socket(b, server_hostname="localhost") as tls:
        tls.sendall(b"x")
        assert tls.recv(10) == b"x"
    thread.join(HANDSHAKE_TIMEOUT)
    return seen[0]


def test_x509_user_from_a_real_handshake(tmp_path: Path) -> None:
    peercert = _real_peercert(tmp_path)
    assert x509_user(peercert) == UserInfo("dev", ("devs", "ops"), "x509")


# --- the authenticator ------------------------------------------------------------------------


def test_x509_wins_over_token() -> None:
    authn = Authenticator(TokenFile.parse(TOKENS))
    headers = [(b"authorization", b"Bearer abc123")]
    assert authn.authenticate(headers, ADMIN_PEERCERT) == UserInfo(
        "admin", ("system:masters",), "x509"
    )


def test_token_when_no_certificate() -> None:
    authn = Authenticator(TokenFile.parse(TOKENS))
    headers = [(b"authorization", b"Bearer abc123")]
    alice = UserInfo("alice", ("devs", "ops"), "token")
    assert authn.authenticate(headers, None) == alice
    assert authn.authenticate(headers, {}) == alice
    # A certificate without a usable identity falls through to the token.
    assert authn.authenticate(headers, {"subject": ((("organizationName", "x"),),)}) == alice


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [(b"authorization", b"Bearer wrong")],
        [(b"authorization", b"Bearer ")],
        [(b"authorization", b"Basic abc123")],
        [(b"authorization", b"Bearer abc123"), (b"authorization", b"Bearer abc123")],
    ],
)
def test_anonymous(headers: list[tuple[bytes, bytes]]) -> None:
    assert ANONYMOUS is None
    assert Authenticator(TokenFile.parse(TOKENS)).authenticate(headers, None) is ANONYMOUS


def test_no_token_file_means_certificates_only() -> None:
    authn = Authenticator(None)
    assert authn.authenticate([(b"authorization", b"Bearer abc123")], None) is None
    assert authn.authenticate([], ADMIN_PEERCERT) == UserInfo("admin", ("system:masters",), "x509")


def test_unauthorized_body_is_the_apiserver_status() -> None:
    # The body kube-apiserver sends with a 401, with the final newline of its JSON encoder.
    assert unauthorized_body() == (
        b'{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",'
        b'"message":"Unauthorized","reason":"Unauthorized","code":401}\n'
    )


def test_userinfo_is_frozen() -> None:
    user = UserInfo("a", (), "token")
    with pytest.raises(AttributeError):
        user.name = "b"  # type: ignore[misc]
    assert hash(user) == hash(UserInfo("a", (), "token"))


def test_token_file_error_is_a_value_error() -> None:
    assert issubclass(TokenFileError, ValueError)
    with pytest.raises(ValueError):
        TokenFile.parse("x")
