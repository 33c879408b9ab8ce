"""Aggregated discovery in the version each kubectl asks for: with it, kubectl needs no
/api/v1 request (v2beta1 for 1.27-1.29, v2 from 1.30)."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest

from podgate.node.kubeapi import aggregated_discovery_version
from servers import RunningServers

pytestmark = pytest.mark.e2e

ACCEPT_127 = (
    "application/json;g=apidiscovery.k8s.io;v=v2beta1;as=APIGroupDiscoveryList,application/json"
)
ACCEPT_133 = (
    "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,"
    "application/json;g=apidiscovery.k8s.io;v=v2beta1;as=APIGroupDiscoveryList,application/json"
)


@pytest.mark.parametrize(
    ("accept", "version"),
    [
        (ACCEPT_127, "v2beta1"),
        (ACCEPT_133, "v2"),
        ("application/json, */*", None),
        ("application/json;g=apidiscovery.k8s.io;v=v3;as=APIGroupDiscoveryList", None),
        ("application/json;as=Table;v=v1;g=meta.k8s.io", None),
    ],
)
def test_the_first_supported_aggregated_version_is_chosen(accept: str, version: str | None) -> None:
    assert aggregated_discovery_version(accept) == version


def kubectl(version: str) -> str:
    found = subprocess.run(["which", "kubectl"], capture_output=True, text=True, check=False)
    if found.returncode != 0:
        pytest.skip("kubectl is not installed")
    path = os.path.join(
        os.path.dirname(os.path.realpath(found.stdout.strip())), f"kubectl.{version}"
    )
    if not os.path.exists(path):
        pytest.skip(f"{path} is not installed")
    return path


@pytest.mark.parametrize("version", ["1.27", "1.33"])
def test_kubectl_discovers_pods_without_asking_for_api_v1(
    demo: RunningServers, version: str
) -> None:
    with tempfile.TemporaryDirectory() as home:
        out = subprocess.run(
            [kubectl(version), "get", "pods", "-v=6"],
            env={**os.environ, "KUBECONFIG": demo.kubeconfig, "HOME": home},
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    assert out.returncode == 0, out.stderr
    assert re.search(r"^demo\s+1/1\s+Running", out.stdout, re.MULTILINE)
    requested = re.findall(r"GET\"? (?:url=\")?https?://[^/]+(/[^?\" ]*)", out.stderr)
    assert "/api" in requested and "/apis" in requested
    assert "/api/v1" not in requested  # the aggregated answer already listed pods
