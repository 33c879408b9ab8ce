"""Shims forked from the warm forker: they run containers like spawned ones, outlive the forker
and the daemon, and the forker ends with the daemon and is started again when it died."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from podgate.linux import shim as shim_mod
from podgate.linux.forker import Forker
from podgate.linux.holder import start_holder, stop_holder
from podgate.linux.proc import (
    SpawnError,
    is_alive,
    process_ref,
    read_json,
    signal_process,
    wait_gone,
)
from podgate.linux.shim import ShimSpec, read_exit_file, start_shim
from podgate.model import NamespaceMode, ProcessRef

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the shim unshares a PID namespace"),
]

WAIT = 15.0
FORKER_MODULE = b"podgate.linux.forker"


def _spec(run: Path, name: str, command: list[str]) -> ShimSpec:
    run.mkdir(parents=True)
    return ShimSpec(
        container_id=name,
        command=command,
        exit_file=str(run / "exit.json"),
        attach_socket=str(run / "attach.sock"),
        ready_file=str(run / "ready.json"),
        log_file=str(run / "0.log"),
        pid_mode=NamespaceMode.CONTAINER,
    )


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[1])


async def _exit_code(shim: ProcessRef, spec: ShimSpec) -> int:
    """The container's exit code once its shim has exited."""
    assert await wait_gone(shim, WAIT), "the shim did not exit"
    done = read_exit_file(spec.exit_file)
    assert done is not None
    return done.exit_code


async def test_a_forked_shim_runs_its_container_and_outlives_the_forker(tmp_path: Path) -> None:
    forker = Forker(str(tmp_path / "f.log"))
    try:
        await forker.start()  # ahead of the first helper, as the daemon does
        forker_pid = forker.pid
        assert forker_pid is not None
        spec = _spec(tmp_path / "c1", "c1", ["sh", "-c", "echo forked; sleep 1; exit 3"])
        ready = await start_shim(spec, spawn=forker.spawn)
        assert forker.pid == forker_pid
        forker_ref = process_ref(forker_pid)
        # Forked, not a new interpreter: the shim carries the forker's command line, and it
        # was re-parented away from the forker (a new session, forked twice).
        assert FORKER_MODULE in _cmdline(ready.shim.pid)
        assert _ppid(ready.shim.pid) != forker_pid
        assert os.getsid(ready.shim.pid) != os.getsid(0)
    finally:
        forker.close()
    assert await wait_gone(forker_ref, WAIT), "close() left the forker running"
    assert is_alive(ready.shim), "stopping the forker stopped a shim"
    assert await _exit_code(ready.shim, spec) == 3
    assert b" stdout F forked\n" in Path(spec.log_file).read_bytes()


async def test_a_dead_forker_is_started_again(tmp_path: Path) -> None:
    forker = Forker(str(tmp_path / "f.log"))
    try:
        first = _spec(tmp_path / "c1", "c1", ["true"])
        first_ready = await start_shim(first, spawn=forker.spawn)
        assert forker.pid is not None
        old = process_ref(forker.pid)
        signal_process(old, signal.SIGKILL)
        assert await wait_gone(old, WAIT)
        second = _spec(tmp_path / "c2", "c2", ["sh", "-c", "sleep 1; exit 5"])
        ready = await start_shim(second, spawn=forker.spawn)
        assert forker.pid not in (None, old.pid)
        assert FORKER_MODULE in _cmdline(ready.shim.pid)
        assert await _exit_code(ready.shim, second) == 5
        assert await _exit_code(first_ready.shim, first) == 0
    finally:
        forker.close()


DAEMON = textwrap.dedent(
    """
    import asyncio, json, sys
    from podgate.linux.shim import ShimSpec, start_shim
    from podgate.linux.forker import Forker

    async def main(run, spec):
        forker = Forker(run + "/f.log")
        ready = await start_shim(ShimSpec.from_json(spec), spawn=forker.spawn)
        print(json.dumps({"forker": forker.pid, "shim": ready.shim.pid}), flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))
    """
)


async def test_the_forker_ends_with_its_daemon_and_the_shim_lives_on(tmp_path: Path) -> None:
    spec = _spec(tmp_path / "c1", "c1", ["sh", "-c", "sleep 2; echo after; exit 4"])
    daemon = subprocess.Popen(
        [sys.executable, "-c", DAEMON, str(tmp_path), json.dumps(spec.to_json())],
        stdout=subprocess.PIPE,
    )
    try:
        assert daemon.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(daemon.stdout.readline), WAIT)
        pids = json.loads(line)
        forker, shim = process_ref(pids["forker"]), process_ref(pids["shim"])
    finally:
        daemon.kill()  # as a crash: nothing of the daemon's runs
        daemon.wait()
        if daemon.stdout is not None:
            daemon.stdout.close()
    try:
        assert await wait_gone(forker, WAIT), "the forker outlived its daemon"
        assert is_alive(shim)
        assert await _exit_code(shim, spec) == 4
        assert b" stdout F after\n" in Path(spec.log_file).read_bytes()
        assert read_json(spec.ready_file)["shim_pid"] == shim.pid
    finally:
        for ref in (forker, shim):
            signal_process(ref, signal.SIGKILL)


