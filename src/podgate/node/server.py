"""Starting the node gateway: credentials on first start, then HTTPS with the Guard."""

from __future__ import annotations

import ipaddress
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from podgate.files import atomic_write
from podgate.node.gateway import Gate, GatewayConfig, load_guard
from podgate.node.kubeapi import KubeApi, PodSource
from podgate.node.listener import PreAuth
from podgate.node.origin import RequestOrigins
from podgate.node.pki import DEFAULT_HOSTS, OperatorTls, Pki, ensure_pki, write_kubeconfig

log = logging.getLogger(__name__)

# On shutdown, connections in progress (exec, port-forward, logs -f) may go on this long after
# the gateway stops accepting; then they are cut, seconds.
SHUTDOWN_DRAIN_SECONDS = 5.0
ADMIN_USER = "admin"
ADMIN_GROUP = "system:masters"
# The policy written on first start: the admin group may do everything, nobody else anything.
DEFAULT_POLICY = f"""# podgate node policy: who may do what to which pods.
# Rules are ORed; a request is allowed when one rule matches user/group, namespace, pod, verb
# and, for port-forward, the port.

[[rule]]
groups = ["{ADMIN_GROUP}"]
namespaces = ["*"]
pods = ["*"]
verbs = ["*"]
"""


class InsecureListenError(ValueError):
    pass


@dataclass(slots=True)
class Credentials:
    pki: Pki
    token_file: Path
    policy_file: Path
    kubeconfig: Path  # admin: client certificate (token when client certs are the operator's)
    kubeconfig_token: Path  # admin: bearer token
    ca: Path | None  # what the kubeconfigs trust for the server (None: the system's roots)


def ensure_credentials(
    state_dir: str,
    server_url: str,
    hosts: list[str],
    *,
    operator: OperatorTls | None = None,
) -> Credentials:
    """CA, server and admin certificates, an admin token, a default policy and two admin
    kubeconfigs (certificate and token), made on first start and kept afterwards.

    With operator TLS material the generated CA still signs nothing the server presents; the
    kubeconfigs then trust the operator's CA (when it issued the server certificate) and the
    certificate kubeconfig falls back to the token when client certificates are the
    operator's to issue."""
    root = Path(state_dir)
    pki = ensure_pki(root / "pki", hosts=hosts, admin_user=ADMIN_USER, admin_groups=[ADMIN_GROUP])
    token_file = root / "tokens.csv"
    if not token_file.exists():
        token = secrets.token_urlsafe(32)
        text = '# token,user,uid,"group1,group2"\n'
        text += f'{token},{ADMIN_USER},{ADMIN_USER},"{ADMIN_GROUP}"\n'
        atomic_write(token_file, text.encode(), replace=False)
    admin_token = _first_token(token_file, ADMIN_USER)
    policy_file = root / "policy.toml"
    if not policy_file.exists():
        atomic_write(policy_file, DEFAULT_POLICY.encode(), replace=False)
    ca: Path | None = pki.ca_cert
    if operator is not None:
        ca = operator.issuer_bundle()
        if ca is None:
            log.warning(
                "no CA given that issued %s: the kubeconfigs trust the system's roots",
                operator.cert,
            )
    if server_url.startswith("http://"):
        ca = None
    kubeconfig = root / "kubeconfig"
    kubeconfig_token = root / "kubeconfig-token"
    write_kubeconfig(kubeconfig_token, server_url, ca, user=ADMIN_USER, token=admin_token)
    if operator is None or operator.client_ca is None:
        write_kubeconfig(
            kubeconfig,
            server_url,
            ca,
            user=ADMIN_USER,
            client_cert=pki.admin_cert,
            client_key=pki.admin_key,
        )
    else:
        write_kubeconfig(kubeconfig, server_url, ca, user=ADMIN_USER, token=admin_token)
    return Credentials(pki, token_file, policy_file, kubeconfig, kubeconfig_token, ca)


def _first_token(path: Path, user: str) -> str | None:
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            fields = line.split(",")
            if len(fields) >= 2 and fields[1] == user:
                return fields[0]
    return None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _is_wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::")


def server_names(config: GatewayConfig) -> list[str]:
    """The names the generated server certificate carries and Host may name."""
    names = [config.host, *config.sans, *DEFAULT_HOSTS]
    return sorted({n for n in names if not _is_wildcard(n)})


def _url_host(config: GatewayConfig, operator: OperatorTls | None) -> str:
    """The host the kubeconfigs name: one the server certificate verifies."""
    valid = operator.server_names() if operator is not None else server_names(config)
    candidates = [] if _is_wildcard(config.host) else [config.host]
    candidates += [*config.sans, *valid, "127.0.0.1"]
    host = next(h for h in candidates if h in valid or operator is None)
    if operator is not None and host not in valid:
        log.warning("the server certificate names none of %s", candidates)
    return f"[{host}]" if ":" in host else host


@dataclass(slots=True)
class RunningGateway:
    url: str
    port: int
    gate: Gate
    credentials: Credentials
    preauth: PreAuth


@asynccontextmanager
async def running_gateway(
    config: GatewayConfig, source: PodSource
) -> AsyncIterator[RunningGateway]:
    """Serve the API for `source` with authentication, policy and audit until the block ends.

    Every mode authenticates: plain HTTP (loopback only) checks bearer tokens as HTTPS does.
    """
    if config.plain_http and not _is_loopback(config.host):
        raise InsecureListenError("plain HTTP is only allowed on a loopback address")
    if bool(config.tls_cert) != bool(config.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    operator = (
        OperatorTls(
            Path(config.tls_cert),
            Path(config.tls_key),
            Path(config.client_ca) if config.client_ca else None,
        )
        if config.tls_cert
        else None
    )
    scheme = "http" if config.plain_http else "https"
    host = _url_host(config, operator)
    names = server_names(config)
    # The kubeconfig's URL is fixed up below once the port is known (port 0 = any).
    credentials = ensure_credentials(
        config.state_dir, f"{scheme}://{host}:{config.port}", names, operator=operator
    )
    config.token_file = config.token_file or str(credentials.token_file)
    config.policy_file = config.policy_file or str(credentials.policy_file)
    ssl_context = None
    if not config.plain_http:
        if operator is not None:
            ssl_context = operator.server_ssl_context()
        else:
            ssl_context = credentials.pki.server_ssl_context()
            if config.client_ca:
                ssl_context.load_verify_locations(cafile=config.client_ca)
    gate = load_guard(config)
    origins = RequestOrigins(
        [*names, *(operator.server_names() if operator else [])], config.allowed_origins
    )
    api = KubeApi(
        source,
        guard=gate,
        idle_timeout=config.idle_timeout,
        origins=origins,
        preauth=PreAuth(config.max_unauthenticated, config.auth_timeout),
    )
    server = await api.serve(config.host, config.port, ssl_context=ssl_context)
    port = server.sockets[0].getsockname()[1]
    url = f"{scheme}://{host}:{port}"
    if port != config.port:
        credentials = ensure_credentials(config.state_dir, url, names, operator=operator)
    if config.metrics_port:
        gate.metrics.serve(config.metrics_port)
    log.info("node gateway on %s", url)
    try:
        yield RunningGateway(url, port, gate, credentials, api.preauth)
    finally:
        server.close()
        await server.wait_closed()
        if server.active:
            log.info(
                "gateway: %d connections open, draining for up to %gs",
                server.active,
                SHUTDOWN_DRAIN_SECONDS,
            )
        await server.close_clients(SHUTDOWN_DRAIN_SECONDS)
        gate.audit.close()
