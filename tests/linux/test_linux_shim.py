"""The container shim with real processes and namespaces: logs, exit files, attach, survival."""

from __future__ import annotations

import asyncio
import calendar
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from podgate.aio.memory import memory_stream_pair
from podgate.linux import ns
from podgate.linux.holder import start_holder, stop_holder
from podgate.linux.proc import is_alive, read_json, signal_process, wait_gone
from podgate.linux.shim import (
    DEFAULT_PATH,
    AttachConnection,
    ShimError,
    ShimExit,
    ShimReady,
    ShimSpec,
    attach,
    read_exit_file,
    start_shim,
)
from podgate.model import NamespaceMode, ProcessRef
from podgate.proto.attach import Stdout
from podgate.runtime.attach import run_attach
from podgate.streaming.target import ExecIO

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates namespaces"),
]

POD_HOSTNAME = "shim-pod"
# CRI log line: RFC3339Nano UTC time (Go drops trailing zeros of the fraction), stream, tag.
LOG_LINE = re.compile(
    r"(?P<ts>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(?P<frac>\d{0,8}[1-9]))?Z "
    r"(?P<stream>stdout|stderr) (?P<tag>[FP]) (?P<msg>[^\n]*)\n"
)
WAIT = 10.0


class Shims:
    """Starts shims for one pod and cleans up every process they started."""

    def __init__(self, tmp_path: Path, ns_pid: int) -> None:
        self.tmp_path = tmp_path
        self.ns_pid = ns_pid
        self.started: list[ShimReady] = []
        self.count = 0

    def spec(self, command: list[str], **kw: Any) -> ShimSpec:
        self.count += 1
        run = self.tmp_path / f"c{self.count}"
        run.mkdir()
        values: dict[str, Any] = {
            "container_id": f"c{self.count}",
            "command": command,
            "exit_file": str(run / "exit.json"),
            "attach_socket": str(run / "attach.sock"),
            "ready_file": str(run / "ready.json"),
            "log_file": str(run / "logs" / "0.log"),
            "ns_pid": self.ns_pid,
            "pid_mode": NamespaceMode.CONTAINER,
        }
        values.update(kw)
        return ShimSpec(**values)

    async def start(self, spec: ShimSpec) -> ShimReady:
        ready = await start_shim(spec)
        self.started.append(ready)
        return ready

    async def cleanup(self) -> None:
        for ready in self.started:
            signal_process(ready.process, signal.SIGKILL)
        for ready in self.started:
            if not await wait_gone(ready.shim, WAIT):
                signal_process(ready.shim, signal.SIGKILL)


@pytest.fixture
async def pod(tmp_path: Path) -> AsyncIterator[ProcessRef]:
    """A pod holder with its own PID namespace; yields the namespace process."""
    holder, ns_proc = await start_holder(
        POD_HOSTNAME, True, str(tmp_path / "holder.json"), str(tmp_path / "holder.log")
    )
    yield ns_proc
    await stop_holder(holder)


@pytest.fixture
async def shims(tmp_path: Path, pod: ProcessRef) -> AsyncIterator[Shims]:
    s = Shims(tmp_path, pod.pid)
    try:
        yield s
    finally:
        await s.cleanup()


async def _finished(ready: ShimReady, spec: ShimSpec) -> ShimExit:
    assert await wait_gone(ready.shim, WAIT), "the shim did not exit"
    result = read_exit_file(spec.exit_file)
    assert result is not None
    return result


def _ts_ns(match: re.Match[str]) -> int:
    seconds = calendar.timegm(time.strptime(match["ts"], "%Y-%m-%dT%H:%M:%S"))
    return seconds * 10**9 + int((match["frac"] or "").ljust(9, "0"))


def _log(spec: ShimSpec, since: int = 0, until: int | None = None) -> list[tuple[str, str, str]]:
    """(stream, tag, message) of every entry; each line must be exactly CRI-formatted."""
    text = Path(spec.log_file).read_text()
    entries = []
    position = 0
    while position < len(text):
        match = LOG_LINE.match(text, position)
        assert match is not None, f"bad CRI log line at {text[position:]!r}"
        stamp = _ts_ns(match)
        assert since <= stamp <= (until if until is not None else time.time_ns())
        entries.append((match["stream"], match["tag"], match["msg"]))
        position = match.end()
    return entries


async def _wait_for_log(spec: ShimSpec, count: int) -> list[tuple[str, str, str]]:
    async with asyncio.timeout(WAIT):
        while True:
            if Path(spec.log_file).exists() and len(entries := _log(spec)) >= count:
                return entries
            await asyncio.sleep(0.02)


async def _collect(conn: AttachConnection) -> tuple[bytes, bytes]:
    out, err = bytearray(), bytearray()
    async with asyncio.timeout(WAIT):
        async for event in conn:
            (out if isinstance(event, Stdout) else err).extend(event.data)
    return bytes(out), bytes(err)


