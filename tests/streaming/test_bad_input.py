"""Hostile or broken input against the running server, on real sockets: raw bytes written after
a proper upgrade (zlib bombs, unknown frames, bad stream headers, oversize WebSocket messages),
refused upgrades, and garbage instead of HTTP. Each must cost only the connection (or stream)
it arrived on; other sessions keep working.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import time
import tracemalloc
import zlib

import pytest
from streaming_support import ECHO_PORT, MIB, Api, PatternWriter, read_digest
from wsproto.connection import Connection, ConnectionType
from wsproto.events import BytesMessage, CloseConnection

from podgate.aio.errors import StreamResetError
from podgate.aio.streams import SocketStream
from podgate.aio.wschannel import ChannelSession
from podgate.proto.spdy import (
    HEADER_DICTIONARY,
    MAX_CONTROL_FRAME_LENGTH,
    GoAwayReceived,
    Role,
    SpdyConnection,
)
from podgate.proto.spdy.frames import (
    encode_control_header,
    encode_ping,
    encode_syn_stream,
)
from podgate.proto.upgrade import ClientHandshake, UpgradeResponse
from podgate.proto.wschannel import ChannelConnection
from podgate.proto.wschannel import Role as WsRole
from podgate.streaming.client import PortForwardSession, exec_query

PROMPT_SECONDS = 5.0
# A connection error must be answered this fast (the server must not inflate or buffer first).
FAST_SECONDS = 2.0
GOAWAY_PROTOCOL_ERROR = 1  # SPDY/3 GOAWAY status
RST_CANCEL = 5  # what Kubernetes servers reset refused streams with (§3)
MESSAGE_TOO_BIG = 1009  # RFC 6455
# x/net/websocket's limit, which kubelet/CRI servers apply (§5.1).
MAX_WS_MESSAGE_BYTES = 32 * MIB
# A DATA frame header for stream 0 (which no stream may use) and one payload byte.
DATA_ON_STREAM_0 = b"\0\0\0\0\0\0\0\1x"
SERVER_EXEC_SPDY = ["v4.channel.k8s.io", "v3.channel.k8s.io", "v2.channel.k8s.io", "channel.k8s.io"]


# --------------------------------------------------------------------------- raw connections


async def raw_request(
    api: Api, request: bytes, handshake: ClientHandshake
) -> tuple[SocketStream, UpgradeResponse]:
    """Send an HTTP request on a fresh connection; the connection and the parsed answer."""
    conn = await SocketStream.connect(api.endpoint.host, api.endpoint.port)
    await conn.send(request)
    async with asyncio.timeout(PROMPT_SECONDS):
        while True:
            data = await conn.receive()
            response = handshake.receive_data(data) if data else handshake.receive_eof()
            if response is not None:
                break
    if response.upgraded:
        conn.unread(handshake.trailing_data)
    return conn, response


async def spdy_upgrade(api: Api, path: str, protocols: list[str]) -> SocketStream:
    handshake = ClientHandshake()
    request = handshake.spdy_request("POST", path, api.endpoint.authority, protocols)
    conn, response = await raw_request(api, request, handshake)
    assert response.upgraded, response.error
    return conn


async def ws_upgrade(
    api: Api, path: str, protocols: list[str]
) -> tuple[SocketStream, UpgradeResponse]:
    key = base64.b64encode(os.urandom(16)).decode()
    handshake = ClientHandshake()
    request = handshake.ws_request(path, api.endpoint.authority, protocols, key)
    return await raw_request(api, request, handshake)


async def read_spdy_until_closed(conn: SocketStream) -> list[object]:
    """Parse what the server sends until it closes the connection; every event seen."""
    core = SpdyConnection(Role.CLIENT)
    events: list[object] = []
    async with asyncio.timeout(PROMPT_SECONDS):
        while data := await conn.receive():
            if not core.closed:
                events += core.receive_data(data)
    return events


async def assert_still_forwarding(session: PortForwardSession, seed: int) -> None:
    forwarded = await session.open(ECHO_PORT)
    writer = PatternWriter(seed, MIB)
    sending = asyncio.create_task(writer.write_to(forwarded.data))
    count, digest = await asyncio.wait_for(read_digest(forwarded.data), PROMPT_SECONDS)
    await sending
    assert (count, digest) == (MIB, writer.digest.hexdigest())


async def bystander(api: Api) -> PortForwardSession:
    """Another client's port-forward session, open before the attack and used during it."""
    session = await PortForwardSession.connect(api.endpoint, api.path("portforward"))
    await assert_still_forwarding(session, seed=1)
    return session


