"""Transport addresses: vsock://CID[:PORT], hvsock://PATH[:PORT], unix://PATH."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podgate.linux.vsock import (
    VMADDR_CID_ANY,
    VMADDR_PORT_ANY,
    Address,
    AddressError,
    Scheme,
    connect,
    parse_address,
)

V, H, U = Scheme.VSOCK, Scheme.HVSOCK, Scheme.UNIX

PARSED = [
    # A real VM's agent listens on any CID, port 1024 (Kata's DEFAULT_AGENT_VSOCK_PORT).
    ("vsock://-1:1024", Address(V, cid=0xFFFFFFFF, port=1024)),
    ("vsock://2", Address(V, cid=2)),  # the host; the port comes with each request
    ("vsock://3:-1", Address(V, cid=3, port=0xFFFFFFFF)),
    ("vsock://4294967295:1", Address(V, cid=0xFFFFFFFF, port=1)),
    ("vsock://3:0", Address(V, cid=3, port=0)),
    ("hvsock:///run/sb/v.sock:1024", Address(H, path="/run/sb/v.sock", port=1024)),
    ("hvsock:///run/sb/v.sock", Address(H, path="/run/sb/v.sock")),
    ("hvsock://v.sock:7", Address(H, path="v.sock", port=7)),
    # Only a decimal tail after the last ':' is a port.
    ("hvsock:///run/a:b/v.sock", Address(H, path="/run/a:b/v.sock")),
    ("hvsock:///run/a:1/v.sock", Address(H, path="/run/a:1/v.sock")),
    ("hvsock:///run/a:1/v.sock:2", Address(H, path="/run/a:1/v.sock", port=2)),
    ("unix:///run/sb/guest.vsock_1024", Address(U, path="/run/sb/guest.vsock_1024")),
    ("unix:///run/x.sock:1024", Address(U, path="/run/x.sock:1024")),  # unix has no ports
    ("unix://rel/x.sock", Address(U, path="rel/x.sock")),
]


@pytest.mark.parametrize(("text", "expected"), PARSED)
def test_parse(text: str, expected: Address) -> None:
    assert parse_address(text) == expected


def test_wildcards_are_the_kernel_constants() -> None:
    # <linux/vm_sockets.h>: VMADDR_CID_ANY and VMADDR_PORT_ANY are -1U.
    assert VMADDR_CID_ANY == 2**32 - 1
    assert VMADDR_PORT_ANY == 2**32 - 1


BAD = [
    "",
    "/run/x.sock",  # no scheme
    "tcp://127.0.0.1:80",
    "VSOCK://2:1",  # schemes are lower case
    "vsock://",
    "vsock://x:1",
    "vsock://2:abc",
    "vsock://2:",
    "vsock://2:4294967296",
    "vsock://4294967296:1",
    "vsock://-2:1",
    "vsock://2:+1",
    "vsock://2:1:3",
    "vsock:// 2:1",
    "hvsock://",
    "hvsock://:1024",
    "unix://",
    "unix://a\0b",
    "hvsock:///run/v.sock:4294967296",
]


@pytest.mark.parametrize("text", BAD)
def test_rejects(text: str) -> None:
    with pytest.raises(AddressError):
        parse_address(text)


@pytest.mark.parametrize(
    "text",
    ["vsock://-1:1024", "vsock://2", "vsock://3:-1", "hvsock:///a/v.sock:5", "unix:///a/b"],
)
def test_str_round_trips(text: str) -> None:
    assert str(parse_address(text)) == text


_PATH = st.text(
    alphabet=st.characters(blacklist_characters=":\0", blacklist_categories=("Cs",)), min_size=1
)
_U32 = st.integers(0, 2**32 - 1)


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(
        st.builds(lambda cid, port: Address(V, cid=cid, port=port), _U32, st.none() | _U32),
        st.builds(lambda path, port: Address(H, path=path, port=port), _PATH, st.none() | _U32),
        st.builds(lambda path: Address(U, path=path), _PATH),
    )
)
def test_any_address_survives_text(address: Address) -> None:
    assert parse_address(str(address)) == address


def test_with_port() -> None:
    assert parse_address("vsock://2").with_port(5000) == Address(V, cid=2, port=5000)
    with pytest.raises(AddressError):
        parse_address("vsock://2").with_port(2**32)


@pytest.mark.parametrize(
    ("text", "port"),
    [
        ("vsock://-1:5", None),  # cannot connect to a wildcard CID
        ("vsock://3:-1", None),  # nor to a wildcard port
        ("vsock://2", None),  # no port anywhere
        ("vsock://2:5", 6),  # a port twice
        ("hvsock:///x/v.sock", None),
        ("hvsock:///x/v.sock:5", 6),
        ("unix:///x/a.sock", 5),  # unix sockets have no ports
    ],
)
async def test_connect_refuses_incomplete_addresses(text: str, port: int | None) -> None:
    # Raised before any socket is made: nothing is dialed.
    with pytest.raises(AddressError):
        await connect(parse_address(text), port)
