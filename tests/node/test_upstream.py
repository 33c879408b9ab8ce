"""CriTarget against a real `podgate runtime`: exec, attach and port-forward through the URLs
CRI hands out, with the runtime's own streaming server on the other end."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from test_cri_client import ECHO_PORT, NAMESPACE, RuntimeProcess, podgate_runtime, require_root

from podgate.aio.errors import ForwardError, StreamResetError
from podgate.aio.http import next_request
from podgate.aio.memory import MemoryStream, memory_stream_pair
from podgate.aio.spdy import MAX_STREAMS_PER_SESSION
from podgate.aio.streams import ByteStream, SocketStream, start_server
from podgate.cri import api_pb2 as pb
from podgate.node.cri_client import CriClient
from podgate.node.upstream import CriTarget, UpstreamForwardError
from podgate.proto.remotecommand import TerminalSize
from podgate.proto.upgrade import ServerHandshake, StreamKind
from podgate.streaming.client import (
    UNIX_SOCKET_HOST,
    Endpoint,
    PortForwardSession,
    endpoint_from_url,
    exec_query,
    exec_spdy,
)
from podgate.streaming.server import StreamRequest, serve_stream
from podgate.streaming.target import ExecIO, PodRef, TargetError

# Bytes each forwarded connection moves each way in the transfer test.
TRANSFER_BYTES = 32 * 1024 * 1024
TRANSFER_CHUNK = 256 * 1024
CONNECTIONS = 4
# Bound on every single streaming operation of a test.
STEP_SECONDS = 30.0
CLOSED_PORT = 7999

# --------------------------------------------------------------------------- endpoint_from_url


def test_endpoint_from_http_url() -> None:
    endpoint, path = endpoint_from_url("http://127.0.0.1:10010/exec/Zm9vYmFy")
    assert endpoint == Endpoint("127.0.0.1", 10010)
    assert path == "/exec/Zm9vYmFy"
    assert endpoint.authority == "127.0.0.1:10010"


def test_endpoint_from_ipv6_url_keeps_query() -> None:
    endpoint, path = endpoint_from_url("http://[::1]:35000/portforward/tok?port=80&port=81")
    assert (endpoint.host, endpoint.port, endpoint.unix_path) == ("::1", 35000, None)
    assert endpoint.authority == "[::1]:35000"
    assert path == "/portforward/tok?port=80&port=81"


def test_endpoint_from_unix_url() -> None:
    # What podgate's runtime hands out on --stream-socket: the socket path percent-encoded.
    endpoint, path = endpoint_from_url("http+unix://%2Frun%2Fpodgate%2Fstream.sock/attach/t0k")
    assert endpoint.unix_path == "/run/podgate/stream.sock"
    assert endpoint.ssl_context is None
    assert endpoint.authority == UNIX_SOCKET_HOST
    assert path == "/attach/t0k"


def test_endpoint_from_https_url() -> None:
    context = ssl.create_default_context()
    endpoint, path = endpoint_from_url("https://node.example:10250/exec/x", ssl_context=context)
    assert (endpoint.host, endpoint.port, endpoint.ssl_context) == ("node.example", 10250, context)
    assert path == "/exec/x"
    default, _ = endpoint_from_url("https://node.example/exec/x")
    assert default.port == 443
    assert isinstance(default.ssl_context, ssl.SSLContext)
    plain, _ = endpoint_from_url("http://node.example/exec/x", ssl_context=context)
    assert (plain.port, plain.ssl_context) == (80, None)
    secure_unix, _ = endpoint_from_url("https+unix://%2Fs.sock/x", ssl_context=context)
    assert (secure_unix.unix_path, secure_unix.ssl_context) == ("/s.sock", context)


@pytest.mark.parametrize(
    "url",
    ["ftp://h/x", "ws://h:1/x", "http+tcp://h/x", "http:///x", "http+unix:///x", "h:1/x"],
)
def test_endpoint_from_bad_url(url: str) -> None:
    with pytest.raises(ValueError):
        endpoint_from_url(url)


# --------------------------------------------------------------------------- helpers


async def read_all(stream: ByteStream) -> bytes:
    out = bytearray()
    while chunk := await stream.receive():
        out += chunk
    return bytes(out)


@dataclass
class Stdio:
    """The client's side of an exec: what the target writes lands in memory."""

    io: ExecIO
    stdin: MemoryStream | None
    stdout: asyncio.Task[bytes]
    stderr: asyncio.Task[bytes] | None
    _ends: list[MemoryStream]

    async def finish(self) -> tuple[bytes, bytes | None]:
        for end in self._ends:
            await end.send_eof()  # as the server does once the target returns
        stderr = await self.stderr if self.stderr is not None else None
        return await self.stdout, stderr


