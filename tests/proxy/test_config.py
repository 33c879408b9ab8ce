"""The proxy's configuration file, its flags and pod selection."""

from __future__ import annotations

from pathlib import Path

import pytest

from podgate.proxy.config import (
    AnnotationMatch,
    ConfigError,
    ProxyConfig,
    Selector,
    load_config,
    upstream_socket,
    with_flags,
)

EXAMPLE = Path(__file__).parents[2] / "examples" / "podgate-proxy.toml"


def test_the_example_file_loads() -> None:
    config = load_config(EXAMPLE)
    assert config.listen == "/run/podgate/cri-proxy.sock"
    assert config.upstream == "unix:///run/containerd/containerd.sock"
    assert config.select.runtime_handlers == frozenset({"kata", "runsc"})
    assert config.select.selects("kata", {})
    assert not config.select.selects("runc", {})


def test_selection_by_handler_annotation_or_all() -> None:
    by_key = Selector(annotations=(AnnotationMatch.parse("podgate.io/forward"),))
    assert by_key.selects("runc", {"podgate.io/forward": ""})
    assert not by_key.selects("runc", {"other": "x"})
    by_value = Selector(annotations=(AnnotationMatch.parse("sandbox=vm"),))
    assert by_value.selects("", {"sandbox": "vm"})
    assert not by_value.selects("", {"sandbox": "netstack"})
    assert Selector(all=True).selects("", {})
    assert Selector().empty and not Selector().selects("kata", {"a": "b"})


def test_flags_add_to_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('listen = "/a.sock"\n[select]\nruntime_handlers = ["kata"]\n')
    config = with_flags(
        load_config(path), runtime_handlers=["runsc"], annotations=["k=v"], stream_port=7
    )
    assert config.listen == "/a.sock"
    assert config.select.runtime_handlers == frozenset({"kata", "runsc"})
    assert config.select.annotations == (AnnotationMatch("k", "v"),)
    assert config.stream_port == 7
    assert with_flags(ProxyConfig(), listen="/b.sock").listen == "/b.sock"


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("lisen = 1\n", "unknown keys lisen"),
        ("[select]\nall = 1\n", "select.all must be a bool"),
        ('[select]\nruntime_handlers = "kata"\n', "must be a list of strings"),
        ("[streaming]\nport = 70000\n", "out of range"),
        ("listen = [\n", "c.toml"),
        ('[select]\nannotations = ["=v"]\n', "has no key"),
    ],
)
def test_malformed_files_are_refused_with_the_reason(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=error):
        load_config(path)


def test_upstream_endpoints() -> None:
    assert upstream_socket("unix:///run/containerd/containerd.sock") == (
        "/run/containerd/containerd.sock"
    )
    assert upstream_socket("/run/crio/crio.sock") == "/run/crio/crio.sock"
    with pytest.raises(ConfigError, match="only unix://"):
        upstream_socket("tcp://127.0.0.1:1234")
    with pytest.raises(ConfigError, match="absolute"):
        upstream_socket("unix://relative.sock")


def test_the_agent_table(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[agent]\nsocket = "/run/a/{sandbox_id}.sock"\ndialback = "/run/a/db"\n')
    config = load_config(path)
    assert (config.agent_socket, config.agent_dialback) == ("/run/a/{sandbox_id}.sock", "/run/a/db")
    assert with_flags(config, agent_socket="/x/{sandbox_id}").agent_socket == "/x/{sandbox_id}"
    assert load_config(EXAMPLE).agent_socket == ""
