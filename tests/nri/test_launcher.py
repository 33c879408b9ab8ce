"""Pre-installed plugins: discovery, drop-in configuration, and real launched processes (fd 3,
an environment of exactly three variables, output to the log, SIGKILL and reaping)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from nripeer import WAIT_SECONDS

from podgate.nri import api_pb2 as api
from podgate.nri.adaptation import Adaptation, NriConfig, NriError
from podgate.nri.launcher import PluginSpec, discover, plugin_config

TESTS_DIR = Path(__file__).resolve().parent
EXPECTED_ENV = {"NRI_PLUGIN_IDX": "10", "NRI_PLUGIN_NAME": "dumper", "NRI_PLUGIN_SOCKET": "3"}

# The plugin: records its exec-time environment (/proc/self/environ: what execve got, before
# Python's own locale coercion touches os.environ), fd 3 and its pid, prints a line on stdout
# and stderr, then (unless told to stay silent) registers through nripeer.
DUMPER = """#!{python}
import json, os, stat, sys
environ = dict(
    item.split("=", 1)
    for item in open("/proc/self/environ", "rb").read().decode().split("\\0")
    if item
)
try:
    info = os.fstat(3)
    fd3 = {{"socket": stat.S_ISSOCK(info.st_mode), "inheritable": os.get_inheritable(3)}}
except OSError as exc:
    fd3 = {{"error": str(exc)}}
fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
with open({dump!r} + ".tmp", "w") as f:
    json.dump({{"environ": environ, "fd3": fd3, "pid": os.getpid(), "fds": fds}}, f)
os.rename({dump!r} + ".tmp", {dump!r})
print("hello on stdout", flush=True)
print("hello on stderr", file=sys.stderr, flush=True)
if {silent!r}:
    import signal
    while True:
        signal.pause()