def stdio(
    *, stdin: bool = False, tty: bool = False, resizes: AsyncIterator[TerminalSize] | None = None
) -> Stdio:
    ends = []
    client_in: MemoryStream | None = None
    target_in: MemoryStream | None = None
    if stdin:
        client_in, target_in = memory_stream_pair()
    target_out, client_out = memory_stream_pair()
    ends.append(target_out)
    stderr_task = None
    target_err: MemoryStream | None = None
    if not tty:
        target_err, client_err = memory_stream_pair()
        ends.append(target_err)
        stderr_task = asyncio.create_task(read_all(client_err))
    io = ExecIO(target_in, target_out, target_err, tty, resizes)
    return Stdio(io, client_in, asyncio.create_task(read_all(client_out)), stderr_task, ends)


@dataclass
class Setup:
    runtime: RuntimeProcess
    pod: PodRef
    echo: str
    shell: str


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    require_root()
    with podgate_runtime() as runtime:
        pod = runtime.run_pod("gw", uid="uid-gw")
        echo = runtime.echo_server(pod, "echo", ECHO_PORT)
        shell = runtime.create(pod, "shell", ["sleep", "600"])
        yield Setup(runtime, PodRef(NAMESPACE, "gw", "uid-gw", pod[0]), echo, shell)


@pytest.fixture
async def client(setup: Setup) -> AsyncIterator[CriClient]:
    client = CriClient(setup.runtime.cri_socket)
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
async def target(client: CriClient) -> AsyncIterator[CriTarget]:
    target = CriTarget(client)
    try:
        yield target
    finally:
        await target.aclose()


def count_calls(obj: object, name: str) -> list[tuple[Any, ...]]:
    """Record the arguments of every call of the async method `name` (which still runs)."""
    calls: list[tuple[Any, ...]] = []
    original: Callable[..., Awaitable[Any]] = getattr(obj, name)

    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return await original(*args, **kwargs)

    setattr(obj, name, wrapper)
    return calls


# --------------------------------------------------------------------------- exec / attach


async def test_exec_exit_code_and_output(setup: Setup, target: CriTarget) -> None:
    s = stdio()
    async with asyncio.timeout(STEP_SECONDS):
        code = await target.exec(
            setup.pod, setup.shell, ["sh", "-c", "echo out; echo err >&2; exit 3"], s.io
        )
        assert code == 3
        assert await s.finish() == (b"out\n", b"err\n")


async def test_exec_success(setup: Setup, target: CriTarget) -> None:
    s = stdio()
    async with asyncio.timeout(STEP_SECONDS):
        assert await target.exec(setup.pod, setup.shell, ["echo", "hello"], s.io) == 0
        assert await s.finish() == (b"hello\n", b"")


async def test_exec_stdin_sha256(setup: Setup, target: CriTarget) -> None:
    payload = os.urandom(3 * 1024 * 1024 + 17)
    s = stdio(stdin=True)
    assert s.stdin is not None

    async def feed() -> None:
        assert s.stdin is not None
        for i in range(0, len(payload), 100_000):
            await s.stdin.send(payload[i : i + 100_000])
        await s.stdin.send_eof()

    async with asyncio.timeout(STEP_SECONDS):
        feeder = asyncio.create_task(feed())
        code = await target.exec(setup.pod, setup.shell, ["sha256sum"], s.io)
        await feeder
        assert code == 0
        # coreutils: "<hex digest>  -" for standard input.
        expected = f"{hashlib.sha256(payload).hexdigest()}  -\n".encode()
        assert await s.finish() == (expected, b"")


