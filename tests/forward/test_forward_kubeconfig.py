"""Kubeconfig loading: files and merging, contexts and namespaces, credentials, TLS."""

from __future__ import annotations

import asyncio
import base64
import ssl
from pathlib import Path

import pytest
import yaml

from podgate.aio.streams import SocketStream, start_server
from podgate.kubeconfig import KubeconfigError, kubeconfig_paths, load
from podgate.node.pki import ensure_pki, write_kubeconfig


def write(path: Path, clusters: dict, users: dict, contexts: dict, current: str = "") -> str:  # type: ignore[type-arg]
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": n, "cluster": c} for n, c in clusters.items()],
        "users": [{"name": n, "user": u} for n, u in users.items()],
        "contexts": [{"name": n, "context": c} for n, c in contexts.items()],
    }
    if current:
        doc["current-context"] = current
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def simple(path: Path, server: str = "http://127.0.0.1:8001", **user: object) -> str:
    return write(
        path,
        {"c": {"server": server}},
        {"u": dict(user)},
        {"ctx": {"cluster": "c", "user": "u"}},
        "ctx",
    )


def test_which_files(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "KUBECONFIG": "/a:/b::/c"}
    assert kubeconfig_paths("/x", env) == [Path("/x")]
    assert kubeconfig_paths(None, env) == [Path("/a"), Path("/b"), Path("/c")]
    assert kubeconfig_paths(None, {"HOME": str(tmp_path)}) == [tmp_path / ".kube" / "config"]


def test_home_default(tmp_path: Path) -> None:
    (tmp_path / ".kube").mkdir()
    simple(tmp_path / ".kube" / "config", "https://kube.example:6443/prefix/", token="t")
    api = load(environ={"HOME": str(tmp_path)})
    assert (api.endpoint.host, api.endpoint.port, api.prefix) == ("kube.example", 6443, "/prefix")
    assert api.path("/api/v1/x") == "/prefix/api/v1/x"
    assert api.namespace == "default" and api.context == "ctx"


def test_http_server_sends_no_credentials(tmp_path: Path) -> None:
    api = load(simple(tmp_path / "k", "http://[::1]:8001", token="secret"), environ={})
    assert api.endpoint.ssl_context is None
    assert api.endpoint.headers == ()  # as kubectl: no bearer token over plain http
    assert (api.endpoint.host, api.endpoint.port, api.prefix) == ("::1", 8001, "")
    assert api.endpoint.authority == "[::1]:8001"


def test_default_ports(tmp_path: Path) -> None:
    assert load(simple(tmp_path / "a", "http://h"), environ={}).endpoint.port == 80
    assert load(simple(tmp_path / "b", "https://h"), environ={}).endpoint.port == 443


def test_token_file_basic_and_precedence(tmp_path: Path) -> None:
    (tmp_path / "tok").write_text("from-file\n")
    server = "https://127.0.0.1:6443"
    api = load(simple(tmp_path / "a", server, tokenFile="tok"), environ={})
    assert api.endpoint.headers == (("Authorization", "Bearer from-file"),)
    api = load(simple(tmp_path / "b", server, token="t1", tokenFile="tok"), environ={})
    assert api.endpoint.headers == (("Authorization", "Bearer t1"),)
    api = load(simple(tmp_path / "c", server, username="ann", password="p:w"), environ={})
    basic = base64.b64encode(b"ann:p:w").decode()
    assert api.endpoint.headers == (("Authorization", f"Basic {basic}"),)
    assert load(simple(tmp_path / "d", server), environ={}).endpoint.headers == ()


@pytest.mark.parametrize("plugin", ["exec", "auth-provider"])
def test_credential_plugins_are_refused(tmp_path: Path, plugin: str) -> None:
    path = simple(tmp_path / "k", "https://h:1", **{plugin: {"command": "aws"}})
    with pytest.raises(KubeconfigError, match=f"'{plugin}' credential plugin, which podgate"):
        load(path, environ={})


