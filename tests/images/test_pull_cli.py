"""`podgate images pull` from a real registry: plain log lines, the progress bar, errors."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from registry_support import Registry, busybox_image, noise, push_image, running_registry

from podgate.images.store import ImageStore

# One pull from loopback on a loaded machine, seconds.
PULL_TIMEOUT_SECONDS = 120.0


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with running_registry(tmp_path_factory.mktemp("clireg") / "reg") as reg:
        yield reg


def podgate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "podgate", "images", *args],
        capture_output=True,
        text=True,
        timeout=PULL_TIMEOUT_SECONDS,
        check=False,
    )


def test_pull_with_plain_progress_lines(registry: Registry, tmp_path: Path) -> None:
    image = busybox_image(label="cli-plain", extra={"blob": noise("cli", 200_000)})
    push_image(registry, "cli/plain", "v1", image)
    ref = f"{registry.host}/cli/plain:v1"
    done = podgate("pull", "--state-dir", str(tmp_path), "--progress", "plain", ref)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == image.config_digest
    for layer in image.layers:
        assert f"layer {layer.digest} downloaded" in done.stderr
    assert f"pull {ref}: resolved to {image.digest}" in done.stderr
    store = ImageStore(tmp_path)
    rec = store.get(ref)
    assert rec is not None and rec.id == image.config_digest


def test_pull_with_a_progress_bar_on_a_terminal(registry: Registry, tmp_path: Path) -> None:
    image = busybox_image(label="cli-bar")
    push_image(registry, "cli/bar", "v1", image)
    ref = f"{registry.host}/cli/bar:v1"
    parent, child = pty.openpty()
    env = {**os.environ, "COLUMNS": "120", "TERM": "xterm"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "podgate", "images", "pull", "--state-dir", str(tmp_path), ref],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=child,
        env=env,
    )
    os.close(child)
    screen = b""
    deadline = time.monotonic() + PULL_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        try:
            chunk = os.read(parent, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        screen += chunk
    os.close(parent)
    stdout, _ = proc.communicate(timeout=PULL_TIMEOUT_SECONDS)
    assert proc.returncode == 0, screen.decode(errors="replace")
    assert stdout.decode().strip() == image.config_digest
    text = screen.decode(errors="replace")
    for layer in image.layers:
        assert f"{layer.digest[7:19]} done" in text
    assert "━" in text  # the bar itself


def test_pull_errors_name_the_registry(registry: Registry, tmp_path: Path) -> None:
    ref = f"{registry.host}/cli/missing:v1"
    done = podgate("pull", "--state-dir", str(tmp_path), "--progress", "plain", ref)
    assert done.returncode == 1
    assert f'failed to resolve reference "{ref}": {ref}: not found' in done.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text('[registries."x"]\nmirrors = 3\n')
    done = podgate("pull", "--state-dir", str(tmp_path), "--config", str(bad), ref)
    assert done.returncode == 2
    assert f'{bad}: registries."x".mirrors: must be a list' in done.stderr


def test_runtime_refuses_a_bad_config_naming_file_and_key(tmp_path: Path) -> None:
    bad = tmp_path / "runtime.toml"
    bad.write_text('[registries."docker.io"]\nmirrors = ["http://mirror.internal:5000"]\n')
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "podgate",
            "runtime",
            "--state-dir",
            str(tmp_path / "s"),
            "--config",
            str(bad),
        ],
        capture_output=True,
        text=True,
        timeout=PULL_TIMEOUT_SECONDS,
        check=False,
    )
    assert done.returncode == 2
    assert f'{bad}: registries."docker.io".mirrors[0].url:' in done.stderr
    assert "set insecure = true" in done.stderr
    assert not (tmp_path / "s").exists()