async def test_exec_tty_sees_resize(setup: Setup, target: CriTarget) -> None:
    sizes: asyncio.Queue[TerminalSize | None] = asyncio.Queue()

    async def resizes() -> AsyncIterator[TerminalSize]:
        while (size := await sizes.get()) is not None:
            yield size

    # Silent until its terminal is 123 columns by 45 rows (a new pty is 0x0), then says so.
    script = (
        'while :; do s=$(stty size); [ "$s" = "45 123" ] && { echo "now $s"; exit 0; }; '
        "sleep 0.05; done"
    )
    s = stdio(stdin=True, tty=True, resizes=resizes())
    sizes.put_nowait(TerminalSize(width=123, height=45))
    try:
        async with asyncio.timeout(STEP_SECONDS):
            code = await target.exec(setup.pod, setup.shell, ["sh", "-c", script], s.io)
            assert code == 0
            # A tty turns "\n" into "\r\n", and there is no separate stderr.
            assert await s.finish() == (b"now 45 123\r\n", None)
    finally:
        sizes.put_nowait(None)


async def test_exec_in_unknown_container_is_a_target_error(setup: Setup, target: CriTarget) -> None:
    unknown = "e" * 64
    with pytest.raises(TargetError) as info:
        await target.exec(setup.pod, unknown, ["true"], stdio().io)
    assert str(info.value) == f"container {unknown!r} not found"


async def test_exec_failure_after_upgrade_is_the_runtime_message(
    setup: Setup, client: CriClient
) -> None:
    """The runtime's Status for a failed start reaches the gateway as its bare message."""
    runtime = setup.runtime
    victim = runtime.create(
        (setup.pod.sandbox_id, _sandbox_config(setup.pod)), "victim", ["sleep", "600"]
    )
    original = client.exec_url

    async def url_then_stop(*args: Any, **kwargs: Any) -> str:
        url = await original(*args, **kwargs)
        await asyncio.to_thread(runtime.stop_container, victim)  # gone before the upgrade
        return url

    client.exec_url = url_then_stop  # type: ignore[method-assign]
    target = CriTarget(client)
    try:
        with pytest.raises(TargetError) as info:
            await target.exec(setup.pod, victim, ["true"], stdio().io)
    finally:
        await target.aclose()
    # The runtime reports "Internal error occurred: <message>"; the gateway adds that prefix
    # again when it writes its own Status, so the target hands on the message alone.
    assert str(info.value) == f"container {victim} is not running (state exited)"


async def test_exec_refused_upgrade_is_a_target_error(setup: Setup, client: CriClient) -> None:
    original = client.exec_url

    async def used_token(*args: Any, **kwargs: Any) -> str:
        return await original(*args, **kwargs) + "-not-a-token"

    client.exec_url = used_token  # type: ignore[method-assign]
    target = CriTarget(client)
    try:
        with pytest.raises(TargetError) as info:
            await target.exec(setup.pod, setup.shell, ["true"], stdio().io)
    finally:
        await target.aclose()
    assert "404" in str(info.value)


async def test_attach(setup: Setup, target: CriTarget) -> None:
    runtime = setup.runtime
    config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name="cat"), command=["cat"], stdin=True, stdin_once=True
    )
    with runtime.channel() as channel:
        stub = runtime.stub(channel)
        request = pb.CreateContainerRequest(
            pod_sandbox_id=setup.pod.sandbox_id,
            config=config,
            sandbox_config=_sandbox_config(setup.pod),
        )
        cat = stub.CreateContainer(request).container_id
        stub.StartContainer(pb.StartContainerRequest(container_id=cat))
    s = stdio(stdin=True)
    assert s.stdin is not None
    async with asyncio.timeout(STEP_SECONDS):
        await s.stdin.send(b"hello attach\n")
        await s.stdin.send_eof()  # stdin_once: cat sees EOF and exits 0
        assert await target.attach(setup.pod, cat, s.io) == 0
        assert await s.finish() == (b"hello attach\n", b"")
    assert await asyncio.to_thread(runtime.wait_exited, cat) == 0


def _sandbox_config(pod: PodRef) -> pb.PodSandboxConfig:
    return pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=pod.name, namespace=pod.namespace, uid=pod.uid)
    )