def test_contexts_and_namespaces(tmp_path: Path) -> None:
    path = write(
        tmp_path / "k",
        {"one": {"server": "http://one:1"}, "two": {"server": "http://two:2"}},
        {"u": {}},
        {
            "first": {"cluster": "one", "user": "u", "namespace": "team"},
            "second": {"cluster": "two", "user": "u"},
        },
        "first",
    )
    api = load(path, environ={})
    assert (api.context, api.endpoint.host, api.namespace) == ("first", "one", "team")
    api = load(path, context="second", environ={})
    assert (api.context, api.endpoint.host, api.namespace) == ("second", "two", "default")
    assert load(path, namespace="other", environ={}).namespace == "other"
    with pytest.raises(KubeconfigError, match="context 'third' not found"):
        load(path, context="third", environ={})


def test_kubeconfig_list_merges_first_wins(tmp_path: Path) -> None:
    first = write(
        tmp_path / "first",
        {"shared": {"server": "http://first:1"}},
        {},
        {"a": {"cluster": "shared"}},
        "a",
    )
    second = write(
        tmp_path / "second",
        {"shared": {"server": "http://second:2"}, "own": {"server": "http://own:3"}},
        {},
        {"a": {"cluster": "own"}, "b": {"cluster": "own", "namespace": "bns"}},
        "b",
    )
    env = {"KUBECONFIG": f"{tmp_path / 'missing'}:{first}:{second}"}
    api = load(environ=env)
    assert (api.context, api.endpoint.host) == ("a", "first")  # current-context: first file's
    api = load(context="b", environ=env)
    assert (api.endpoint.host, api.namespace) == ("own", "bns")  # defined only in the second
    env = {"KUBECONFIG": f"{second}:{first}"}
    assert load(environ=env).endpoint.host == "own"  # "b" is current, cluster "own"
    assert load(context="a", environ=env).endpoint.host == "own"  # second's "a" wins now


def test_missing_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(KubeconfigError, match=r"cannot read kubeconfig .*nope"):
        load(str(tmp_path / "nope"), environ={})
    with pytest.raises(KubeconfigError, match="no kubeconfig found"):
        load(environ={"KUBECONFIG": str(tmp_path / "nope")})
    (tmp_path / "bad").write_text("clusters: [\n")
    with pytest.raises(KubeconfigError, match="not valid YAML"):
        load(str(tmp_path / "bad"), environ={})
    (tmp_path / "empty").write_text("")
    with pytest.raises(KubeconfigError, match="no current-context"):
        load(str(tmp_path / "empty"), environ={})
    path = write(tmp_path / "k", {}, {}, {"x": {"cluster": "gone"}}, "x")
    with pytest.raises(KubeconfigError, match="cluster 'gone' not found"):
        load(path, environ={})
    path = simple(tmp_path / "ftp", "ftp://h")
    with pytest.raises(KubeconfigError, match="only https:// and http://"):
        load(path, environ={})
    path = write(
        tmp_path / "proxied",
        {"c": {"server": "https://h:1", "proxy-url": "socks5://p:1080"}},
        {},
        {"x": {"cluster": "c"}},
        "x",
    )
    with pytest.raises(KubeconfigError, match="uses proxy-url, which podgate does not support"):
        load(path, environ={})


def test_bad_base64(tmp_path: Path) -> None:
    path = write(
        tmp_path / "k",
        {"c": {"server": "https://h:1", "certificate-authority-data": "not base64!"}},
        {},
        {"x": {"cluster": "c"}},
        "x",
    )
    with pytest.raises(
        KubeconfigError,
        match=r"certificate authority \(certificate-authority-data\) is not valid base64",
    ):
        load(path, environ={})


def test_insecure_and_server_name(tmp_path: Path) -> None:
    path = write(
        tmp_path / "k",
        {
            "c": {
                "server": "https://127.0.0.1:1",
                "insecure-skip-tls-verify": True,
                "tls-server-name": "api.internal",
            }
        },
        {},
        {"x": {"cluster": "c"}},
        "x",
    )
    endpoint = load(path, environ={}).endpoint
    assert endpoint.ssl_context is not None
    assert endpoint.ssl_context.verify_mode is ssl.CERT_NONE
    assert endpoint.server_hostname == "api.internal"