# -- exit codes and the CRI log


async def test_exit_code_and_cri_log(shims: Shims) -> None:
    spec = shims.spec(["sh", "-c", "echo out; echo err >&2; exit 7"])
    before = time.time_ns()
    ready = await shims.start(spec)
    result = await _finished(ready, spec)
    after = time.time_ns()
    assert result == ShimExit(7, result.finished_at, "Error")
    assert before <= result.finished_at <= after
    assert before <= ready.started_at <= after
    entries = _log(spec, before, after)
    assert sorted(entries) == [("stderr", "F", "err"), ("stdout", "F", "out")]
    assert not os.path.exists(spec.attach_socket)
    data = read_json(spec.ready_file)
    assert data["container_pid"] == ready.process.pid
    assert data["shim_pid"] == ready.shim.pid


async def test_partial_and_long_lines(shims: Shims) -> None:
    script = "head -c 20000 /dev/zero | tr '\\0' a; echo; printf tail"
    spec = shims.spec(["sh", "-c", script])
    result = await _finished(await shims.start(spec), spec)
    assert (result.exit_code, result.reason) == (0, "Completed")
    assert _log(spec) == [
        ("stdout", "P", "a" * 16384),
        ("stdout", "F", "a" * (20000 - 16384)),
        ("stdout", "P", "tail"),
    ]


async def test_signal_exit_is_128_plus_signal(shims: Shims) -> None:
    # Outside a PID namespace of its own: PID 1 would ignore a signal it has no handler for.
    spec = shims.spec(["sh", "-c", "kill -TERM $$; sleep 5"], pid_mode=NamespaceMode.NODE)
    assert (await _finished(await shims.start(spec), spec)).exit_code == 128 + signal.SIGTERM


async def test_pid_1_of_its_own_namespace_ignores_unhandled_signals(shims: Shims) -> None:
    spec = shims.spec(["sh", "-c", "kill -TERM $$; echo survived"])
    assert (await _finished(await shims.start(spec), spec)).exit_code == 0
    assert _log(spec) == [("stdout", "F", "survived")]


async def test_env_is_replaced_hostname_and_workdir(shims: Shims) -> None:
    spec = shims.spec(
        ["sh", "-c", 'echo "$FOO|$HOSTNAME|$PATH|${HOME-unset}"; pwd'],
        env={"FOO": "bar baz"},
        working_dir="/tmp",
    )
    assert (await _finished(await shims.start(spec), spec)).exit_code == 0
    assert _log(spec) == [
        ("stdout", "F", f"bar baz|{POD_HOSTNAME}|{DEFAULT_PATH}|unset"),
        ("stdout", "F", "/tmp"),
    ]


async def test_user_and_group(shims: Shims) -> None:
    spec = shims.spec(["sh", "-c", "id -u; id -g; id -G"], uid=65534, gid=65534)
    assert (await _finished(await shims.start(spec), spec)).exit_code == 0
    assert [m for _, _, m in _log(spec)] == ["65534", "65534", "65534"]


# -- namespaces


async def test_container_pid_namespace_makes_it_pid_1(shims: Shims) -> None:
    spec = shims.spec(["sh", "-c", "echo $$"], pid_mode=NamespaceMode.CONTAINER)
    await _finished(await shims.start(spec), spec)
    assert _log(spec) == [("stdout", "F", "1")]


async def test_node_pid_namespace_is_the_hosts(shims: Shims) -> None:
    spec = shims.spec(["sh", "-c", "echo $$"], pid_mode=NamespaceMode.NODE)
    ready = await shims.start(spec)
    await _finished(ready, spec)
    assert _log(spec) == [("stdout", "F", str(ready.process.pid))]


async def test_pod_namespaces_are_joined_and_the_pid_is_signalled_directly(
    shims: Shims, pod: ProcessRef
) -> None:
    spec = shims.spec(["sh", "-c", "echo $$; exec sleep 30"], pid_mode=NamespaceMode.POD)
    ready = await shims.start(spec)
    [(_, _, inner_pid)] = await _wait_for_log(spec, 1)
    container = ready.process.pid
    for kind in ("net", "uts", "ipc", "pid"):
        assert ns.ns_inode(ns.ns_path(container, kind)) == ns.ns_inode(ns.ns_path(pod.pid, kind))
    # A private mount namespace of its own.
    assert ns.ns_inode(ns.ns_path(container, "mnt")) != ns.ns_inode("/proc/self/ns/mnt")
    # The pid it sees is its pid in the pod's namespace, where the holder's init is 1.
    nspid = Path(f"/proc/{container}/status").read_text().split("NSpid:\t")[1].split("\n")[0]
    assert nspid.split("\t") == [str(container), inner_pid]
    assert int(inner_pid) > 1
    assert signal_process(ready.process, signal.SIGKILL)
    assert (await _finished(ready, spec)).exit_code == 137