# --------------------------------------------------------------------------- SPDY: fatal frames


ZLIB_SEGMENT_BYTES = 16 * MIB
ZLIB_TAIL_BYTES = 1 * MIB
ZLIB_SEGMENTS = 64  # 64 x 16 MiB + 1 MiB: just over 1 GiB


def zlib_bomb() -> tuple[bytes, int]:
    """A SPDY header block (dictionary zlib stream) that inflates to just over 1 GiB of zeros,
    small enough to fit one control frame; (block, inflated size).

    After a full flush the compressor starts afresh, so every later 16 MiB segment compresses
    to the same bytes and decodes on its own: checking one segment checks them all.
    """
    zeros = bytes(ZLIB_SEGMENT_BYTES)
    deflate = zlib.compressobj(9, zlib.DEFLATED, 15, 9, zlib.Z_DEFAULT_STRATEGY, HEADER_DICTIONARY)
    first = deflate.compress(zeros) + deflate.flush(zlib.Z_FULL_FLUSH)
    segment = deflate.compress(zeros) + deflate.flush(zlib.Z_FULL_FLUSH)
    tail = deflate.compress(bytes(ZLIB_TAIL_BYTES)) + deflate.flush(zlib.Z_SYNC_FLUSH)
    assert len(zlib.decompressobj(zdict=HEADER_DICTIONARY).decompress(first)) == len(zeros)
    assert zlib.decompressobj(-15).decompress(segment) == zeros
    assert len(zlib.decompressobj(-15).decompress(tail)) == ZLIB_TAIL_BYTES
    block = first + segment * (ZLIB_SEGMENTS - 1) + tail
    return block, ZLIB_SEGMENTS * ZLIB_SEGMENT_BYTES + ZLIB_TAIL_BYTES


async def test_zlib_bomb_header_block_closes_only_that_connection(api: Api) -> None:
    block, inflated = zlib_bomb()
    assert inflated > 1024 * MIB
    frame = encode_syn_stream(1, block)
    # It fits the control-frame limit, so the server really has to inflate it.
    assert len(frame) - 8 <= MAX_CONTROL_FRAME_LENGTH
    other = await bystander(api)
    conn = await spdy_upgrade(api, api.path("portforward"), ["portforward.k8s.io"])
    try:
        tracemalloc.start()
        try:
            baseline, _ = tracemalloc.get_traced_memory()
            started = time.monotonic()
            await conn.send(frame)
            events = await read_spdy_until_closed(conn)
            elapsed = time.monotonic() - started
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert [type(e) for e in events] == [GoAwayReceived]
        assert events[0].status == GOAWAY_PROTOCOL_ERROR  # type: ignore[attr-defined]
        assert elapsed < FAST_SECONDS
        # The frame itself is 1 MiB; nothing near the inflated size was ever held.
        assert peak - baseline < 32 * MIB, f"{(peak - baseline) / MIB:.0f} MiB during the bomb"
        await assert_still_forwarding(other, seed=2)
    finally:
        await conn.aclose()
        await other.aclose()