async def test_a_forked_pod_holder_owns_the_pods_pid_namespace(tmp_path: Path) -> None:
    forker = Forker(str(tmp_path / "f.log"))
    try:
        holder, ns_process = await start_holder(
            "forked-holder",
            True,
            str(tmp_path / "holder.json"),
            str(tmp_path / "holder.log"),
            empty_root=str(tmp_path / "root"),
            spawn=forker.spawn,
        )
        try:
            assert FORKER_MODULE in _cmdline(holder.pid)
            # Its child is PID 1 of a new PID namespace, with the pod's hostname.
            for kind in ("pid", "net", "uts"):
                assert (
                    os.stat(f"/proc/{ns_process.pid}/ns/{kind}").st_ino
                    != os.stat(f"/proc/self/ns/{kind}").st_ino
                )
            with open(f"/proc/{ns_process.pid}/status", encoding="ascii") as f:
                nspid = next(line for line in f if line.startswith("NSpid:")).split()
            assert nspid[-1] == "1"
            probe = subprocess.run(
                ["nsenter", "-t", str(ns_process.pid), "--uts", "hostname"],
                capture_output=True,
                check=True,
            )
            assert probe.stdout == b"forked-holder\n"
        finally:
            await stop_holder(holder)
        assert await wait_gone(holder, WAIT) and await wait_gone(ns_process, WAIT)
    finally:
        forker.close()


def test_the_shims_own_argument_parsing(capsys: pytest.CaptureFixture[str]) -> None:
    # A forked shim parses its arguments without argparse (whose objects cost each shim
    # about 1 MiB of its own): the same command line as before, the same refusals.
    assert shim_mod._parse_args(["--spec", "s.json"]) == ("s.json", False)
    assert shim_mod._parse_args(["--foreground", "--spec=s.json"]) == ("s.json", True)
    for bad in ([], ["--spec"], ["--spec", "s.json", "--bogus"], ["s.json"]):
        with pytest.raises(ValueError):
            shim_mod._parse_args(bad)
    assert shim_mod.main(["--bogus"]) == 2
    assert "usage: python -m podgate.linux.shim --spec FILE" in capsys.readouterr().err


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
        return f.read()


def _children_of(parent: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if _ppid(int(entry)) == parent:
                    found.append(int(entry))
            except OSError:
                continue
    return found


SANDBOX_SHIM = "podgate.runtime.sandbox.shim"


async def test_a_second_stage_forks_its_modules_and_keeps_asyncio_out_of_the_first(
    tmp_path: Path,
) -> None:
    # The sandbox shim's module is forked by a child of the forker that imported it (and
    # asyncio); the forker every container shim is forked from maps no asyncio.
    forker = Forker(str(tmp_path / "f.log"), modules=(SANDBOX_SHIM,))
    try:
        await forker.start()
        first = forker.pid
        assert first is not None
        assert _children_of(first) == []  # started with the first request for its modules
        log = tmp_path / "sandbox-shim.log"
        # A command line it refuses: its usage in the log shows its main ran, forked.
        await forker.spawn(SANDBOX_SHIM, ["--bogus"], str(log))
        stages = _children_of(first)
        assert len(stages) == 1
        stage = process_ref(stages[0])
        assert FORKER_MODULE in _cmdline(stage.pid)
        assert "_asyncio." in _maps(stage.pid)
        assert "_asyncio." not in _maps(first)
        for _ in range(int(WAIT / 0.05)):
            if b"usage: python -m podgate.runtime.sandbox.shim" in log.read_bytes():
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail(f"no usage from the forked sandbox shim: {log.read_text()!r}")

        # A stage that died is started again by the next request for its modules; the
        # container shims' modules never needed it.
        signal_process(stage, signal.SIGKILL)
        assert await wait_gone(stage, WAIT)
        await forker.spawn(SANDBOX_SHIM, ["--bogus"], str(log))
        assert forker.pid == first
        again = _children_of(first)
        assert len(again) == 1 and again[0] != stage.pid
        with pytest.raises(SpawnError):
            await forker.spawn("podgate.linux.vmm", [], str(log))
    finally:
        forker.close()
