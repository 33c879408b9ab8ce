"""The gateway's doors, over real TLS in one process: cross-site requests (Origin), DNS
rebinding (Host), the pre-auth budget, revocation by deleting the token file, and the audit
log's rate limit, aggregation and rotation. (`podgate demo` and the flood: test_demo_doors.)
"""

from __future__ import annotations

import asyncio
import json
import ssl
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from podgate.demo.api import DemoPod, DemoSource
from podgate.node.audit import AuditLog
from podgate.node.gateway import GatewayConfig
from podgate.node.listener import PreAuth
from podgate.node.origin import RequestOrigins, host_name
from podgate.node.server import RunningGateway, running_gateway
from podgate.proto.upgrade import ServerHandshake, UpgradeRequest
from podgate.streaming.local import LocalTarget

# Bound on one raw exchange with the gateway, seconds.
EXCHANGE_TIMEOUT_SECONDS = 15.0
# The browser-shaped upgrade of the issue: a page on evil.example asking for `id`.
EVIL_ORIGIN = "https://evil.example"
EXEC_ID = "/api/v1/namespaces/default/pods/demo/exec?command=id&stdout=true"
WS_KEY = "dGhlIHNhbXBsZSBub25jZQ=="


def browser_upgrade(host: str, origin: str | None, extra: Sequence[str] = ()) -> bytes:
    lines = [
        f"GET {EXEC_ID} HTTP/1.1",
        f"Host: {host}",
        "Connection: Upgrade",
        "Upgrade: websocket",
        f"Sec-WebSocket-Key: {WS_KEY}",
        "Sec-WebSocket-Version: 13",
        "Sec-WebSocket-Protocol: v4.channel.k8s.io",
        *([f"Origin: {origin}"] if origin else []),
        *extra,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def get(path: str, host: str, extra: Sequence[str] = ()) -> bytes:
    lines = [f"GET {path} HTTP/1.1", f"Host: {host}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@dataclass
class Reply:
    status: int
    body: bytes

    def status_object(self) -> dict[str, object]:
        obj = json.loads(self.body)
        assert obj["kind"] == "Status" and obj["apiVersion"] == "v1", obj
        return obj  # type: ignore[no-any-return]


async def exchange(
    port: int, data: bytes, ssl_context: ssl.SSLContext | None, *, host: str = "127.0.0.1"
) -> Reply:
    """Send one request; the status and (for a non-101) the body of the answer."""
    async with asyncio.timeout(EXCHANGE_TIMEOUT_SECONDS):
        reader, writer = await asyncio.open_connection(
            host, port, ssl=ssl_context, server_hostname=host if ssl_context else None
        )
        try:
            writer.write(data)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            body = b"" if status == 101 else await reader.readexactly(length)
            return Reply(status, body)
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, ssl.SSLError):
                pass


def config(tmp_path: Path, **extra: object) -> GatewayConfig:
    return GatewayConfig(state_dir=str(tmp_path), cri_socket="", port=0, **extra)  # type: ignore[arg-type]


def admin_context(gateway: RunningGateway) -> ssl.SSLContext:
    pki = gateway.credentials.pki
    return pki.client_ssl_context(pki.admin_cert, pki.admin_key)


def admin_token(gateway: RunningGateway) -> str:
    for line in gateway.credentials.token_file.read_text().splitlines():
        if not line.startswith("#"):
            return line.split(",")[0]
    raise AssertionError("no token")


def audit_entries(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[RunningGateway]:
    source = DemoSource(LocalTarget(), [DemoPod("default", "demo")])
    async with running_gateway(config(tmp_path), source) as running:
        yield running


# --- Origin and Host -----------------------------------------------------------------------


async def test_browser_upgrade_with_a_client_certificate_is_403(
    gateway: RunningGateway,
) -> None:
    """A browser presents an installed client certificate by itself: Origin still refuses."""
    host = f"127.0.0.1:{gateway.port}"
    refused = await exchange(
        gateway.port, browser_upgrade(host, EVIL_ORIGIN), admin_context(gateway)
    )
    assert refused.status == 403
    status = refused.status_object()
    assert status["reason"] == "Forbidden" and "Origin" in str(status["message"])
    # The same request without Origin (kubectl's shape) is upgraded: the check is what refused.
    allowed = await exchange(gateway.port, browser_upgrade(host, None), admin_context(gateway))
    assert allowed.status == 101


async def test_plain_http_requires_a_token_and_refuses_origin(tmp_path: Path) -> None:
    source = DemoSource(LocalTarget(), [DemoPod("default", "demo")])
    async with running_gateway(config(tmp_path, plain_http=True), source) as gateway:
        assert gateway.url.startswith("http://")
        host = f"127.0.0.1:{gateway.port}"
        bearer = [f"Authorization: Bearer {admin_token(gateway)}"]
        refused = await exchange(gateway.port, browser_upgrade(host, EVIL_ORIGIN, bearer), None)
        assert refused.status == 403
        assert "Origin" in str(refused.status_object()["message"])
        anonymous = await exchange(gateway.port, browser_upgrade(host, None), None)
        assert anonymous.status == 401
        allowed = await exchange(gateway.port, browser_upgrade(host, None, bearer), None)
        assert allowed.status == 101
        # The kubeconfig it writes carries the token and no CA (plain HTTP).
        text = gateway.credentials.kubeconfig_token.read_text()
        assert admin_token(gateway) in text and "certificate-authority" not in text


async def test_dns_rebinding_host_is_421(gateway: RunningGateway) -> None:
    ctx = admin_context(gateway)
    for host in ("evil.example", f"evil.example:{gateway.port}", "attacker.test:80"):
        reply = await exchange(gateway.port, get("/api/v1/namespaces/default/pods", host), ctx)
        assert reply.status == 421, host
        assert reply.status_object()["code"] == 421
    for host in (f"127.0.0.1:{gateway.port}", f"localhost:{gateway.port}", "127.0.0.1"):
        reply = await exchange(gateway.port, get("/api/v1/namespaces/default/pods", host), ctx)
        assert reply.status == 200, host
    garbled = await exchange(gateway.port, get("/api", "a:b:c"), ctx)
    assert garbled.status == 400


async def test_an_allow_listed_origin_and_a_san_are_accepted(tmp_path: Path) -> None:
    source = DemoSource(LocalTarget(), [DemoPod("default", "demo")])
    cfg = config(tmp_path, allowed_origins=("https://dash.example",), sans=("node1.example",))
    async with running_gateway(cfg, source) as gateway:
        ctx = admin_context(gateway)
        ok = await exchange(
            gateway.port, get("/api", "node1.example:6443", ["Origin: https://dash.example"]), ctx
        )
        assert ok.status == 200
        other = await exchange(
            gateway.port, get("/api", "node1.example", ["Origin: https://evil.example"]), ctx
        )
        assert other.status == 403


def test_the_gateways_own_origin_is_not_cross_site() -> None:
    """The Python client's WebSocket library sends the origin of the URL it dials."""
    origins = RequestOrigins(["10.1.2.3"])

    def check(host: str, origin: str) -> int | None:
        request = UpgradeRequest(
            "GET", "/", ((b"host", host.encode()), (b"origin", origin.encode()))
        )
        refusal = origins.check(request)
        return None if refusal is None else refusal.status

    assert check("127.0.0.1:6443", "https://127.0.0.1:6443") is None
    assert check("10.1.2.3:6443", "https://10.1.2.3:6443") is None
    assert check("10.1.2.3", "https://10.1.2.3:443") is None
    assert check("[::1]:6443", "https://[::1]:6443") is None
    # Another port, another name, a path, a rebound name: all cross-site.
    assert check("127.0.0.1:6443", "https://127.0.0.1:8443") == 403
    assert check("127.0.0.1:6443", "https://localhost:6443") == 403
    assert check("127.0.0.1:6443", "https://127.0.0.1:6443/x") == 403
    assert check("127.0.0.1:6443", "null") == 403
    assert check("evil.example:6443", "https://evil.example:6443") == 403


def test_host_names_are_parsed_like_go() -> None:
    assert host_name("Example.COM:8443") == "example.com"
    assert host_name("[::1]:6443") == "::1"
    assert host_name("[::1]") == "::1"
    assert host_name("10.0.0.1") == "10.0.0.1"
    for bad in ("", "a:b:c", "[::1", "x:port", "[::1]x", "h:123456"):
        assert host_name(bad) is None, bad
    origins = RequestOrigins(["10.1.2.3", "::"])
    request = UpgradeRequest("GET", "/", ((b"host", b"127.7.7.7:1"),))
    assert origins.check(request) is None  # every loopback address is this host
    two = UpgradeRequest("GET", "/", ((b"host", b"10.1.2.3"), (b"host", b"evil.example")))
    refusal = origins.check(two)
    assert refusal is not None and refusal.status == 400


# --- the pre-auth budget -------------------------------------------------------------------


async def refused_at_once(port: int) -> bool:
    """True if a fresh TCP connection is reset or closed before we send anything."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        async with asyncio.timeout(EXCHANGE_TIMEOUT_SECONDS):
            data = await reader.read(1)
        return data == b""
    except ConnectionResetError:
        return True
    finally:
        writer.close()


async def test_unauthenticated_connections_are_capped_and_recover(tmp_path: Path) -> None:
    source = DemoSource(LocalTarget(), [DemoPod("default", "demo")])
    cfg = config(tmp_path, max_unauthenticated=4, auth_timeout=60.0)
    async with running_gateway(cfg, source) as gateway:
        ctx = admin_context(gateway)
        api = get("/api", f"127.0.0.1:{gateway.port}")
        # Four silent connections (no TLS handshake) hold every slot ...
        idle = [await asyncio.open_connection("127.0.0.1", gateway.port) for _ in range(4)]
        for _ in range(400):  # ... once the gateway has accepted them.
            if gateway_preauth(gateway).pending == 4:
                break
            await asyncio.sleep(0.05)
        assert gateway_preauth(gateway).pending == 4
        # ... so the next connection is reset before any TLS work, even an admin's.
        assert await refused_at_once(gateway.port)
        with pytest.raises((ConnectionError, ssl.SSLError, asyncio.IncompleteReadError)):
            await exchange(gateway.port, api, ctx)
        assert gateway_preauth(gateway).refused >= 2
        # An authenticated connection frees its slot: it does not count against the cap.
        for _, writer in idle:
            writer.close()
        for _ in range(400):
            if gateway_preauth(gateway).pending == 0:
                break
            await asyncio.sleep(0.05)
        assert (await exchange(gateway.port, api, ctx)).status == 200
        held = [await asyncio.open_connection("127.0.0.1", gateway.port) for _ in range(3)]
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", gateway.port, ssl=ctx, server_hostname="127.0.0.1"
        )
        writer.write(api)
        await reader.readuntil(b"\r\n\r\n")  # authenticated and kept open
        assert (await exchange(gateway.port, api, ctx)).status == 200  # the 4th slot is free
        for _, w in [*held, (reader, writer)]:
            w.close()
    audit = audit_entries(tmp_path / "audit.log")
    assert any(e.get("reason") == "too many unauthenticated connections" for e in audit)


def gateway_preauth(gateway: RunningGateway) -> PreAuth:
    return gateway.preauth


async def test_a_silent_connection_is_closed_at_the_auth_deadline(tmp_path: Path) -> None:
    source = DemoSource(LocalTarget(), [DemoPod("default", "demo")])
    async with running_gateway(config(tmp_path, auth_timeout=1.0), source) as gateway:
        ctx = admin_context(gateway)
        # No TLS handshake at all ...
        reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
        async with asyncio.timeout(30):
            try:
                assert await reader.read(1) == b""
            except ConnectionResetError:
                pass
        writer.close()
        # ... and a TLS client that never sends an authenticated request.
        reader, writer = await asyncio.open_connection(
            "127.0.0.1",
            gateway.port,
            ssl=gateway.credentials.pki.client_ssl_context(),
            server_hostname="127.0.0.1",
        )
        statuses = []
        async with asyncio.timeout(30):
            try:
                while True:
                    writer.write(get("/api", f"127.0.0.1:{gateway.port}"))
                    head = await reader.readuntil(b"\r\n\r\n")
                    statuses.append(int(head.split(b" ", 2)[1]))
                    await reader.readexactly(
                        int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                    )
                    await asyncio.sleep(0.1)
            except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
                pass
        writer.close()
        assert statuses and set(statuses) == {401}
        assert gateway_preauth(gateway).timed_out >= 2
        assert (await exchange(gateway.port, get("/api", "127.0.0.1"), ctx)).status == 200


# --- revocation ----------------------------------------------------------------------------


async def test_deleting_the_token_file_revokes_at_the_next_request(
    gateway: RunningGateway,
) -> None:
    ctx = gateway.credentials.pki.client_ssl_context()
    bearer = [f"Authorization: Bearer {admin_token(gateway)}"]
    pods = get("/api/v1/namespaces/default/pods", "127.0.0.1", bearer)
    assert (await exchange(gateway.port, pods, ctx)).status == 200
    gateway.credentials.token_file.unlink()
    assert (await exchange(gateway.port, pods, ctx)).status == 401


# --- the audit log -------------------------------------------------------------------------


async def test_anonymous_denials_are_rate_limited_and_summed(tmp_path: Path) -> None:
    source = DemoSource(LocalTarget(), [DemoPod("default", "demo")])
    async with running_gateway(config(tmp_path), source) as gateway:
        ctx = gateway.credentials.pki.client_ssl_context()
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", gateway.port, ssl=ctx, server_hostname="127.0.0.1"
        )
        sent = 2000
        writer.write(get("/api/v1/pods", "127.0.0.1") * sent)  # pipelined
        got = 0
        async with asyncio.timeout(60):
            while got < sent:
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 401")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                got += 1
        writer.close()
    # The gateway is closed: the writer flushed a last summary.
    entries = audit_entries(tmp_path / "audit.log")
    full = [e for e in entries if e.get("reason") == "unauthenticated" and not e.get("summary")]
    summaries = [e for e in entries if e.get("summary")]
    assert 1 <= len(full) <= 50
    # Existing fields are kept on the full lines.
    assert {"time", "user", "address", "verb", "path", "outcome", "reason"} <= set(full[0])
    counted = sum(
        n
        for s in summaries
        for reasons in s["sources"].values()
        for n in reasons.values()  # type: ignore[union-attr]
    )
    assert len(full) + counted == sent
    assert all(set(s["sources"]) == {"127.0.0.1"} for s in summaries)  # type: ignore[arg-type]


def test_audit_log_rotates_by_size_and_keeps_a_count(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    audit = AuditLog(str(path), max_bytes=4096, keep=3)
    for n in range(2000):
        audit.write(user="u", n=n, outcome="allowed")
    audit.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["audit.log", "audit.log.1", "audit.log.2", "audit.log.3"]
    for p in tmp_path.iterdir():
        assert p.stat().st_size <= 4096
    # Newest last: audit.log holds the final lines, .3 the oldest kept, in order.
    numbers = [
        json.loads(line)["n"]
        for name in ("audit.log.3", "audit.log.2", "audit.log.1", "audit.log")
        for line in (tmp_path / name).read_text().splitlines()
    ]
    assert numbers == list(range(numbers[0], 2000))


def test_audit_writes_do_not_block_the_event_loop(tmp_path: Path) -> None:
    """The writer is a thread: `write` only queues, so a stalled disk never stalls requests."""
    path = tmp_path / "audit.log"
    audit = AuditLog(str(path))
    blocker = threading.Event()
    real_emit = audit._emit

    def slow_emit(line: str) -> None:
        blocker.wait(30)
        real_emit(line)

    audit._emit = slow_emit  # type: ignore[method-assign]
    for n in range(100):
        audit.write(n=n)  # returns although the writer is stuck
    assert path.read_text() == ""
    blocker.set()
    audit.flush()
    assert len(path.read_text().splitlines()) == 100
    audit.close()


# --- anonymous requests answered before the HTTP state machine -----------------------------


async def read_reply(reader: asyncio.StreamReader) -> Reply:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    return Reply(int(head.split(b" ", 2)[1]), await reader.readexactly(length))


async def test_anonymous_requests_are_answered_without_the_http_parser(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pipelined plain anonymous requests never reach ServerHandshake; a request that needs
    more (a body, credentials, a refused Host) does, with every byte after it, and gets the
    answer it got before."""
    fed: list[bytes] = []
    original = ServerHandshake.receive_data

    def counting(self: ServerHandshake, data: bytes) -> UpgradeRequest | None:
        if data:
            fed.append(data)
        return original(self, data)

    monkeypatch.setattr(ServerHandshake, "receive_data", counting)
    source = DemoSource(LocalTarget(), [DemoPod("default", "demo")])
    async with running_gateway(config(tmp_path), source) as gateway:
        ctx = gateway.credentials.pki.client_ssl_context()
        host = f"127.0.0.1:{gateway.port}"
        anonymous = get("/api/v1/pods", host)
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", gateway.port, ssl=ctx, server_hostname="127.0.0.1"
        )
        async with asyncio.timeout(EXCHANGE_TIMEOUT_SECONDS):
            writer.write(anonymous * 300)
            for _ in range(300):
                reply = await read_reply(reader)
                assert reply.status == 401
                assert reply.status_object()["reason"] == "Unauthorized"
            assert fed == []
            # What follows goes the full way, in order, on the same connection.
            with_body = b"POST /api/v1/pods HTTP/1.1\r\nHost: " + host.encode()
            with_body += b"\r\nContent-Length: 2\r\n\r\n{}"
            authed = get("/version", host, [f"Authorization: Bearer {admin_token(gateway)}"])
            rebound = get("/api", f"evil.example:{gateway.port}")
            tail = anonymous + with_body + anonymous + authed + anonymous + rebound
            writer.write(tail)
            statuses = [(await read_reply(reader)).status for _ in range(6)]
            assert statuses == [401, 401, 401, 200, 401, 421]
            assert b"".join(fed) == tail[len(anonymous) :]
            assert await reader.read() == b""  # 421 closes
        writer.close()
