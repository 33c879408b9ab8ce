"""The layer map of the design is enforced: import-linter's contracts (pyproject.toml) hold for
the tree, and the checker fails when a forbidden import is added."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _lint(src: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run(
        [str(LINT_IMPORTS), str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_contracts_hold() -> None:
    result = _lint(ROOT / "src")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "forbidden", "contract"),
    [
        ("proto/errors.py", "podgate.aio.errors", "proto is a leaf"),
        ("linux/ns.py", "podgate.runtime.api", "layers"),
        ("backends/netns.py", "podgate.backends.exec", "backends are independent"),
        ("node/auth.py", "podgate.runtime.api", "the gateway sees no runtime internals"),
        ("aio/splice.py", "podgate.model", "aio drives protocols"),
    ],
)
def test_checker_bites(tmp_path: Path, module: str, forbidden: str, contract: str) -> None:
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "podgate", src / "podgate")
    target = src / "podgate" / module
    target.write_text(target.read_text() + f"\nimport {forbidden}  # noqa\n")
    result = _lint(src)
    assert result.returncode != 0
    broken = result.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken, result.stdout
    assert forbidden in broken
