"""`podgate proxy`'s command line: what it refuses before serving anything."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from podgate.cli.main import main


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["proxy", *args])
    return result.exit_code, result.output


def test_without_a_socket_to_listen_on_it_refuses() -> None:
    code, out = run("--upstream", "unix:///run/containerd/containerd.sock")
    assert code != 0
    assert "no --listen socket" in out


def test_a_tcp_upstream_is_refused(tmp_path: Path) -> None:
    code, out = run("--listen", str(tmp_path / "p.sock"), "--upstream", "tcp://127.0.0.1:1")
    assert code != 0
    assert "only unix:// endpoints" in out


def test_a_routable_streaming_address_without_tls_is_refused(tmp_path: Path) -> None:
    code, out = run("--listen", str(tmp_path / "p.sock"), "--stream-address", "0.0.0.0")
    assert code != 0
    assert "refusing to serve streams on 0.0.0.0 without TLS" in out


def test_a_malformed_config_file_is_refused_with_its_reason(tmp_path: Path) -> None:
    config = tmp_path / "proxy.toml"
    config.write_text("[select]\nall = 'yes'\n")
    code, out = run("--config", str(config), "--listen", str(tmp_path / "p.sock"))
    assert code != 0
    assert "select.all must be a bool" in out
