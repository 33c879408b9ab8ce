"""The command line starts lean: help and the in-pod forwarder import only what they use."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from podgate.cli.main import COMMANDS, main

PROBE = """
import json, sys
from podgate.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted(sys.modules)), file=sys.stderr)
"""
HEAVY = (
    "grpc",
    "google.protobuf",
    "podgate.runtime",
    "podgate.node",
    "podgate.nri",
    "cryptography",
    "rich",
    "h11",
)


def imported_by(*argv: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=60, check=True
    )
    modules: list[str] = json.loads(done.stderr.strip().splitlines()[-1])
    return modules


@pytest.mark.parametrize("argv", [("--help",), ("agent", "forward", "--help")])
def test_lean_commands_import_no_heavy_module(argv: tuple[str, ...]) -> None:
    modules = imported_by(*argv)
    heavy = [m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY)]
    assert heavy == []


def test_help_lists_every_command_without_importing_it() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "podgate", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for name, (_, _, summary) in COMMANDS.items():
        assert f"{name}" in out
        assert summary in out.replace("\n", " ") or summary.split()[0] in out


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_resolves(name: str) -> None:
    import click

    ctx = click.Context(main)
    command = main.get_command(ctx, name)
    assert isinstance(command, click.Command)
    assert command.name is not None


def test_unknown_command_is_a_usage_error() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "podgate", "no-such-command"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "No such command 'no-such-command'" in done.stderr
