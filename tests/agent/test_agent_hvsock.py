"""Hybrid vsock: the host-side CONNECT handshake (our dialer) and the Firecracker-style muxer,
as byte tables and over real unix sockets."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import pytest
from agent_support import short_dir

from podgate.aio.errors import ConnectError
from podgate.aio.streams import SocketStream, start_unix_server
from podgate.linux.vmm import (
    FIRST_HOST_PORT,
    MAX_REQUEST_BYTES,
    MIN_REQUEST_BYTES,
    InvalidPortRequestError,
    Muxer,
    VmmError,
    parse_connect_request,
    start_vmm,
)
from podgate.linux.vsock import (
    HybridVsockError,
    connect,
    connect_request,
    parse_address,
    parse_ok_reply,
)

# Firecracker docs/vsock.md: the bytes a host sends to reach guest port 1024.
CONNECT_1024 = bytes.fromhex("43 4f 4e 4e 45 43 54 20 31 30 32 34 0a")


@pytest.fixture
def sock_dir() -> Iterator[str]:
    with short_dir() as path:
        yield path


# ----------------------------------------------------------------------------- our dialer


def test_connect_request_bytes() -> None:
    assert connect_request(1024) == CONNECT_1024
    assert connect_request(0) == b"CONNECT 0\n"
    assert connect_request(2**32 - 1) == b"CONNECT 4294967295\n"


@pytest.mark.parametrize(
    ("line", "host_port"),
    [
        (b"OK 1073741824\n", 1073741824),  # Firecracker's first host port
        (b"OK\n", None),
        (b"xOKx\n", None),  # Kata accepts any line containing "OK"
        (b"OK abc\n", None),
    ],
)
def test_ok_replies(line: bytes, host_port: int | None) -> None:
    assert parse_ok_reply(line) == host_port


@pytest.mark.parametrize("line", [b"\n", b"NO\n", b"ERR 5\n", b"ok 1\n", b"O K\n"])
def test_refusals(line: bytes) -> None:
    with pytest.raises(HybridVsockError):
        parse_ok_reply(line)


@dataclass
class FakeMuxer:
    """Reads the request line, then sends `reply` in `pieces` writes; records what came in."""

    reply: bytes = b"OK 1073741824\n"
    pieces: int = 1
    silent: bool = False
    request: bytes = b""
    rest: bytearray = field(default_factory=bytearray)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, stream: SocketStream) -> None:
        try:
            line = bytearray()
            while not line.endswith(b"\n"):
                byte = await stream.receive(1)
                if not byte:
                    return
                line += byte
            self.request = bytes(line)
            if self.silent:
                await asyncio.sleep(3600)
            step = max(1, -(-len(self.reply) // self.pieces))
            for offset in range(0, len(self.reply), step):
                await stream.send(self.reply[offset : offset + step])
                await asyncio.sleep(0.01)
            if not self.reply.startswith(b"OK") and b"OK" not in self.reply:
                return
            while data := await stream.receive():
                self.rest += data
        finally:
            self.done.set()


@contextlib.asynccontextmanager
async def fake_muxer(path: str, muxer: FakeMuxer) -> AsyncIterator[FakeMuxer]:
    server = await start_unix_server(muxer.handle, path)
    try:
        yield muxer
    finally:
        server.close()
        await server.wait_closed()


async def test_dialer_sends_exactly_the_connect_line(sock_dir: str) -> None:
    uds = f"{sock_dir}/v.sock"
    async with fake_muxer(uds, FakeMuxer()) as muxer:
        stream = await connect(parse_address(f"hvsock://{uds}:1024"))
        await stream.send_eof()
        async with asyncio.timeout(5):
            await muxer.done.wait()
        await stream.aclose()
    assert muxer.request == CONNECT_1024
    assert bytes(muxer.rest) == b""  # nothing but the line


@pytest.mark.parametrize("pieces", [1, 3, 40])
async def test_early_payload_after_ok_is_not_swallowed(sock_dir: str, pieces: int) -> None:
    uds = f"{sock_dir}/v.sock"
    reply = b"OK 1073741824\n" + b"early payload"
    async with fake_muxer(uds, FakeMuxer(reply=reply, pieces=pieces)):
        stream = await connect(parse_address(f"hvsock://{uds}:1024"))
        got = b""
        async with asyncio.timeout(5):
            while len(got) < len(b"early payload"):
                got += await stream.receive()
        await stream.send(b"after")
        await stream.send_eof()
        await stream.aclose()
    assert got == b"early payload"


@pytest.mark.parametrize(
    "reply", [b"", b"NO\n", b"ERROR: no listener\n", b"x" * 100], ids=["eof", "no", "err", "long"]
)
async def test_no_ok_is_an_error(sock_dir: str, reply: bytes) -> None:
    uds = f"{sock_dir}/v.sock"
    async with fake_muxer(uds, FakeMuxer(reply=reply)):
        with pytest.raises(HybridVsockError):
            await connect(parse_address(f"hvsock://{uds}:1024"))


async def test_silent_muxer_times_out(sock_dir: str) -> None:
    uds = f"{sock_dir}/v.sock"
    async with fake_muxer(uds, FakeMuxer(silent=True)):
        with pytest.raises(HybridVsockError, match=r"no answer to CONNECT 1024 within 0\.2 s"):
            await connect(parse_address(f"hvsock://{uds}:1024"), timeout=0.2)


async def test_missing_device_socket(sock_dir: str) -> None:
    with pytest.raises(ConnectError, match="no such file or directory") as info:
        await connect(parse_address(f"hvsock://{sock_dir}/v.sock:1024"))
    assert not isinstance(info.value, HybridVsockError)


# ----------------------------------------------------------------------------- the muxer


@pytest.mark.parametrize(
    ("request_line", "port"),
    [
        (CONNECT_1024, 1024),
        (b"connect 1024\n", 1024),  # the first word is case-insensitive
        (b"CoNnEcT 7\n", 7),
        (b"connect 0\n", 0),  # the shortest request: 10 bytes
        (b"CONNECT 4294967295\n", 2**32 - 1),
        (b" CONNECT\t1024 \n", 1024),  # split on whitespace
        (b"CONNECT 1024 extra\n", 1024),  # only two words are looked at
        (b"CONNECT +5\n", 5),  # Rust's u32::from_str takes an optional '+'
        (b"CONNECT 1024" + b" " * 20, 1024),  # a full 32-byte buffer is parsed as it stands
    ],
)
def test_muxer_parses(request_line: bytes, port: int) -> None:
    assert parse_connect_request(request_line) == port


@pytest.mark.parametrize(
    "request_line",
    [
        b"CONNECT\n",
        b"\n",
        b"HELLO 1024\n",
        b"CONNECTX 1024\n",
        b"CONNECT -1\n",
        b"CONNECT 4294967296\n",
        b"CONNECT 0x10\n",
        b"CONNECT 1_024\n",
        b"CONNECT \xd9\xa1\n",  # ARABIC-INDIC DIGIT ONE: a digit to Python, not to Rust
        b"\xff\xfe 1024\n",  # not UTF-8
    ],
)
def test_muxer_rejects(request_line: bytes) -> None:
    with pytest.raises(InvalidPortRequestError):
        parse_connect_request(request_line)


def test_request_limits_are_firecrackers() -> None:
    # Firecracker reads len("connect 0\n") bytes, then byte-wise into a 32-byte buffer.
    assert (MIN_REQUEST_BYTES, MAX_REQUEST_BYTES) == (10, 32)


def test_host_ports_stay_in_range() -> None:
    # Firecracker: host ports in [2^30, 2^31), the first is 2^30; busy ones are skipped.
    muxer = Muxer("unused")
    first = muxer.allocate_port()
    assert first == FIRST_HOST_PORT == 1073741824
    ports = {first} | {muxer.allocate_port() for _ in range(50)}
    assert len(ports) == 51
    assert all(2**30 <= p < 2**31 for p in ports)
    muxer._last_port = 2**31 - 2  # near the top: allocation wraps inside the range
    wrapped = [muxer.allocate_port() for _ in range(4)]
    assert all(2**30 <= p < 2**31 for p in wrapped)
    assert not set(wrapped) & ports  # the ones still in use are skipped
    for port in ports:
        muxer.release_port(port)
    muxer._last_port = 2**31 - 1
    assert muxer.allocate_port() == 2**30


@dataclass
class Guest:
    """What the emulated guest's listener on PREFIX_<port> saw."""

    received: bytearray = field(default_factory=bytearray)
    connections: int = 0
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, stream: SocketStream) -> None:
        self.connections += 1
        await stream.send(b"guest says hi")
        while data := await stream.receive():
            self.received += data
        await stream.send_eof()
        self.closed.set()