@pytest.mark.parametrize(
    "frame",
    [
        encode_control_header(5, 0, 0),  # NOOP: unknown to spdystream
        encode_control_header(0x7FFF, 0, 4) + b"\0\0\0\1",  # no such type
        encode_control_header(6, 0, 4) + b"\0\0\0\0",  # PING with id 0
        encode_control_header(3, 0, 8) + b"\0\0\0\1\0\0\0\0",  # RST_STREAM with status 0
        encode_control_header(7, 0, 4) + b"\0\0\0\0",  # GOAWAY of the wrong length
        DATA_ON_STREAM_0,
        encode_control_header(1, 0, MAX_CONTROL_FRAME_LENGTH + 1),  # oversize, never sent
    ],
    ids=[
        "noop",
        "unknown-type",
        "ping-id-0",
        "rst-status-0",
        "short-goaway",
        "data-stream-0",
        "oversize-control",
    ],
)
async def test_malformed_frame_closes_only_that_connection(api: Api, frame: bytes) -> None:
    other = await bystander(api)
    conn = await spdy_upgrade(api, api.path("portforward"), ["portforward.k8s.io"])
    try:
        started = time.monotonic()
        await conn.send(encode_ping(1) + frame)  # a good frame first: it is still answered
        events = await read_spdy_until_closed(conn)
        assert time.monotonic() - started < FAST_SECONDS
        kinds = [type(e).__name__ for e in events]
        assert kinds == ["PingAcknowledged", "GoAwayReceived"]
        assert events[-1].status == GOAWAY_PROTOCOL_ERROR  # type: ignore[attr-defined]
        await assert_still_forwarding(other, seed=3)
    finally:
        await conn.aclose()
        await other.aclose()


async def test_malformed_frame_in_an_exec_session(api: Api) -> None:
    path = api.path("exec", exec_query(["cat"], stdin=True))
    conn = await spdy_upgrade(api, path, ["v4.channel.k8s.io"])
    try:
        await conn.send(DATA_ON_STREAM_0)
        events = await read_spdy_until_closed(conn)
        assert [type(e) for e in events] == [GoAwayReceived]
    finally:
        await conn.aclose()


# --------------------------------------------------------------------------- SPDY: bad streams


@pytest.mark.parametrize(
    "headers",
    [
        {"streamtype": "data", "port": "0", "requestid": "bad"},
        {"streamtype": "data", "port": "abc", "requestid": "bad"},
        {"streamtype": "data", "port": "65536", "requestid": "bad"},
        {"streamtype": "data", "port": "-1", "requestid": "bad"},
        {"streamtype": "data", "requestid": "bad"},
        {"streamtype": "sideways", "port": "7000", "requestid": "bad"},
        {"port": "7000", "requestid": "bad"},
    ],
    ids=["port-0", "port-abc", "port-65536", "port-negative", "no-port", "bad-type", "no-type"],
)
async def test_bad_stream_headers_reset_that_stream_only(api: Api, headers: dict[str, str]) -> None:
    session = await PortForwardSession.connect(api.endpoint, api.path("portforward"))
    try:
        with pytest.raises(StreamResetError) as info:
            await asyncio.wait_for(session.session.open_stream(headers), PROMPT_SECONDS)
        assert info.value.status == RST_CANCEL
        # The next valid pair on the same connection works.
        await assert_still_forwarding(session, seed=4)
    finally:
        await session.aclose()


# --------------------------------------------------------------------------- refused upgrades


@pytest.mark.parametrize(
    ("subresource", "server_protocols"),
    # podgate's UDP extension is listed too (one more protocol version; kubectl never offers it)
    [
        ("exec", SERVER_EXEC_SPDY),
        ("portforward", ["portforward.k8s.io", "udp.portforward.podgate.io"]),
    ],
)
async def test_unknown_spdy_protocol_is_403_with_the_accepted_versions(
    api: Api, subresource: str, server_protocols: list[str]
) -> None:
    query = exec_query(["true"]) if subresource == "exec" else ""
    handshake = ClientHandshake()
    request = handshake.spdy_request(
        "POST", api.path(subresource, query), api.endpoint.authority, ["v9.channel.k8s.io"]
    )
    conn, response = await raw_request(api, request, handshake)
    await conn.aclose()
    assert response.status == 403
    accepted = [
        v.decode()
        for n, v in response.headers
        if n.lower() == b"x-accepted-stream-protocol-versions"
    ]
    assert accepted == server_protocols  # one header line per server protocol (§2)
    assert response.body.decode().startswith(
        "unable to upgrade: unable to negotiate protocol: client supports [v9.channel.k8s.io], "
        f"server accepts [{' '.join(server_protocols)}]"
    )


async def test_unknown_websocket_protocol_is_403(api: Api) -> None:
    conn, response = await ws_upgrade(
        api, api.path("exec", exec_query(["true"])), ["v9.channel.k8s.io"]
    )
    await conn.aclose()
    assert response.status == 403  # kubectl falls back to SPDY on this (§6.4)


