"""kubectl exec and attach against the demo API, for each kubectl profile.

Expected outputs come from what the remote commands print (sh, sha256sum, stty, cat) and from
kubectl's documented reporting (kubectl-api-surface.md §6.1, §8); the transport each profile
must use is §1.2/§7, checked on the server side through the upgrade log.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import parse_qsl

import pytest
from e2e_support import (
    PROFILES,
    Kubectl,
    Profile,
    UpgradeLog,
    Wire,
    profile_named,
    profile_params,
    sha256_hex,
)

from servers import RunningServers

pytestmark = pytest.mark.e2e

# Bytes piped through `exec -i ... sha256sum`: several MiB, so stdin crosses many frames.
STDIN_BYTES = 4 * 1024 * 1024 + 17
# How long a pty session may take to show each expected piece of output.
PTY_STEP_SECONDS = 15.0
# Rows and columns of the local terminal kubectl runs in, and the size it is changed to.
ROWS, COLS = 40, 120
NEW_ROWS, NEW_COLS = 50, 150
# How often Enter is pressed while waiting for the changed size to arrive.
KEY_REPEAT_SECONDS = 0.2


@pytest.fixture(params=profile_params())
def profile(request: pytest.FixtureRequest) -> Profile:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def kubectl(profile: Profile, demo: RunningServers, tmp_path: Path) -> Kubectl:
    return Kubectl.for_profile(profile, demo.kubeconfig, tmp_path)


@pytest.mark.parametrize("code", [0, 3, 137])
def test_exec_output_and_exit_code(
    kubectl: Kubectl, profile: Profile, upgrades: UpgradeLog, code: int
) -> None:
    # 137 is 128 + SIGKILL: the shell kills itself, as an OOM-killed process would end.
    ending = "kill -9 $$" if code == 137 else f"exit {code}"
    upgrades.clear()
    result = kubectl.run(["exec", "demo", "--", "sh", "-c", f"echo out; echo err >&2; {ending}"])
    assert result.stdout == b"out\n", result.stderr
    assert result.returncode == code, result.stderr
    if code == 0:
        assert result.stderr == b"err\n"
    else:
        assert b"err\n" in result.stderr
        assert f"command terminated with exit code {code}".encode() in result.stderr
    assert upgrades.wires("exec") == [profile.exec_wire]
    upgrades.assert_served_cleanly()


def test_exec_stdin_and_its_end(kubectl: Kubectl, profile: Profile, upgrades: UpgradeLog) -> None:
    # sha256sum prints only after reading to EOF: the digest proves every byte and the EOF.
    data = os.urandom(STDIN_BYTES)
    upgrades.clear()
    result = kubectl.run(["exec", "-i", "demo", "--", "sha256sum"], stdin=data)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{sha256_hex(data)}  -\n".encode()
    assert upgrades.wires("exec") == [profile.exec_wire]
    upgrades.assert_served_cleanly()


def test_exec_tty_sizes(kubectl: Kubectl, profile: Profile, upgrades: UpgradeLog) -> None:
    """The local terminal's size reaches the remote pty, and so does a later change.

    The remote shell waits (5 s at most) until its pty has a size before printing it: the
    first size travels separately from starting the command, see test_tty_initial_size.py.
    """
    script = (
        "i=0; while [ \"$(stty size)\" = '0 0' ] && [ $i -lt 100 ]; do sleep 0.05; i=$((i+1));"
        " done; stty size; echo tty:$(tty); while read line; do stty size; done"
    )
    upgrades.clear()
    with kubectl.pty_session(
        ["exec", "-i", "-t", "demo", "--", "sh", "-c", script], rows=ROWS, cols=COLS
    ) as session:
        session.expect(re.compile(rb"tty:/dev/pts/\d+\r\n"), PTY_STEP_SECONDS)
        assert re.match(rb"%d %d\r\ntty:/dev/pts/\d+\r\n$" % (ROWS, COLS), session.output), bytes(
            session.output
        )
        session.resize(NEW_ROWS, NEW_COLS)
        # kubectl forwards SIGWINCH and keystrokes from different goroutines: press Enter
        # until a line is answered with the new size.
        new_size = re.compile(rb"\n%d %d\r\n" % (NEW_ROWS, NEW_COLS))
        for _ in range(int(PTY_STEP_SECONDS / KEY_REPEAT_SECONDS)):
            session.write(b"\r")
            if session.search(new_size, KEY_REPEAT_SECONDS):
                break
        session.expect(new_size, 0)
        session.write(b"\x04")  # ^D on an empty line: `read` sees EOF and the shell exits 0
        output = session.read_to_end(PTY_STEP_SECONDS)
        assert session.wait(PTY_STEP_SECONDS) == 0, output
    # Every size the shell printed is one the terminal really had.
    sizes = set(re.findall(rb"(?m)^(\d+ \d+)\r$", output))
    assert sizes == {b"%d %d" % (ROWS, COLS), b"%d %d" % (NEW_ROWS, NEW_COLS)}, output
    assert upgrades.wires("exec") == [profile.exec_wire]
    (target,) = upgrades.targets("exec")
    query = dict(parse_qsl(target.partition("?")[2]))
    assert query.get("tty") == "true" and query.get("stdin") == "true"
    upgrades.assert_served_cleanly()


def test_attach_stdin(kubectl: Kubectl, profile: Profile, upgrades: UpgradeLog) -> None:
    # The demo pod's main process is `cat`, with stdin once: it echoes what we pipe and ends.
    upgrades.clear()
    result = kubectl.run(["attach", "-i", "demo", "-c", "main"], stdin=b"hello\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"hello\n", result.stderr
    # Attach goes the same way as exec (kubectl-api-surface.md §7).
    assert upgrades.wires("attach") == [profile.exec_wire]
    (target,) = upgrades.targets("attach")
    query = dict(parse_qsl(target.partition("?")[2]))
    assert query.get("stdin") == "true" and query.get("tty") != "true"
    upgrades.assert_served_cleanly()


def test_exec_missing_pod(demo: RunningServers, tmp_path: Path, upgrades: UpgradeLog) -> None:
    kubectl = Kubectl.for_profile(profile_named("1.33"), demo.kubeconfig, tmp_path)
    upgrades.clear()
    result = kubectl.run(["exec", "nope", "--", "true"])
    assert result.returncode == 1
    assert result.stdout == b""
    assert b'Error from server (NotFound): pods "nope" not found' in result.stderr
    assert upgrades.wires("exec") == []  # kubectl stops at the pod GET


def test_profiles_cover_every_transport() -> None:
    """The matrix reaches each server path at least once (keeps the profile list honest)."""
    assert {p.exec_wire for p in PROFILES} == {Wire.SPDY, Wire.WEBSOCKET}
    assert {p.portforward_wire for p in PROFILES} == {Wire.SPDY, Wire.TUNNEL}


def test_exec_client_leaves_early(kubectl: Kubectl, upgrades: UpgradeLog) -> None:
    """kubectl is killed (as by ^C) while the command still writes: the server drops the rest
    of the output, lets the command finish, and ends the session without an error."""
    upgrades.clear()
    with kubectl.popen(
        ["exec", "demo", "--", "sh", "-c", "for i in $(seq 100); do echo line $i; sleep 0.01; done"]
    ) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"line 1\n"
    upgrades.assert_served_cleanly()