async def _handshake(api_ssl: ssl.SSLContext, server_ctx: ssl.SSLContext) -> dict:  # type: ignore[type-arg]
    """Connect to a TLS server on loopback; returns the client certificate the server saw."""
    seen: dict = {}  # type: ignore[type-arg]

    async def handler(stream: SocketStream) -> None:
        ssl_object = stream.transport.get_extra_info("ssl_object")
        seen.update(ssl_object.getpeercert() or {})
        await stream.send(b"ok")

    server = await start_server(handler, "127.0.0.1", 0, ssl_context=server_ctx)
    try:
        port = server.sockets[0].getsockname()[1]
        stream = await SocketStream.connect(
            "127.0.0.1", port, ssl_context=api_ssl, server_hostname="127.0.0.1"
        )
        async with asyncio.timeout(10):
            assert await stream.receive() == b"ok"
        await stream.aclose()
    finally:
        server.close()
    return seen


async def test_ca_and_client_certificate_data_make_a_real_handshake(tmp_path: Path) -> None:
    pki = ensure_pki(tmp_path / "pki")
    path = tmp_path / "kubeconfig"
    # podgate's own kubeconfigs: CA, client certificate and key embedded as *-data.
    write_kubeconfig(
        path,
        "https://127.0.0.1:6443",
        pki.ca_cert,
        user="admin",
        client_cert=pki.admin_cert,
        client_key=pki.admin_key,
        namespace="work",
    )
    api = load(str(path), environ={})
    assert api.namespace == "work" and api.endpoint.headers == ()
    context = api.endpoint.ssl_context
    assert context is not None
    server_ctx = pki.server_ssl_context()
    server_ctx.verify_mode = ssl.CERT_REQUIRED
    seen = await _handshake(context, server_ctx)
    subject = dict(item for rdn in seen["subject"] for item in rdn)
    assert subject["commonName"] == "admin"


async def test_certificate_files_relative_to_the_kubeconfig(tmp_path: Path) -> None:
    pki = ensure_pki(tmp_path / "pki")
    path = write(
        tmp_path / "k",
        {"c": {"server": "https://127.0.0.1:1", "certificate-authority": "pki/ca.crt"}},
        {
            "u": {
                "client-certificate": "pki/admin.crt",
                "client-key": "pki/admin.key",
                "token": "tok",
            }
        },
        {"x": {"cluster": "c", "user": "u"}},
        "x",
    )
    api = load(path, environ={})
    assert api.endpoint.headers == (("Authorization", "Bearer tok"),)
    assert api.endpoint.ssl_context is not None
    server_ctx = pki.server_ssl_context()
    server_ctx.verify_mode = ssl.CERT_REQUIRED
    seen = await _handshake(api.endpoint.ssl_context, server_ctx)
    assert ("commonName", "admin") in [item for rdn in seen["subject"] for item in rdn]


async def test_an_untrusted_server_fails_the_handshake(tmp_path: Path) -> None:
    ours = ensure_pki(tmp_path / "ours")
    theirs = ensure_pki(tmp_path / "theirs")
    path = tmp_path / "k"
    write_kubeconfig(path, "https://127.0.0.1:1", ours.ca_cert, user="u", token="t")
    api = load(str(path), environ={})
    assert api.endpoint.ssl_context is not None
    with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"):
        await _handshake(api.endpoint.ssl_context, theirs.server_ssl_context(client_ca=False))


def test_unloadable_client_key(tmp_path: Path) -> None:
    pki = ensure_pki(tmp_path / "pki")
    cert = base64.b64encode(pki.admin_cert.read_bytes()).decode()
    wrong_key = base64.b64encode(pki.server_key.read_bytes()).decode()  # not the cert's key
    path = write(
        tmp_path / "k",
        {"c": {"server": "https://h:1", "insecure-skip-tls-verify": True}},
        {"u": {"client-certificate-data": cert, "client-key-data": wrong_key}},
        {"x": {"cluster": "c", "user": "u"}},
        "x",
    )
    with pytest.raises(KubeconfigError, match="cannot load the client certificate and key"):
        load(path, environ={})
    path = write(
        tmp_path / "k2",
        {"c": {"server": "https://h:1"}},
        {"u": {"client-certificate-data": cert}},
        {"x": {"cluster": "c", "user": "u"}},
        "x",
    )
    with pytest.raises(KubeconfigError, match="go together"):
        load(path, environ={})