def _make_root(root: Path) -> None:
    """A tiny root filesystem: the shell, the libraries it links and an empty /proc."""
    shell = os.path.realpath("/bin/sh")
    files = [shell]
    for line in subprocess.run(
        ["ldd", shell], check=True, capture_output=True, text=True
    ).stdout.split("\n"):
        found = re.search(r"(/\S+) \(0x", line)
        if found:
            files.append(found[1])
    for name in files:
        target = root / name.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.realpath(name), target)
    (root / "bin").mkdir(exist_ok=True)
    if not (root / "bin" / "sh").exists():
        shutil.copy2(shell, root / "bin" / "sh")
    (root / "proc").mkdir()


async def test_root_dir_with_fresh_proc(shims: Shims, tmp_path: Path) -> None:
    root = tmp_path / "rootfs"
    _make_root(root)
    spec = shims.spec(
        ["sh", "-c", "echo $$; echo /proc/[0-9]*; echo /proc/self/ns/pid"],
        root_dir=str(root),
        pid_mode=NamespaceMode.CONTAINER,
    )
    assert (await _finished(await shims.start(spec), spec)).exit_code == 0
    assert [m for _, _, m in _log(spec)] == ["1", "/proc/1", "/proc/self/ns/pid"]
    # The /proc mount lived in the container's mount namespace only.
    assert str(root) not in Path("/proc/self/mountinfo").read_text()


# -- tty


async def test_tty_mode(shims: Shims) -> None:
    spec = shims.spec(
        ["sh", "-c", "test -t 0 && test -t 1 && test -t 2 && echo isatty; echo x >&2"], tty=True
    )
    assert (await _finished(await shims.start(spec), spec)).exit_code == 0
    # One pty: everything is stdout, and the tty's \r\n line ends become plain entries.
    assert _log(spec) == [("stdout", "F", "isatty"), ("stdout", "F", "x")]


async def test_tty_resize_through_attach(shims: Shims) -> None:
    spec = shims.spec(["sh", "-c", "read x; stty size"], tty=True, stdin=True)
    ready = await shims.start(spec)
    async with await attach(spec.attach_socket) as conn:
        await conn.resize(100, 40)
        await conn.send(b"go\n")
        out, err = await _collect(conn)
    assert conn.exit_code == 0
    assert err == b""
    assert out.endswith(b"40 100\r\n")
    await _finished(ready, spec)


# -- attach


async def test_stdin_once_cat(shims: Shims) -> None:
    spec = shims.spec(["cat"], stdin=True, stdin_once=True)
    ready = await shims.start(spec)
    async with await attach(spec.attach_socket) as conn:
        await conn.stdin.send(b"hello\n")
        await conn.stdin.send_eof()
        out, err = await _collect(conn)
    assert (out, err, conn.exit_code) == (b"hello\n", b"", 0)
    assert (await _finished(ready, spec)).exit_code == 0
    assert _log(spec) == [("stdout", "F", "hello")]


async def test_two_clients_see_the_same_output(shims: Shims) -> None:
    spec = shims.spec(
        ["sh", "-c", "read x; echo got $x; echo warn >&2"], stdin=True, stdin_once=True
    )
    ready = await shims.start(spec)
    async with await attach(spec.attach_socket) as a, await attach(spec.attach_socket) as b:
        await a.send(b"one\n")
        results = await asyncio.gather(_collect(a), _collect(b))
    assert list(results) == [(b"got one\n", b"warn\n")] * 2
    assert a.exit_code == b.exit_code == 0
    await _finished(ready, spec)


async def test_stdin_close_without_stdin_once_only_detaches(shims: Shims) -> None:
    spec = shims.spec(["cat"], stdin=True, stdin_once=False)
    ready = await shims.start(spec)
    async with await attach(spec.attach_socket) as a:
        await a.close_stdin()
        await _collect(a)
    assert a.exit_code is None  # the shim ended that session; the container runs on
    assert is_alive(ready.process)
    async with await attach(spec.attach_socket) as b:
        await b.send(b"still open\n")
        async with asyncio.timeout(WAIT):
            assert await b.receive() == Stdout(b"still open\n")
        signal_process(ready.process, signal.SIGKILL)
        assert await _collect(b) == (b"", b"")
    assert b.exit_code == 137
    assert (await _finished(ready, spec)).exit_code == 137