async def plain_request(api: Api, head: bytes) -> UpgradeResponse:
    """Send a raw request head and return the (non-upgrade) answer."""
    handshake = ClientHandshake()
    conn, response = await raw_request(api, head, handshake)
    await conn.aclose()
    assert not response.upgraded
    return response


async def test_exec_without_upgrade_headers_is_400(api: Api) -> None:
    path = api.path("exec", exec_query(["true"])).encode()
    response = await plain_request(
        api, b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
    )
    assert response.status == 400
    assert b"missing upgrade headers" in response.body  # (§2, step 1)


async def test_spdy_upgrade_without_protocol_versions_is_400(api: Api) -> None:
    path = api.path("exec", exec_query(["true"])).encode()
    response = await plain_request(
        api,
        b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n"
        b"Connection: Upgrade\r\nUpgrade: SPDY/3.1\r\n\r\n",
    )
    assert response.status == 400
    assert b"X-Stream-Protocol-Version is required" in response.body  # (§2, step 2)


@pytest.mark.parametrize("websocket", [False, True], ids=["spdy", "websocket"])
async def test_exec_without_any_stdio_is_400(api: Api, websocket: bool) -> None:
    path = api.path("exec", "command=true")  # none of stdin, stdout, stderr
    if websocket:
        conn, response = await ws_upgrade(api, path, ["v5.channel.k8s.io"])
    else:
        handshake = ClientHandshake()
        request = handshake.spdy_request("POST", path, api.endpoint.authority, SERVER_EXEC_SPDY)
        conn, response = await raw_request(api, request, handshake)
    await conn.aclose()
    assert response.status == 400
    # The kubelet's message (§4.2).
    assert b"you must specify at least 1 of stdin, stdout, stderr" in response.body


@pytest.mark.parametrize("query", ["", "ports=", "ports=abc", "ports=0", "ports=65536"])
async def test_websocket_port_forward_with_bad_ports_is_400(api: Api, query: str) -> None:
    conn, response = await ws_upgrade(api, api.path("portforward", query), ["v4.channel.k8s.io"])
    await conn.aclose()
    assert response.status == 400  # checked before the upgrade (§5.6)


@pytest.mark.parametrize("websocket", [False, True], ids=["spdy", "websocket"])
async def test_missing_pod_is_404_with_a_status_body(api: Api, websocket: bool) -> None:
    path = f"/api/v1/namespaces/{api.pod.namespace}/pods/missing/exec?{exec_query(['true'])}"
    if websocket:
        conn, response = await ws_upgrade(api, path, ["v5.channel.k8s.io"])
    else:
        handshake = ClientHandshake()
        request = handshake.spdy_request("POST", path, api.endpoint.authority, SERVER_EXEC_SPDY)
        conn, response = await raw_request(api, request, handshake)
    await conn.aclose()
    assert response.status == 404
    status = json.loads(response.body)
    # apimachinery's NewNotFound for the pods resource.
    assert status["kind"] == "Status"
    assert status["status"] == "Failure"
    assert status["reason"] == "NotFound"
    assert status["code"] == 404
    assert status["message"] == 'pods "missing" not found'
    assert response.error == 'Error from server (NotFound): pods "missing" not found'