async def test_exec_over_unix_socket_streaming() -> None:
    """A runtime serving its streams on a unix socket hands out http+unix:// URLs."""
    require_root()
    with podgate_runtime(stream_socket=True) as runtime:
        pod = runtime.run_pod("unix")
        shell = runtime.create(pod, "shell", ["sleep", "600"])
        client = CriClient(runtime.cri_socket)
        target = CriTarget(client)
        try:
            assert (await client.exec_url(shell, ["true"])).startswith("http+unix://")
            s = stdio()
            async with asyncio.timeout(STEP_SECONDS):
                ref = PodRef(NAMESPACE, "unix", "uid-unix", pod[0])
                assert await target.exec(ref, shell, ["sh", "-c", "echo via unix"], s.io) == 0
                assert await s.finish() == (b"via unix\n", b"")
        finally:
            await target.aclose()
            await client.close()


# --------------------------------------------------------------------------- port-forward


async def echo_check(stream: ByteStream, nbytes: int) -> None:
    """Send `nbytes` of random data while reading the echo; both sides sha256-checked."""
    sent, received = hashlib.sha256(), hashlib.sha256()
    count = 0

    async def upload() -> None:
        for _ in range(nbytes // TRANSFER_CHUNK):
            chunk = os.urandom(TRANSFER_CHUNK)
            sent.update(chunk)
            await stream.send(chunk)
        await stream.send_eof()

    uploader = asyncio.create_task(upload())
    while chunk := await stream.receive():
        received.update(chunk)
        count += len(chunk)
    await uploader
    assert count == nbytes
    assert received.hexdigest() == sent.hexdigest()


async def test_port_forward_shares_one_upstream_session(
    setup: Setup, client: CriClient, target: CriTarget
) -> None:
    calls = count_calls(client, "port_forward_url")
    async with asyncio.timeout(STEP_SECONDS):
        streams = await asyncio.gather(
            *(target.open_port(setup.pod, ECHO_PORT) for _ in range(CONNECTIONS))
        )
        try:
            await asyncio.gather(*(echo_check(s, TRANSFER_BYTES) for s in streams))
        finally:
            for s in streams:
                await s.aclose()
    assert calls == [(setup.pod.sandbox_id,)]
    assert list(target.pooled_sessions) == [setup.pod.sandbox_id]


async def hold_and_echo(target: CriTarget, pod: PodRef, count: int) -> None:
    """`count` forwards opened at once and held open together, each echoing its own random
    bytes (sha256-checked) before any is closed."""
    streams = await asyncio.gather(*(target.open_port(pod, ECHO_PORT) for _ in range(count)))
    try:
        payloads = [os.urandom(64) for _ in streams]
        for stream, payload in zip(streams, payloads, strict=True):
            await stream.send(payload)

        async def echoed(stream: ByteStream, size: int) -> bytes:
            got = b""
            while len(got) < size and (chunk := await stream.receive()):
                got += chunk
            return got

        answers = await asyncio.gather(*(echoed(s, 64) for s in streams))
        assert [hashlib.sha256(a).digest() for a in answers] == [
            hashlib.sha256(p).digest() for p in payloads
        ]
    finally:
        for stream in streams:
            await stream.aclose()


async def test_a_full_upstream_session_is_joined_by_another(
    setup: Setup, client: CriClient
) -> None:
    """Forwards beyond what one upstream session carries go on further sessions to the pod."""
    target = CriTarget(client, forwards_per_session=3)
    calls = count_calls(client, "port_forward_url")
    try:
        async with asyncio.timeout(STEP_SECONDS):
            await hold_and_echo(target, setup.pod, 7)
        (sessions,) = target.pooled_sessions.values()
        assert len(sessions) == len(calls) == 3
    finally:
        await target.aclose()


async def test_more_forwards_than_the_runtime_allows_per_session(
    setup: Setup, client: CriClient
) -> None:
    """The runtime refuses streams past its own cap (REFUSED_STREAM): the session counts as
    full and the next forwards go on a new one, none of them failing."""
    target = CriTarget(client, forwards_per_session=MAX_STREAMS_PER_SESSION)
    try:
        async with asyncio.timeout(4 * STEP_SECONDS):
            await hold_and_echo(target, setup.pod, MAX_STREAMS_PER_SESSION // 2 + 40)
        (sessions,) = target.pooled_sessions.values()
        assert len(sessions) == 2
    finally:
        await target.aclose()


class _FullSession:
    """A pooled session with no room, which counts how often it is looked at."""

    capacity = 1
    active = 1

    def __init__(self) -> None:
        self.looks = 0

    @property
    def usable(self) -> bool:
        self.looks += 1
        if self.looks > 1000:
            raise RuntimeError("the caller spins on a finished connection")
        return True


async def test_a_caller_between_a_connection_and_its_callback_does_not_spin(
    client: CriClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller that runs after a connecting task finished but before its done-callback
    removed it must open another connection, not await the finished one again (which never
    yields: the callback could never run)."""
    target = CriTarget(client, forwards_per_session=1)
    full, connects = _FullSession(), []

    async def connect(sandbox_id: str, key: str) -> Any:
        connects.append(key)
        await asyncio.sleep(0)
        if len(connects) > 1:
            raise TargetError("no room")  # the second connection: the caller moves on
        return full

    monkeypatch.setattr(target, "_connect", connect)

    async def late() -> None:
        # Two turns: the first caller's connection then finishes just before this runs.
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        await target._session("sandbox", "key")

    first = asyncio.create_task(target._session("sandbox", "key"))
    second = asyncio.create_task(late())
    async with asyncio.timeout(STEP_SECONDS):
        with pytest.raises(TargetError, match="no room"):
            await second
    first.cancel()
    with contextlib.suppress(asyncio.CancelledError, TargetError):
        await first
    assert full.looks < 1000 and len(connects) >= 2


async def test_port_forward_to_closed_port_relays_the_runtime_error(
    setup: Setup, client: CriClient, target: CriTarget
) -> None:
    calls = count_calls(client, "port_forward_url")
    async with asyncio.timeout(STEP_SECONDS):
        stream = await target.open_port(setup.pod, CLOSED_PORT)
        try:
            with pytest.raises(UpstreamForwardError) as info:
                await read_all(stream)
        finally:
            await stream.aclose()
        # Raised as a reset carrying the runtime's own text, for the server to relay.
        assert isinstance(info.value, ForwardError)
        assert isinstance(info.value, StreamResetError)
        prefix = f"error forwarding port {CLOSED_PORT} to pod {setup.pod.sandbox_id}, uid uid-gw: "
        assert str(info.value).startswith(prefix)
        assert "connection refused" in str(info.value)

        # The session survives: the next connection on the same pod works.
        stream = await target.open_port(setup.pod, ECHO_PORT)
        try:
            await echo_check(stream, TRANSFER_CHUNK * 4)
        finally:
            await stream.aclose()
    assert len(calls) == 1


async def test_port_forward_reconnects_after_the_session_breaks(
    setup: Setup, client: CriClient, target: CriTarget
) -> None:
    calls = count_calls(client, "port_forward_url")
    async with asyncio.timeout(STEP_SECONDS):
        stream = await target.open_port(setup.pod, ECHO_PORT)
        await echo_check(stream, TRANSFER_CHUNK)
        await stream.aclose()
        (first,) = target.pooled_sessions[setup.pod.sandbox_id]
        # The upstream connection goes away under the pool.
        await first.aclose()
        stream = await target.open_port(setup.pod, ECHO_PORT)
        try:
            await echo_check(stream, TRANSFER_CHUNK)
        finally:
            await stream.aclose()
    assert len(calls) == 2
    (second,) = target.pooled_sessions[setup.pod.sandbox_id]
    assert second is not first


async def test_idle_port_forward_session_is_closed(setup: Setup, client: CriClient) -> None:
    target = CriTarget(client, idle_seconds=0.2)
    calls = count_calls(client, "port_forward_url")
    try:
        async with asyncio.timeout(STEP_SECONDS):
            stream = await target.open_port(setup.pod, ECHO_PORT)
            await asyncio.sleep(0.4)  # in use: kept however long it takes
            assert setup.pod.sandbox_id in target.pooled_sessions
            await echo_check(stream, TRANSFER_CHUNK)
            await stream.aclose()
            (session,) = target.pooled_sessions[setup.pod.sandbox_id]
            await asyncio.sleep(0.5)
            assert target.pooled_sessions == {}
            assert session.session.broken is not None  # closed, not just forgotten
            stream = await target.open_port(setup.pod, ECHO_PORT)
            await echo_check(stream, TRANSFER_CHUNK)
            await stream.aclose()
    finally:
        await target.aclose()
    assert len(calls) == 2


async def test_port_forward_to_unknown_pod_is_a_target_error(target: CriTarget) -> None:
    unknown = PodRef(NAMESPACE, "ghost", "uid-ghost", "d" * 64)
    with pytest.raises(TargetError) as info:
        await target.open_port(unknown, ECHO_PORT)
    assert str(info.value) == f"pod sandbox {'d' * 64!r} not found"
    with pytest.raises(TargetError):
        await target.open_port(PodRef(NAMESPACE, "no-sandbox"), ECHO_PORT)


# --------------------------------------------------------------------------- both hops


@contextlib.asynccontextmanager
async def stream_server(what: StreamRequest, target: CriTarget) -> AsyncIterator[Endpoint]:
    """podgate's own streaming handlers in front of `target`, as the gateway serves them."""

    async def handle(conn: SocketStream) -> None:
        handshake = ServerHandshake()
        request = await next_request(conn, handshake)
        if request is not None:
            await serve_stream(conn, handshake, request, what, target)

    server = await start_server(handle, "127.0.0.1", 0)
    try:
        yield Endpoint("127.0.0.1", server.sockets[0].getsockname()[1])
    finally:
        server.close()
        await server.wait_closed()


async def test_gateway_relays_the_runtime_forward_error(setup: Setup, target: CriTarget) -> None:
    """Client -> podgate's port-forward server -> CriTarget -> the runtime: the client reads
    the runtime's own error text, once, not wrapped in a second `error forwarding port`."""
    what = StreamRequest(StreamKind.PORTFORWARD, setup.pod)
    async with stream_server(what, target) as endpoint, asyncio.timeout(STEP_SECONDS):
        session = await PortForwardSession.connect(endpoint, "/portforward")
        try:
            refused = await session.open(CLOSED_PORT)
            text = await refused.error()
            prefix = f"error forwarding port {CLOSED_PORT} to pod {setup.pod.sandbox_id}, uid "
            assert text.startswith(prefix + "uid-gw: ")
            assert text.count("error forwarding port") == 1
            assert "connection refused" in text

            forwarded = await session.open(ECHO_PORT)
            await echo_check(forwarded.data, 4 * TRANSFER_CHUNK)
            assert await forwarded.error() == ""
        finally:
            await session.aclose()


async def test_gateway_exec_through_the_runtime(setup: Setup, target: CriTarget) -> None:
    what = StreamRequest(StreamKind.EXEC, setup.pod, container=setup.shell)
    query = exec_query(["sh", "-c", "echo out; echo err >&2; exit 3"])
    stdout, client_stdout = memory_stream_pair()
    stderr, client_stderr = memory_stream_pair()
    async with stream_server(what, target) as endpoint, asyncio.timeout(STEP_SECONDS):
        readers = asyncio.gather(read_all(client_stdout), read_all(client_stderr))
        result = await exec_spdy(endpoint, f"/exec?{query}", stdout=stdout, stderr=stderr)
        await stdout.send_eof()
        await stderr.send_eof()
        assert await readers == [b"out\n", b"err\n"]
    assert (result.exit_code, result.error) == (3, "command terminated with exit code 3")


# --------------------------------------------------------------------------- via CRI Exec


async def test_port_forward_through_cri_exec(setup: Setup, client: CriClient) -> None:
    """The exec forwarder: no CRI PortForward at all; a forwarder run through CRI Exec in the
    pod's first running container carries each connection (what works with any runtime)."""
    target = CriTarget(client, via_exec=True)
    port_forwards = count_calls(client, "port_forward_url")
    execs = count_calls(client, "exec_url")
    try:
        async with asyncio.timeout(STEP_SECONDS):
            streams = [await target.open_port(setup.pod, ECHO_PORT) for _ in range(2)]
            try:
                await asyncio.gather(*(echo_check(s, TRANSFER_BYTES) for s in streams))
            finally:
                for s in streams:
                    await s.aclose()
            refused = await target.open_port(setup.pod, CLOSED_PORT)
            try:
                with pytest.raises(ForwardError) as info:
                    await read_all(refused)
            finally:
                await refused.aclose()
    finally:
        await target.aclose()
    assert port_forwards == []
    assert len(execs) == 3
    assert str(CLOSED_PORT) in str(info.value) or "refused" in str(info.value).lower()