async def test_bad_client_is_dropped_alone(shims: Shims) -> None:
    spec = shims.spec(["sh", "-c", "read x; echo $x"], stdin=True, stdin_once=True)
    ready = await shims.start(spec)
    async with await attach(spec.attach_socket) as good:
        reader, writer = await asyncio.open_unix_connection(spec.attach_socket)
        writer.write(b"\x07\x00\x00\x00\x00")  # unknown frame type
        async with asyncio.timeout(WAIT):
            assert await reader.read() == b""  # dropped without an EXIT
        writer.close()
        await writer.wait_closed()
        await good.send(b"fine\n")
        assert await _collect(good) == (b"fine\n", b"")
    assert good.exit_code == 0
    await _finished(ready, spec)


async def test_run_attach_returns_the_exit_code(shims: Shims) -> None:
    spec = shims.spec(["sh", "-c", "cat; echo bye >&2; exit 5"], stdin=True, stdin_once=True)
    ready = await shims.start(spec)
    stdin_ours, stdin_theirs = memory_stream_pair()
    stdout_ours, stdout_theirs = memory_stream_pair()
    stderr_ours, stderr_theirs = memory_stream_pair()
    io = ExecIO(stdin=stdin_theirs, stdout=stdout_theirs, stderr=stderr_theirs, tty=False)
    task = asyncio.create_task(run_attach(spec.attach_socket, io))
    await stdin_ours.send(b"hello\n")
    await stdin_ours.send_eof()
    async with asyncio.timeout(WAIT):
        assert await task == 5
    assert await stdout_ours.receive() == b"hello\n"
    assert await stderr_ours.receive() == b"bye\n"
    await _finished(ready, spec)


async def test_run_attach_detaches_on_stdin_eof_without_stdin_once(shims: Shims) -> None:
    spec = shims.spec(["cat"], stdin=True, stdin_once=False)
    ready = await shims.start(spec)
    stdin_ours, stdin_theirs = memory_stream_pair()
    stdout_ours, stdout_theirs = memory_stream_pair()
    io = ExecIO(stdin=stdin_theirs, stdout=stdout_theirs, stderr=None, tty=False)
    task = asyncio.create_task(run_attach(spec.attach_socket, io))
    await stdin_ours.send(b"ping\n")
    assert await stdout_ours.receive() == b"ping\n"
    await stdin_ours.send_eof()
    async with asyncio.timeout(WAIT):
        assert await task == 0
    assert is_alive(ready.process)


# -- failures and survival


async def test_missing_executable_is_a_clear_error(shims: Shims) -> None:
    spec = shims.spec(["no-such-binary-here", "x"])
    with pytest.raises(ShimError) as info:
        await start_shim(spec)
    assert str(info.value) == 'exec: "no-such-binary-here": executable file not found in $PATH'
    assert read_json(spec.ready_file) == {"error": str(info.value)}
    assert not os.path.exists(spec.attach_socket)
    assert read_exit_file(spec.exit_file) is None
    spec = shims.spec(["/no/such/file"])
    with pytest.raises(ShimError, match=r'^exec: "/no/such/file": stat /no/such/file: no such'):
        await start_shim(spec)


async def test_bad_working_dir_is_a_clear_error(shims: Shims) -> None:
    spec = shims.spec(["true"], working_dir="/no-such-dir")
    with pytest.raises(ShimError) as info:
        await start_shim(spec)
    assert str(info.value) == 'chdir to cwd ("/no-such-dir") failed: no such file or directory'


_PARENT = """
import asyncio, json, sys
from podgate.linux.shim import ShimSpec, start_shim

async def main():
    ready = await start_shim(ShimSpec.from_json(json.loads(sys.argv[1])))
    print(json.dumps([ready.shim.pid, ready.shim.start_time,
                      ready.process.pid, ready.process.start_time]), flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


async def test_shim_survives_its_parent_and_records_the_exit(shims: Shims) -> None:
    spec = shims.spec(["sh", "-c", "read x; echo got $x; exit 3"], stdin=True, stdin_once=True)
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, json.dumps(spec.to_json())], stdout=subprocess.PIPE
    )
    assert parent.stdout is not None
    try:
        values = json.loads(parent.stdout.readline())
        ready = ShimReady(ProcessRef(*values[:2]), ProcessRef(*values[2:]), 0)
        shims.started.append(ready)
        os.kill(parent.pid, signal.SIGKILL)
        assert parent.wait(WAIT) == -signal.SIGKILL
    finally:
        if parent.poll() is None:
            os.kill(parent.pid, signal.SIGKILL)
            parent.wait()
        parent.stdout.close()
    assert is_alive(ready.shim) and is_alive(ready.process)
    async with await attach(spec.attach_socket) as conn:
        await conn.send(b"late\n")
        assert await _collect(conn) == (b"got late\n", b"")
    assert conn.exit_code == 3
    assert (await _finished(ready, spec)).exit_code == 3
    assert _log(spec) == [("stdout", "F", "got late")]