@dataclass
class MuxerRig:
    uds: str
    prefix: str
    muxer: Muxer
    guest: Guest

    async def raw(self, data: bytes) -> SocketStream:
        stream = await SocketStream.connect_unix(self.uds)
        await stream.send(data)
        return stream


@pytest.fixture
async def rig(sock_dir: str) -> AsyncIterator[MuxerRig]:
    uds, prefix = f"{sock_dir}/v.sock", f"{sock_dir}/guest.vsock"
    guest = Guest()
    guest_server = await start_unix_server(guest.handle, f"{prefix}_1024")
    muxer = Muxer(prefix)
    listener = await muxer.listen(uds)
    try:
        yield MuxerRig(uds, prefix, muxer, guest)
    finally:
        listener.close()
        await muxer.aclose()
        guest_server.close()
        await guest_server.wait_closed()


async def _read_all(stream: SocketStream, timeout: float = 5) -> bytes:
    out = bytearray()
    async with asyncio.timeout(timeout):
        while data := await stream.receive():
            out += data
    return bytes(out)


def test_device_socket_mode(rig: MuxerRig) -> None:
    import os
    import stat

    assert stat.S_IMODE(os.stat(rig.uds).st_mode) == 0o600


@pytest.mark.parametrize(
    "request_line", [CONNECT_1024, b"connect 1024\n", b"CONNECT 1024" + b" " * 20]
)
async def test_muxer_connects_and_keeps_early_payload(rig: MuxerRig, request_line: bytes) -> None:
    # The request and the first payload arrive in one write: the muxer must not eat it.
    stream = await rig.raw(request_line + b"early payload")
    await stream.send_eof()
    answer = await _read_all(stream)
    await stream.aclose()
    assert answer == b"OK 1073741824\nguest says hi"
    assert bytes(rig.guest.received) == b"early payload"


