"""`podgate node`: the authenticated gateway in front of a CRI runtime."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from podgate.aio.loop import run, wait_for_signal
from podgate.cli.errors import listen_failure
from podgate.cli.logs import setup_logging
from podgate.node.audit import DEFAULT_AUDIT_KEEP, DEFAULT_AUDIT_MAX_BYTES
from podgate.node.cri_client import CriClient, CriPodSource
from podgate.node.gateway import DEFAULT_MAX_FORWARDS_PER_SESSION, GatewayConfig, Limits
from podgate.node.listener import DEFAULT_AUTH_TIMEOUT_SECONDS, DEFAULT_MAX_UNAUTHENTICATED
from podgate.node.server import InsecureListenError, running_gateway
from podgate.node.upstream import CriTarget
from podgate.runtime.daemon import DEFAULT_STATE_DIR


def gateway_options(f: click.decorators.FC) -> click.decorators.FC:
    for option in reversed(
        [
            click.option(
                "--address",
                default="127.0.0.1",
                show_default=True,
                help="Address of the HTTPS API.",
            ),
            click.option("--port", default=6443, show_default=True, help="Port; 0 = any."),
            click.option(
                "--token-file",
                default="",
                help='Static bearer tokens: token,user,uid,"group1,group2" '
                "[default: STATE_DIR/tokens.csv, made on first start].",
            ),
            click.option(
                "--policy-file",
                default="",
                help="Authorization rules (TOML) [default: STATE_DIR/policy.toml: "
                "the admin group may do everything].",
            ),
            click.option(
                "--audit-log",
                default="",
                help="JSON-lines audit log [default: STATE_DIR/audit.log].",
            ),
            click.option(
                "--metrics-port",
                default=0,
                show_default=True,
                help="Prometheus metrics on 127.0.0.1:PORT; 0 = off.",
            ),
            click.option(
                "--max-bytes-per-sec",
                type=float,
                default=None,
                help="Rate limit of each stream, each way (default: none).",
            ),
            click.option("--max-streams-per-user", default=64, show_default=True),
            click.option("--max-streams-per-pod", default=128, show_default=True),
            click.option(
                "--max-forwards-per-session",
                default=DEFAULT_MAX_FORWARDS_PER_SESSION,
                show_default=True,
                type=click.IntRange(min=1),
                help="Connections one port-forward session may carry at once (the gateway "
                "opens as many runtime sessions as they need).",
            ),
            click.option(
                "--stream-idle-timeout",
                default=4 * 3600.0,
                show_default=True,
                help="Seconds without traffic before a stream is closed.",
            ),
            click.option(
                "--plain-http",
                is_flag=True,
                help="Serve plain HTTP on loopback, still requiring a bearer token (the "
                "Python client sends it over HTTP; kubectl does not, so use HTTPS for kubectl).",
            ),
            click.option(
                "--tls-cert",
                default="",
                help="Server certificate (PEM, chain allowed) instead of the generated one.",
            ),
            click.option("--tls-key", default="", help="Key of --tls-cert (PEM)."),
            click.option(
                "--client-ca",
                default="",
                help="CA bundle client certificates must chain to (with --tls-cert: the only "
                "one; without: trusted besides the generated CA).",
            ),
            click.option(
                "--san",
                multiple=True,
                help="Extra DNS name or IP address for the generated server certificate, and "
                "a name requests may carry in Host (repeatable).",
            ),
            click.option(
                "--allowed-origin",
                multiple=True,
                help="A browser Origin (scheme://host[:port]) allowed to send requests; "
                "by default any request carrying Origin is refused (repeatable).",
            ),
            click.option(
                "--max-unauthenticated",
                default=DEFAULT_MAX_UNAUTHENTICATED,
                show_default=True,
                help="Connections at once that have not authenticated yet; more are reset.",
            ),
            click.option(
                "--auth-timeout",
                default=DEFAULT_AUTH_TIMEOUT_SECONDS,
                show_default=True,
                help="Seconds a connection has for its TLS handshake and first "
                "authenticated request.",
            ),
            click.option(
                "--audit-log-max-bytes",
                default=DEFAULT_AUDIT_MAX_BYTES,
                show_default=True,
                help="Rotate the audit log past this size.",
            ),
            click.option(
                "--audit-log-keep",
                default=DEFAULT_AUDIT_KEEP,
                show_default=True,
                help="Rotated audit logs kept.",
            ),
        ]
    ):
        f = option(f)
    return f


def make_config(
    state_dir: str,
    cri_socket: str,
    *,
    address: str,
    port: int,
    token_file: str,
    policy_file: str,
    audit_log: str,
    metrics_port: int,
    max_bytes_per_sec: float | None,
    max_streams_per_user: int,
    max_streams_per_pod: int,
    stream_idle_timeout: float,
    max_forwards_per_session: int = DEFAULT_MAX_FORWARDS_PER_SESSION,
    plain_http: bool,
    tls_cert: str = "",
    tls_key: str = "",
    client_ca: str = "",
    san: tuple[str, ...] = (),
    allowed_origin: tuple[str, ...] = (),
    max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED,
    auth_timeout: float = DEFAULT_AUTH_TIMEOUT_SECONDS,
    audit_log_max_bytes: int = DEFAULT_AUDIT_MAX_BYTES,
    audit_log_keep: int = DEFAULT_AUDIT_KEEP,
) -> GatewayConfig:
    return GatewayConfig(
        state_dir=state_dir,
        cri_socket=cri_socket,
        host=address,
        port=port,
        token_file=token_file,
        policy_file=policy_file,
        audit_log=audit_log,
        metrics_port=metrics_port,
        limits=Limits(
            max_streams_per_user,
            max_streams_per_pod,
            max_bytes_per_sec,
            max_forwards_per_session=max_forwards_per_session,
        ),
        plain_http=plain_http,
        idle_timeout=stream_idle_timeout,
        tls_cert=tls_cert,
        tls_key=tls_key,
        client_ca=client_ca,
        sans=tuple(san),
        allowed_origins=tuple(allowed_origin),
        max_unauthenticated=max_unauthenticated,
        auth_timeout=auth_timeout,
        audit_max_bytes=audit_log_max_bytes,
        audit_keep=audit_log_keep,
    )


@click.command()
@click.option(
    "--state-dir",
    default=str(Path(DEFAULT_STATE_DIR) / "node"),
    show_default=True,
    help="Certificates, tokens, policy, audit log and kubeconfigs.",
)
@click.option(
    "--cri-socket",
    default=str(Path(DEFAULT_STATE_DIR) / "cri.sock"),
    show_default=True,
    help="CRI socket of the runtime (podgate's, containerd's "
    "/run/containerd/containerd.sock, CRI-O's /var/run/crio/crio.sock).",
)
@gateway_options
@click.option(
    "--portforward-via",
    type=click.Choice(["cri", "exec"]),
    default="cri",
    show_default=True,
    help="How to reach pod ports: the runtime's CRI PortForward, or a forwarder (socat, "
    "busybox nc or python3) run in the pod through CRI Exec.",
)
@click.option(
    "--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True
)
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def node(
    state_dir: str,
    cri_socket: str,
    portforward_via: str,
    log_format: str,
    verbose: bool,
    **kw: Any,
) -> None:
    """Serve kubectl's exec, attach, port-forward, logs and pod listing for this node, in
    front of any CRI runtime, over HTTPS with client certificates or bearer tokens, an
    authorization policy and an audit log.

    On first start it makes a CA, server and admin certificates, an admin token, a default
    policy and admin kubeconfigs under STATE_DIR (`kubeconfig`: certificate,
    `kubeconfig-token`: token).
    """
    setup_logging(log_format, verbose)
    config = make_config(state_dir, cri_socket, **kw)
    try:
        run(_node(config, via_exec=portforward_via == "exec"))
    except (InsecureListenError, ValueError) as exc:
        raise click.UsageError(str(exc)) from exc
    except OSError as exc:
        failure = listen_failure(exc, config.host, config.port)
        if failure is None:
            raise
        raise failure from None


async def _node(config: GatewayConfig, *, via_exec: bool = False) -> None:
    client = CriClient(config.cri_socket)
    target = CriTarget(client, via_exec=via_exec)
    source = CriPodSource(client, target, node=os.uname().nodename)
    try:
        version = await client.version()
        async with running_gateway(config, source) as gateway:
            print(
                f"podgate node ready api={gateway.url} runtime={version.runtime_name} "
                f"{version.runtime_version} kubeconfig={gateway.credentials.kubeconfig}",
                flush=True,
            )
            sig = await wait_for_signal()
            print(f"podgate node: signal {sig}, stopping", flush=True)
    finally:
        await target.aclose()
        await client.close()