sys.path.insert(0, {tests!r})
import asyncio, nripeer
asyncio.run(nripeer.serve_launched({dump!r} + ".config"))
"""


def write_dumper(path: Path, dump: Path, *, silent: bool = False) -> Path:
    path.write_text(
        DUMPER.format(python=sys.executable, dump=str(dump), silent=silent, tests=str(TESTS_DIR))
    )
    path.chmod(0o755)
    return path


def gone(pid: int) -> bool:
    """True once `pid` is neither running nor a zombie of ours (it was reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = tempfile.mkdtemp(prefix="nri-")
    try:
        yield Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def dirs(short_dir: Path) -> dict[str, Path]:
    layout = {name: short_dir / name for name in ("plugins", "conf.d", "out")}
    for path in layout.values():
        path.mkdir()
    return layout


@pytest.fixture
async def make_runtime(short_dir: Path, dirs: dict[str, Path]) -> AsyncIterator[Callable[..., Any]]:
    started: list[Adaptation] = []

    async def make(**changes: Any) -> Adaptation:
        settings: dict[str, Any] = {
            "socket_path": str(short_dir / "run" / "nri.sock"),
            "plugin_path": str(dirs["plugins"]),
            "plugin_config_path": str(dirs["conf.d"]),
        }
        settings.update(changes)
        adaptation = Adaptation(
            NriConfig(**settings),
            runtime_name="podgate",
            runtime_version="1.2.3",
            sync=lambda: ([api.PodSandbox(id="pod1")], []),
        )
        started.append(adaptation)
        await adaptation.start()
        return adaptation

    try:
        yield make
    finally:
        for adaptation in started:
            await adaptation.stop()


async def wait_file(path: Path) -> str:
    async with asyncio.timeout(WAIT_SECONDS):
        while not path.exists():  # noqa: ASYNC110 - the plugin is another process
            await asyncio.sleep(0.01)
    return path.read_text()


# ----------------------------------------------------------------------------- discovery


def test_discovery_takes_executables_named_nn_name(dirs: dict[str, Path]) -> None:
    plugins, conf = dirs["plugins"], dirs["conf.d"]
    for name in ("20-other", "10-logger", "10-a-b"):
        (plugins / name).write_text("#!/bin/sh\n")
        (plugins / name).chmod(0o755)
    (plugins / "README").write_text("not executable, ignored")
    (plugins / "99-disabled").write_text("not executable either")
    (plugins / "subdir").mkdir(mode=0o755)
    (conf / "10-logger.conf").write_text("specific")
    (conf / "logger.conf").write_text("generic, shadowed")
    (conf / "other.conf").write_text("by name")
    specs = discover(str(plugins), str(conf))
    assert specs == [
        PluginSpec("10", "a-b", (str(plugins / "10-a-b"),), ""),
        PluginSpec("10", "logger", (str(plugins / "10-logger"),), "specific"),
        PluginSpec("20", "other", (str(plugins / "20-other"),), "by name"),
    ]


@pytest.mark.parametrize("bad", ["logger", "1-logger", "100-logger", "ab-logger", "10-", "10"])
def test_one_badly_named_executable_fails_discovery(dirs: dict[str, Path], bad: str) -> None:
    (dirs["plugins"] / "10-good").write_text("#!/bin/sh\n")
    (dirs["plugins"] / "10-good").chmod(0o755)
    (dirs["plugins"] / bad).write_text("#!/bin/sh\n")
    (dirs["plugins"] / bad).chmod(0o755)
    with pytest.raises(NriError) as info:
        discover(str(dirs["plugins"]), str(dirs["conf.d"]))
    assert str(info.value).startswith(f"invalid plugin name {bad!r} in ")


def test_missing_plugin_dir_has_no_plugins(short_dir: Path) -> None:
    assert discover(str(short_dir / "nowhere"), str(short_dir / "conf.d")) == []


def test_plugin_config_fallbacks(dirs: dict[str, Path]) -> None:
    conf = str(dirs["conf.d"])
    assert plugin_config(conf, "10", "x") == ""
    (dirs["conf.d"] / "x.conf").write_text("by name")
    assert plugin_config(conf, "10", "x") == "by name"
    (dirs["conf.d"] / "10-x.conf").write_text("by full name")
    assert plugin_config(conf, "10", "x") == "by full name"


async def test_invalid_plugin_name_fails_start(
    make_runtime: Any, dirs: dict[str, Path], short_dir: Path
) -> None:
    (dirs["plugins"] / "logger").write_text("#!/bin/sh\n")
    (dirs["plugins"] / "logger").chmod(0o755)
    with pytest.raises(NriError, match="invalid plugin name 'logger'"):
        await make_runtime()
    assert not (short_dir / "run" / "nri.sock").exists()


# ----------------------------------------------------------------------------- launching


async def test_launched_plugin_gets_fd3_and_exactly_three_variables(
    make_runtime: Any, dirs: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    dump = dirs["out"] / "dump.json"
    write_dumper(dirs["plugins"] / "10-dumper", dump)
    (dirs["conf.d"] / "10-dumper.conf").write_text("verbose: true\n")
    with caplog.at_level(logging.INFO, logger="podgate.nri.plugins"):
        adaptation = await make_runtime()
        report = json.loads(await wait_file(dump))
        assert report["environ"] == EXPECTED_ENV
        assert report["fd3"] == {"socket": True, "inheritable": True}
        assert report["fds"] == [0, 1, 2, 3, 4]  # stdio, fd 3, and listdir's own fd
        # Registered under its file name, configured with its drop-in config.
        (plugin,) = adaptation.plugins
        assert (plugin.full_name, plugin.external, plugin.pid) == (
            "10-dumper",
            False,
            report["pid"],
        )
        assert await wait_file(Path(str(dump) + ".config")) == "verbose: true\n"
        async with asyncio.timeout(WAIT_SECONDS):
            while "hello on stderr" not in caplog.text:  # noqa: ASYNC110 - another process
                await asyncio.sleep(0.01)
    messages = [r.getMessage() for r in caplog.records if r.name == "podgate.nri.plugins"]
    assert "10-dumper: hello on stdout" in messages
    assert "10-dumper: hello on stderr" in messages
    await adaptation.stop()
    assert gone(report["pid"])  # SIGKILLed and reaped, not left a zombie


async def test_plugin_output_can_go_to_a_log_dir(make_runtime: Any, dirs: dict[str, Path]) -> None:
    dump = dirs["out"] / "dump.json"
    write_dumper(dirs["plugins"] / "10-dumper", dump)
    log_dir = dirs["out"] / "logs"
    adaptation = await make_runtime(plugin_log_dir=str(log_dir))
    await wait_file(dump)
    log_file = log_dir / "10-dumper.log"
    async with asyncio.timeout(WAIT_SECONDS):
        while "hello on stderr" not in (  # noqa: ASYNC110 - another process writes it
            log_file.read_text() if log_file.exists() else ""
        ):
            await asyncio.sleep(0.01)
    assert sorted(log_file.read_text().splitlines()) == ["hello on stderr", "hello on stdout"]
    await adaptation.stop()


async def test_registration_timeout_kills_a_silent_plugin(
    make_runtime: Any, dirs: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    dump = dirs["out"] / "dump.json"
    write_dumper(dirs["plugins"] / "10-dumper", dump, silent=True)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with caplog.at_level(logging.INFO, logger="podgate.nri"):
        adaptation = await make_runtime(registration_timeout=1.0)
    assert 1.0 <= loop.time() - started < 1.0 + WAIT_SECONDS
    report = json.loads(dump.read_text())  # it did run
    assert gone(report["pid"])  # killed and reaped when its registration timed out
    assert f"nri: plugin 10-dumper (pid {report['pid']}) exited with 137" in caplog.text
    assert adaptation.plugins == []
    assert "nri: failed to start plugin 10-dumper: plugin registration timed out" in caplog.text


async def test_builtin_plugins_launch_like_files(make_runtime: Any, dirs: dict[str, Path]) -> None:
    dump = dirs["out"] / "dump.json"
    script = write_dumper(dirs["out"] / "dumper.py", dump)
    (dirs["conf.d"] / "dumper.conf").write_text("from name.conf")
    adaptation = await make_runtime(builtin=[("10", "dumper", [sys.executable, str(script)])])
    report = json.loads(await wait_file(dump))
    assert report["environ"] == EXPECTED_ENV
    assert report["fd3"] == {"socket": True, "inheritable": True}
    assert await wait_file(Path(str(dump) + ".config")) == "from name.conf"
    assert [p.full_name for p in adaptation.plugins] == ["10-dumper"]


async def test_builtin_with_a_relative_command_is_not_launched(
    make_runtime: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="podgate.nri.adaptation"):
        adaptation = await make_runtime(builtin=[("10", "rel", ["python3", "-c", "pass"])])
    assert adaptation.plugins == []
    assert "'python3' is not an absolute path" in caplog.text


async def test_a_launched_plugin_that_dies_is_dropped_and_reaped(
    make_runtime: Any, dirs: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    dump = dirs["out"] / "dump.json"
    write_dumper(dirs["plugins"] / "10-dumper", dump)
    adaptation = await make_runtime()
    pid = json.loads(await wait_file(dump))["pid"]
    with caplog.at_level(logging.WARNING, logger="podgate.nri.adaptation"):
        os.kill(pid, signal.SIGKILL)
        async with asyncio.timeout(WAIT_SECONDS):
            while adaptation.plugins or not gone(pid):  # noqa: ASYNC110 - another process
                await asyncio.sleep(0.01)
    assert "nri: dropping plugin 10-dumper: connection closed" in caplog.text


async def test_a_launched_plugin_that_times_out_is_killed(
    make_runtime: Any, dirs: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    dump = dirs["out"] / "dump.json"
    write_dumper(dirs["plugins"] / "10-dumper", dump)
    (dirs["conf.d"] / "dumper.conf").write_text("hang RunPodSandbox")
    adaptation = await make_runtime(request_timeout=0.3)
    pid = json.loads(await wait_file(dump))["pid"]
    await wait_file(Path(str(dump) + ".config"))
    with caplog.at_level(logging.WARNING, logger="podgate.nri.adaptation"):
        await adaptation.run_pod_sandbox(api.PodSandbox(id="pod1"))
    assert adaptation.plugins == []
    assert "nri: dropping plugin 10-dumper: RunPodSandbox: no answer within 0.3 s" in caplog.text
    async with asyncio.timeout(WAIT_SECONDS):
        while not gone(pid):  # noqa: ASYNC110 - SIGKILLed and reaped in the background
            await asyncio.sleep(0.01)