async def test_concurrent_connections_get_distinct_host_ports(rig: MuxerRig) -> None:
    first = await connect(parse_address(f"hvsock://{rig.uds}:1024"))
    second = await rig.raw(CONNECT_1024)
    line = bytearray()
    async with asyncio.timeout(5):
        while not line.endswith(b"\n"):
            line += await second.receive(1)
    assert line == b"OK 1073741825\n"
    assert rig.muxer.active == 2
    for stream in (first, second):
        await stream.aclose()


@pytest.mark.parametrize(
    "request_line",
    [b"HELLO 1024\n", b"CONNECT x\n", b"CONNECT 99999999999\n", b"\xff" * 40, b"CONN"],
    ids=["verb", "port", "overflow", "binary", "short-then-eof"],
)
async def test_muxer_closes_malformed_requests(rig: MuxerRig, request_line: bytes) -> None:
    stream = await rig.raw(request_line)
    await stream.send_eof()
    assert await _read_all(stream) == b""  # closed without a reply
    await stream.aclose()
    assert rig.guest.connections == 0


async def test_muxer_closes_when_nothing_listens(rig: MuxerRig) -> None:
    stream = await rig.raw(b"CONNECT 2000\n")
    assert await _read_all(stream) == b""
    await stream.aclose()
    with pytest.raises(HybridVsockError, match="without OK"):
        await connect(parse_address(f"hvsock://{rig.uds}:2000"))


async def test_muxer_connection_limit(sock_dir: str) -> None:
    uds, prefix = f"{sock_dir}/v.sock", f"{sock_dir}/guest.vsock"
    guest = Guest()
    guest_server = await start_unix_server(guest.handle, f"{prefix}_1024")
    muxer = Muxer(prefix, max_connections=1)
    listener = await muxer.listen(uds)
    try:
        held = await connect(parse_address(f"hvsock://{uds}:1024"))
        with pytest.raises(HybridVsockError):
            await connect(parse_address(f"hvsock://{uds}:1024"))
        await held.aclose()
    finally:
        listener.close()
        await muxer.aclose()
        guest_server.close()
        await guest_server.wait_closed()


async def test_start_vmm_reports_a_failure(sock_dir: str) -> None:
    uds = f"{sock_dir}/missing/v.sock"  # no such directory: listening fails
    log = f"{sock_dir}/vmm.log"
    with pytest.raises(VmmError, match=f"vmm: cannot listen on {uds}"):
        await start_vmm(uds, f"{sock_dir}/guest.vsock", log, ready_file=f"{sock_dir}/ready")
