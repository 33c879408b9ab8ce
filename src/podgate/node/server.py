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
from podgate.node.pki import Pki, ensure_pki, write_kubeconfig

log = logging.getLogger(__name__)

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
    kubeconfig: Path  # admin, client certificate
    kubeconfig_token: Path  # admin, bearer token


def ensure_credentials(state_dir: str, server_url: str, hosts: list[str]) -> Credentials:
    """CA, server and admin certificates, an admin token, a default policy and two admin
    kubeconfigs (certificate and token), made on first start and kept afterwards."""
    root = Path(state_dir)
    pki = ensure_pki(root / "pki", hosts=hosts, admin_user=ADMIN_USER, admin_groups=[ADMIN_GROUP])
    token_file = root / "tokens.csv"
    if not token_file.exists():
        token = secrets.token_urlsafe(32)
        text = (
            f'# token,user,uid,"group1,group2"\n{token},{ADMIN_USER},{ADMIN_USER},"{ADMIN_GROUP}"\n'
        )
        atomic_write(token_file, text.encode(), replace=False)
    admin_token = _first_token(token_file, ADMIN_USER)
    policy_file = root / "policy.toml"
    if not policy_file.exists():
        atomic_write(policy_file, DEFAULT_POLICY.encode(), replace=False)
    kubeconfig = root / "kubeconfig"
    write_kubeconfig(
        kubeconfig,
        server_url,
        pki.ca_cert,
        user=ADMIN_USER,
        client_cert=pki.admin_cert,
        client_key=pki.admin_key,
    )
    kubeconfig_token = root / "kubeconfig-token"
    write_kubeconfig(kubeconfig_token, server_url, pki.ca_cert, user=ADMIN_USER, token=admin_token)
    return Credentials(pki, token_file, policy_file, kubeconfig, kubeconfig_token)


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


@dataclass(slots=True)
class RunningGateway:
    url: str
    port: int
    gate: Gate
    credentials: Credentials | None


@asynccontextmanager
async def running_gateway(
    config: GatewayConfig, source: PodSource
) -> AsyncIterator[RunningGateway]:
    """Serve the API for `source` with authentication, policy and audit until the block ends."""
    if config.plain_http and not _is_loopback(config.host):
        raise InsecureListenError("plain HTTP is only allowed on a loopback address")
    scheme = "http" if config.plain_http else "https"
    host = f"[{config.host}]" if ":" in config.host else config.host
    credentials = None
    ssl_context = None
    if not config.plain_http:
        # The kubeconfig's URL is fixed up below once the port is known (port 0 = any).
        credentials = ensure_credentials(
            config.state_dir,
            f"{scheme}://{host}:{config.port}",
            sorted({config.host, "127.0.0.1", "::1", "localhost"}),
        )
        config.token_file = config.token_file or str(credentials.token_file)
        config.policy_file = config.policy_file or str(credentials.policy_file)
        ssl_context = credentials.pki.server_ssl_context()
    gate = load_guard(config)
    # Plain HTTP is for loopback experiments: kubectl sends no credentials over it.
    api = KubeApi(
        source, guard=None if config.plain_http else gate, idle_timeout=config.idle_timeout
    )
    server = await api.serve(config.host, config.port, ssl_context=ssl_context)
    port = server.sockets[0].getsockname()[1]
    url = f"{scheme}://{host}:{port}"
    if credentials is not None and port != config.port:
        credentials = ensure_credentials(
            config.state_dir, url, sorted({config.host, "127.0.0.1", "::1", "localhost"})
        )
    if config.metrics_port:
        gate.metrics.serve(config.metrics_port)
    log.info("node gateway on %s", url)
    try:
        yield RunningGateway(url, port, gate, credentials)
    finally:
        server.close()
        await server.wait_closed()
        gate.audit.close()
