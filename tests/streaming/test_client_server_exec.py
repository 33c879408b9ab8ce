"""exec and attach, podgate client <-> podgate server over real sockets, in every protocol
generation: SPDY v4 (what the default offer negotiates), v3, v2, v1, and WebSocket v5, v4 and
the base64 variants.

Expected values come from the reference (k8s-streaming.md §4.4, §5.3-5.5) and from the
commands themselves (`seq`, `sha256sum`, `stty size`), computed here independently.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from dataclasses import dataclass

import pytest
from streaming_support import Api, Collector, Source, terminal_sizes

from podgate.aio.streams import DEFAULT_RECEIVE_BYTES, Buffer
from podgate.streaming.client import (
    EXEC_SPDY_PROTOCOLS,
    ExecResult,
    connect_spdy,
    connect_websocket,
    exec_query,
    exec_spdy,
    exec_websocket,
)

# An exec should take well under a second; this only stops a hang.
EXEC_TIMEOUT_SECONDS = 20.0


@dataclass(frozen=True)
class Generation:
    name: str
    websocket: bool
    offer: tuple[str, ...]
    json_status: bool  # v4+: a JSON Status with the exit code; else text, on failure only
    resize: bool  # tty resize events reach the process
    stdin_eof: bool  # the client can say "stdin ended" (SPDY FIN, v5 CLOSE)


# Each offers one protocol, except the first: kubectl's list, which negotiates v4.
SPDY = [
    Generation("spdy-default", False, EXEC_SPDY_PROTOCOLS, True, True, True),
    Generation("spdy-v3", False, ("v3.channel.k8s.io",), False, True, True),
    Generation("spdy-v2", False, ("v2.channel.k8s.io",), False, False, True),
    Generation("spdy-v1", False, ("channel.k8s.io",), False, False, True),
]
WEBSOCKET = [
    Generation("ws-v5", True, ("v5.channel.k8s.io",), True, True, True),
    Generation("ws-v4", True, ("v4.channel.k8s.io",), True, True, False),
    Generation("ws-v4-base64", True, ("v4.base64.channel.k8s.io",), True, True, False),
    Generation("ws-base64", True, ("base64.channel.k8s.io",), False, True, False),
]
ALL = SPDY + WEBSOCKET


def ids(generations: list[Generation]) -> list[str]:
    return [g.name for g in generations]


async def run(
    api: Api,
    gen: Generation,
    command: list[str],
    *,
    stdin: bytes | None = None,
    tty: bool = False,
    resize: tuple[tuple[int, int], ...] = (),
    subresource: str = "exec",
) -> tuple[ExecResult, bytes, bytes]:
    """Run `command`; (result, stdout, stderr)."""
    query = exec_query(command, stdin=stdin is not None, stdout=True, stderr=True, tty=tty)
    path = api.path(subresource, query)
    out, err = Collector(), Collector()
    source = Source(stdin) if stdin is not None else None
    resizes = terminal_sizes(*resize) if resize else None
    if gen.websocket:
        call = exec_websocket(
            api.endpoint,
            path,
            stdin=source,
            stdout=out,
            stderr=err,
            tty=tty,
            resizes=resizes,
            protocols=gen.offer,
        )
    else:
        call = exec_spdy(
            api.endpoint,
            path,
            stdin=source,
            stdout=out,
            stderr=err,
            tty=tty,
            resizes=resizes,
            protocols=gen.offer,
        )
    result = await asyncio.wait_for(call, EXEC_TIMEOUT_SECONDS)
    return result, out.data, err.data


# --------------------------------------------------------------------------- negotiation


@pytest.mark.parametrize(
    ("websocket", "offer", "negotiated"),
    [
        # SPDY: the first protocol the client lists that the server has; no v5 over SPDY.
        (False, EXEC_SPDY_PROTOCOLS, "v4.channel.k8s.io"),
        (False, ("v3.channel.k8s.io", "v4.channel.k8s.io"), "v3.channel.k8s.io"),
        (False, ("v2.channel.k8s.io",), "v2.channel.k8s.io"),
        (False, ("channel.k8s.io",), "channel.k8s.io"),
        # WebSocket: the first listed value the server allows (§5.1).
        (True, ("v5.channel.k8s.io", "v4.channel.k8s.io"), "v5.channel.k8s.io"),
        (True, ("v4.base64.channel.k8s.io", "v5.channel.k8s.io"), "v4.base64.channel.k8s.io"),
        (True, ("base64.channel.k8s.io",), "base64.channel.k8s.io"),
    ],
    ids=["spdy-kubectl", "spdy-v3-first", "spdy-v2", "spdy-v1", "ws-python", "ws-b64", "ws-v1"],
)
async def test_client_order_picks_the_protocol(
    api: Api, websocket: bool, offer: tuple[str, ...], negotiated: str
) -> None:
    path = api.path("exec", exec_query(["true"]))
    if websocket:
        conn, protocol = await connect_websocket(api.endpoint, path, offer)
        await conn.aclose()
    else:
        session, protocol, reader = await connect_spdy(api.endpoint, path, offer)
        await session.aclose()
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
    assert protocol == negotiated


# --------------------------------------------------------------------------- exit codes


@pytest.mark.parametrize("gen", ALL, ids=ids(ALL))
@pytest.mark.parametrize(
    ("command", "code"),
    [
        (["true"], 0),
        (["sh", "-c", "exit 3"], 3),
        (["sh", "-c", "kill -9 $$"], 137),  # 128 + SIGKILL, the runtimes' convention
    ],
    ids=["exit-0", "exit-3", "sigkill-137"],
)
async def test_exit_code_comes_back_in_the_status(
    api: Api, gen: Generation, command: list[str], code: int
) -> None:
    result, out, err = await run(api, gen, command)
    assert (out, err) == (b"", b"")
    if code == 0:
        assert result == ExecResult(0, None)
    elif gen.json_status:
        # client-go's rendering of the NonZeroExitCode Status (§4.4).
        assert result == ExecResult(code, f"command terminated with exit code {code}")
    else:
        # v1-v3: the text arrives as "error executing remote command: <text>" and no exit
        # code is available (§4.4), so it is a plain failure.
        assert result.exit_code == 1
        assert result.error is not None
        assert result.error.startswith(
            "error executing remote command: command terminated with non-zero exit code: "
        )
        assert str(code) in result.error


@pytest.mark.parametrize("gen", ALL, ids=ids(ALL))
async def test_command_that_cannot_start_is_a_failure_without_exit_code(
    api: Api, gen: Generation
) -> None:
    result, out, _ = await run(api, gen, ["/nonexistent/podgate-test-binary"])
    assert out == b""
    assert result.exit_code == 1
    assert result.error is not None
    assert "/nonexistent/podgate-test-binary" in result.error
    if gen.json_status:
        # An InternalError Status: client-go shows its message (§4.4).
        assert result.error.startswith("Internal error occurred: ")
    else:
        assert result.error.startswith("error executing remote command: ")


# --------------------------------------------------------------------------- stdout / stderr


@pytest.mark.parametrize("gen", ALL, ids=ids(ALL))
async def test_stdout_and_stderr_arrive_separately_and_exact(api: Api, gen: Generation) -> None:
    script = "seq 1 20000; seq 20001 30000 >&2; printf 'no newline'; printf '\\001\\377' >&2"
    result, out, err = await run(api, gen, ["sh", "-c", script])
    assert result == ExecResult(0, None)
    assert out == "".join(f"{i}\n" for i in range(1, 20001)).encode() + b"no newline"
    assert err == "".join(f"{i}\n" for i in range(20001, 30001)).encode() + b"\x01\xff"


# --------------------------------------------------------------------------- stdin with EOF


@pytest.mark.parametrize(
    "gen", [g for g in ALL if g.stdin_eof], ids=ids([g for g in ALL if g.stdin_eof])
)
async def test_stdin_then_eof_reaches_the_process(api: Api, gen: Generation) -> None:
    data = os.urandom(4 * 1024 * 1024 + 5)
    result, out, err = await run(api, gen, ["sha256sum"], stdin=data)
    assert result == ExecResult(0, None)
    assert out.decode() == f"{hashlib.sha256(data).hexdigest()}  -\n"
    assert err == b""


# --------------------------------------------------------------------------- tty and resize


RESIZABLE = [g for g in ALL if g.resize]


@pytest.mark.parametrize("gen", RESIZABLE, ids=ids(RESIZABLE))
async def test_tty_resize_reaches_the_terminal(api: Api, gen: Generation) -> None:
    # The first size arrives before the start, the second while the command sleeps.
    result, out, err = await run(
        api,
        gen,
        ["sh", "-c", "sleep 0.3; stty size"],
        tty=True,
        resize=((80, 24), (123, 45)),
    )
    assert result == ExecResult(0, None)
    assert out == b"45 123\r\n"  # rows columns, through the pty's onlcr
    assert err == b""  # a tty has no separate stderr


# --------------------------------------------------------------------------- attach


ATTACH = [SPDY[0], WEBSOCKET[0]]


@pytest.mark.parametrize("gen", ATTACH, ids=ids(ATTACH))
async def test_attach_feeds_stdin_to_the_main_process(api: Api, gen: Generation) -> None:
    # The demo pod's main process is `cat`; it gets stdin once and ends at its EOF.
    data = b"hello attach\n" * 1000
    result, out, err = await run(api, gen, [], stdin=data, subresource="attach")
    assert result == ExecResult(0, None)
    assert out == data
    assert err == b""


@pytest.mark.parametrize("gen", ALL, ids=ids(ALL))
async def test_tty_gives_the_command_a_terminal(api: Api, gen: Generation) -> None:
    script = "test -t 0 && test -t 1 && echo on a tty; echo to stderr >&2"
    # A client sends its size first thing where it can (else the server waits a moment).
    size = ((80, 24),) if gen.resize else ()
    result, out, err = await run(api, gen, ["sh", "-c", script], tty=True, resize=size)
    assert result == ExecResult(0, None)
    # One terminal for both outputs, with the pty's newline translation.
    assert out == b"on a tty\r\nto stderr\r\n"
    assert err == b""


# --------------------------------------------------------------------------- volume both ways


BULK = [SPDY[0], WEBSOCKET[0]]


@pytest.mark.parametrize("gen", BULK, ids=ids(BULK))
async def test_large_stdin_and_stdout_flow_at_once(api: Api, gen: Generation) -> None:
    # `cat` answers as it reads: stdin and stdout are busy at the same time, so neither
    # direction may wait for the other to finish.
    data = os.urandom(16 * 1024 * 1024)
    result, out, err = await run(api, gen, ["cat"], stdin=data)
    assert result == ExecResult(0, None)
    assert hashlib.sha256(out).digest() == hashlib.sha256(data).digest()
    assert err == b""


# --------------------------------------------------------------------------- clients that leave


class Forever(Source):
    """stdin that sends one line, then stays open."""

    def __init__(self) -> None:
        super().__init__(b"first line\n")
        self.sent = asyncio.Event()

    async def receive(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        chunk = await super().receive(max_bytes)
        if chunk:
            return chunk
        self.sent.set()
        await asyncio.Event().wait()
        return b""


class Notify(Collector):
    def __init__(self) -> None:
        super().__init__()
        self.got = asyncio.Event()

    async def send(self, data: Buffer) -> None:
        await super().send(data)
        self.got.set()


@pytest.mark.parametrize("gen", BULK, ids=ids(BULK))
async def test_client_leaving_mid_command_ends_the_session(api: Api, gen: Generation) -> None:
    """Like Ctrl-C in kubectl: the connection goes away while `cat` waits for more input.
    The server must close the process's stdin and finish (the fixture checks the handler)."""
    path = api.path("exec", exec_query(["cat"], stdin=True, stdout=True, stderr=True))
    out = Notify()
    call = (exec_websocket if gen.websocket else exec_spdy)(
        api.endpoint, path, stdin=Forever(), stdout=out, stderr=Collector(), protocols=gen.offer
    )
    task = asyncio.create_task(call)
    await asyncio.wait_for(out.got.wait(), EXEC_TIMEOUT_SECONDS)
    assert out.data == b"first line\n"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not await api.settle()
