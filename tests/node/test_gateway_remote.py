"""A remote-style node: the gateway listens on an address inside a network namespace made by
the test (a veth pair with a private /30 routed only there), with the operator's certificate
and CA, and kubectl on the host verifies it without insecure-skip-tls-verify. A second
gateway shows `--san` on the generated certificate, verified by name.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

READY_TIMEOUT_SECONDS = 30.0
STOP_TIMEOUT_SECONDS = 30.0
KUBECTL_TIMEOUT_SECONDS = 60.0
READY = re.compile(r"ready (\S+)")

# The gateway of `podgate node`, serving the demo pod (this host's processes) instead of a CRI
# runtime's, with the configuration given as JSON.
GATEWAY = r"""
import asyncio, json, sys
from podgate.aio.loop import run
from podgate.demo.api import DemoPod, DemoSource
from podgate.node.gateway import GatewayConfig
from podgate.node.server import running_gateway
from podgate.runtime.daemon import wait_for_signal
from podgate.streaming.local import LocalTarget

async def main():
    config = GatewayConfig(**json.loads(sys.argv[1]))
    source = DemoSource(LocalTarget(), [DemoPod("default", "demo")])
    async with running_gateway(config, source) as gateway:
        print("ready", gateway.url, flush=True)
        await wait_for_signal()

run(main())
"""


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl is not installed")
    return path


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces, veths)")
    if shutil.which("ip") is None:
        pytest.skip("iproute2 is not installed")


def free_slash30() -> ipaddress.IPv4Network:
    """A random /30 in 10.192.0.0/10 that overlaps no route of the host."""
    text = subprocess.run(
        ["ip", "-j", "-4", "route", "show", "table", "all"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    taken = [
        ipaddress.ip_network(r["dst"], strict=False)
        for r in json.loads(text or "[]")
        if r.get("dst") not in (None, "", "default")
    ]
    for _ in range(100):
        net = ipaddress.ip_network(
            f"10.{random.randint(192, 254)}.{random.randint(0, 255)}.{4 * random.randint(0, 63)}/30"
        )
        if not any(net.overlaps(r) for r in taken if r.version == 4):
            return net  # type: ignore[return-value]
    raise RuntimeError("no free /30")


@dataclass
class Link:
    netns: str
    host_ip: str
    node_ip: str
    host_if: str


def ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True)


@contextmanager
def veth_netns() -> Iterator[Link]:
    net = free_slash30()
    host_ip, node_ip = (str(a) for a in net.hosts())
    suffix = secrets.token_hex(3)
    netns, host_if, node_if = f"pgrem{suffix}", f"pgh{suffix}", f"pgn{suffix}"
    ip("netns", "add", netns)
    try:
        ip("link", "add", host_if, "type", "veth", "peer", "name", node_if)
        ip("link", "set", node_if, "netns", netns)
        ip("addr", "add", f"{host_ip}/30", "dev", host_if)
        ip("link", "set", host_if, "up")
        ip("-n", netns, "addr", "add", f"{node_ip}/30", "dev", node_if)
        ip("-n", netns, "link", "set", node_if, "up")
        ip("-n", netns, "link", "set", "lo", "up")
        # Traffic to the node address leaves through our veth, and only there.
        route = json.loads(
            subprocess.run(
                ["ip", "-j", "route", "get", node_ip], capture_output=True, text=True, check=True
            ).stdout
        )
        assert route[0]["dev"] == host_if, route
        yield Link(netns, host_ip, node_ip, host_if)
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", netns], capture_output=True, check=False)


def operator_pki(directory: Path, ips: Sequence[str], names: Sequence[str]) -> tuple[Path, ...]:
    """An operator's CA and a server certificate it issued for `ips` and `names`."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "operator-ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(a)) for a in ips]
    sans += [x509.DNSName(n) for n in names]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "node")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    paths = directory / "ca.crt", directory / "server.crt", directory / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths


@contextmanager
def gateway_in(netns: str, config: dict[str, object], log: Path) -> Iterator[str]:
    argv = ["ip", "netns", "exec", netns, sys.executable, "-c", GATEWAY, json.dumps(config)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while not (m := READY.search(log.read_text(errors="replace"))):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        yield m[1]
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(STOP_TIMEOUT_SECONDS)


def run_kubectl(*argv: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [kubectl(), *argv], capture_output=True, timeout=KUBECTL_TIMEOUT_SECONDS, check=False
    )


def test_operator_certificate_on_a_netns_address_verifies_with_kubectl(tmp_path: Path) -> None:
    need_root()
    kubectl()
    with veth_netns() as link:
        ca, cert, key = operator_pki(tmp_path / "operator", [link.node_ip], ["node.example"])
        state = tmp_path / "state"
        config = {
            "state_dir": str(state),
            "cri_socket": "",
            "host": link.node_ip,
            "port": 0,
            "tls_cert": str(cert),
            "tls_key": str(key),
            "client_ca": str(ca),
        }
        with gateway_in(link.netns, config, tmp_path / "gw.log") as url:
            assert url.startswith(f"https://{link.node_ip}:")
            kubeconfig = state / "kubeconfig-token"
            text = kubeconfig.read_text()
            assert "insecure-skip-tls-verify" not in text
            assert f'server: "{url}"' in text
            # The kubeconfig trusts the operator's CA, not the generated one.
            assert base64.b64encode(ca.read_bytes()).decode() in text
            pods = run_kubectl("--kubeconfig", str(kubeconfig), "get", "pods", "-o", "name")
            assert pods.returncode == 0, pods.stderr
            assert pods.stdout == b"pod/demo\n"
            ran = run_kubectl("--kubeconfig", str(kubeconfig), "exec", "demo", "--", "echo", "hi")
            assert ran.returncode == 0, ran.stderr
            assert ran.stdout == b"hi\n"
            # The generated CA does not verify the operator's certificate: TLS is really checked.
            wrong = run_kubectl(
                "--kubeconfig",
                str(kubeconfig),
                "--certificate-authority",
                str(state / "pki" / "ca.crt"),
                "get",
                "pods",
            )
            assert wrong.returncode != 0
            assert b"certificate" in wrong.stderr


def test_san_on_the_generated_certificate_verifies_by_name(tmp_path: Path) -> None:
    need_root()
    kubectl()
    with veth_netns() as link:
        state = tmp_path / "state"
        config = {
            "state_dir": str(state),
            "cri_socket": "",
            "host": link.node_ip,
            "port": 0,
            "sans": ["gw.podgate.test"],
        }
        with gateway_in(link.netns, config, tmp_path / "gw.log") as url:
            kubeconfig = str(state / "kubeconfig")  # the admin client certificate
            by_address = run_kubectl("--kubeconfig", kubeconfig, "get", "pods", "-o", "name")
            assert by_address.returncode == 0, by_address.stderr
            # The extra name verifies too (kubectl checks it in place of the address).
            by_name = run_kubectl(
                "--kubeconfig",
                kubeconfig,
                "--tls-server-name",
                "gw.podgate.test",
                "get",
                "pods",
                "-o",
                "name",
            )
            assert by_name.returncode == 0, by_name.stderr
            other = run_kubectl(
                "--kubeconfig", kubeconfig, "--tls-server-name", "other.test", "get", "pods"
            )
            assert other.returncode != 0
            assert b"certificate" in other.stderr
            assert url.startswith(f"https://{link.node_ip}:")
    with suppress(FileNotFoundError):
        shutil.rmtree(state)