async def test_garbage_instead_of_http_is_400_and_close(api: Api) -> None:
    conn = await SocketStream.connect(api.endpoint.host, api.endpoint.port)
    try:
        await conn.send(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 not http at all\r\n\r\n")
        received = b""
        async with asyncio.timeout(PROMPT_SECONDS):
            while chunk := await conn.receive():  # the server closes after answering
                received += chunk
        head, _, body = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 ")
        assert b"connection: close" in head.lower()
        status = json.loads(body)
        assert (status["kind"], status["code"]) == ("Status", 400)
    finally:
        await conn.aclose()


# --------------------------------------------------------------------------- WebSocket


async def test_oversize_websocket_message_is_closed_with_1009(api: Api) -> None:
    path = api.path("exec", exec_query(["cat"], stdin=True, stdout=True))
    conn, response = await ws_upgrade(api, path, ["v5.channel.k8s.io"])
    assert response.upgraded, response.error
    ws = Connection(ConnectionType.CLIENT)
    try:
        # One stdin message of channel byte + 32 MiB payload, sent as 1 MiB fragments.
        piece = bytes(MIB)
        await conn.send(ws.send(BytesMessage(data=b"\x00", message_finished=False)))
        close: CloseConnection | None = None
        async with asyncio.timeout(30):
            for _ in range(MAX_WS_MESSAGE_BYTES // MIB):
                await conn.send(ws.send(BytesMessage(data=piece, message_finished=False)))
            await conn.send(ws.send(BytesMessage(data=b"\x00", message_finished=True)))
            while close is None:
                data = await conn.receive()
                assert data, "connection closed without a close frame"
                ws.receive_data(data)
                close = next((e for e in ws.events() if isinstance(e, CloseConnection)), None)
        assert close.code == MESSAGE_TOO_BIG
    finally:
        await conn.aclose()


async def test_junk_on_unused_websocket_channels_is_dropped(api: Api) -> None:
    """Channels nobody requested, output channels and numbers >= 5 are ignored upstream
    (§5.3); a client writing a lot to one must not stall stdin."""
    path = api.path("exec", exec_query(["cat"], stdin=True, stdout=True, stderr=False))
    conn, response = await ws_upgrade(api, path, ["v5.channel.k8s.io"])
    assert response.upgraded, response.error
    session = ChannelSession(conn, ChannelConnection(WsRole.CLIENT, "v5.channel.k8s.io"))
    reader = asyncio.create_task(session.run())
    stdout = session.stream(1)
    status = session.stream(3)
    try:
        await session.stream(9).send(bytes(3 * MIB))
        await session.stream(2).send(bytes(3 * MIB))  # stderr was not requested
        await session.stream(1).send(bytes(3 * MIB))  # stdout only flows to the client
        await session.stream(0).send(b"stdin after the junk")
        await session.stream(0).send_eof()
        count, _ = await asyncio.wait_for(read_digest(stdout), PROMPT_SECONDS)
        assert count == len(b"stdin after the junk")
        assert json.loads(await status.receive())["status"] == "Success"
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        await session.aclose()


# --------------------------------------------------------------------------- HTTP heads


async def test_oversize_request_head_is_431(api: Api) -> None:
    # A plain socket: the server may close while our head is still being written, and the
    # answer already received must stay readable even if that write fails.
    loop = asyncio.get_running_loop()
    sock = socket.create_connection((api.endpoint.host, api.endpoint.port))
    sock.setblocking(False)
    filler = b"x" * (128 * 1024)  # twice podgate's head limit, far beyond any kubectl head
    head = b"GET /api HTTP/1.1\r\nHost: x\r\nX-Filler: " + filler + b"\r\n\r\n"

    async def write() -> None:
        with contextlib.suppress(OSError):
            await loop.sock_sendall(sock, head)

    writer = asyncio.create_task(write())
    received = b""
    try:
        async with asyncio.timeout(PROMPT_SECONDS):
            while chunk := await loop.sock_recv(sock, 65536):
                received += chunk
    except ConnectionResetError:
        pass  # the server closed with our bytes unread; what it sent first still counts
    finally:
        await writer
        sock.close()
    # RFC 6585: Request Header Fields Too Large.
    assert received.startswith(b"HTTP/1.1 431 ")


@pytest.mark.parametrize(
    "sent",
    [b"", b"POST /api/v1/namespaces/default/pods/demo/exec HTTP/1.1\r\nHost: x\r\n"],
    ids=["nothing", "half-a-head"],
)
async def test_client_that_never_finishes_its_head_is_disconnected(
    api: Api, sent: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection that never completes a request must not hold a handler forever."""
    from podgate.aio import http

    monkeypatch.setattr(http, "REQUEST_HEAD_TIMEOUT_SECONDS", 0.3)
    conn = await SocketStream.connect(api.endpoint.host, api.endpoint.port)
    try:
        await conn.send(sent)
        started = time.monotonic()
        async with asyncio.timeout(PROMPT_SECONDS):
            while await conn.receive():  # whatever it answers, it then closes
                pass
        assert time.monotonic() - started < FAST_SECONDS
    finally:
        await conn.aclose()
