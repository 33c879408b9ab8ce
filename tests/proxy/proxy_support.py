"""`podgate proxy` in front of a private containerd 1.6 (tests/e2e/containerd_support.py), with
two pods (imported by module name; keep it unique):

- a plain pod on the host network, whose port containerd's own port-forward reaches;
- a "netstack" pod standing in for a gVisor or Kata sandbox: its listener cannot be reached
  from the pod's network namespace as containerd dials it, but can from inside the sandbox.

How the sandbox is simulated: the pod gets a network namespace of its own (CNI: `host-device`
moves one end of a veth pair made for the test into it, the other end staying down on the
host; `static` IPAM; containerd's `loopback`), and in that namespace only an iptables OUTPUT
rule REJECTs (TCP reset) connections to the listener's port on `lo` from sockets owned by
uid 0 (unless their group is AGENT_GID, the stand-in for a sandbox agent that lives inside
the sandbox). containerd's port-forward dials from its own process
(root) after entering the pod's namespace, so it is refused, as it finds nothing listening
in a VM's or netstack's pod namespace; the container runs as uid 1000, so a forwarder exec'd
in it (what the proxy does) connects. The rule lives in the pod's namespace alone, which the
test checks, and goes with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from containerd_support import (
    CRI_CALL_SECONDS,
    IMAGE_NAME,
    Containerd,
    missing_tools,
    private_containerd,
)
from e2e_support import free_port, stop_process

from podgate.cri import api_pb2 as pb

# Where Debian's containernetworking-plugins puts the plugins.
CNI_PLUGIN_DIR = Path("/usr/lib/cni")
CNI_PLUGINS = ("loopback", "host-device", "static")
# A /24 inside the pod's own namespace (nothing is routed to it from the host).
POD_ADDRESS = "10.251.0.2/24"
# The annotation the proxy selects the netstack pod by.
SELECT_ANNOTATION = "podgate.test/sandbox"
SELECT_VALUE = "netstack"
# The container's user: not root, so iptables' owner match lets its forwarder through.
POD_UID = 1000
# podgate's agent, standing in for the one inside a real sandbox, runs in the pod's namespace
# as root with this group, which the iptables rule lets through (containerd's group is 0).
AGENT_GID = 4242
# containerd picks a new CNI configuration up from its directory within this.
CNI_READY_SECONDS = 30.0
# From starting `podgate proxy` (or `podgate node`) to its ready line.
READY_SECONDS = 30.0
# Until a container's listener accepts connections.
LISTEN_SECONDS = 20.0
PROXY_READY = re.compile(rb"podgate proxy ready listen=(\S+) upstream=(\S+) streaming=(\S+)")
NODE_READY = re.compile(rb"podgate node ready api=(\S+) runtime=(.*?) kubeconfig=(\S+)")


@dataclass
class Process:
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_process(
    argv: list[str],
    log_path: Path,
    ready: re.Pattern[bytes],
    env: dict[str, str] | None = None,
) -> tuple[Process, re.Match[bytes]]:
    with log_path.open("ab") as log:
        offset = log.tell()
        proc = subprocess.Popen(
            [sys.executable, "-m", "podgate", *argv],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    process = Process(proc, log_path)
    deadline = time.monotonic() + READY_SECONDS
    while not (match := ready.search(log_path.read_bytes()[offset:])):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc)
            pytest.fail(f"podgate {argv[0]} printed no ready line:\n{process.log()}")
        time.sleep(0.05)
    return process, match


def start_proxy(work: Path, ctrd: Containerd, *extra: str, plane: str = "relay") -> Process:
    process, _ = start_process(
        [
            "proxy",
            "--listen",
            str(work / "proxy.sock"),
            "--upstream",
            f"unix://{ctrd.socket}",
            "--select-annotation",
            f"{SELECT_ANNOTATION}={SELECT_VALUE}",
            *("--data-plane", plane),
            *extra,
        ],
        work / "proxy.log",
        PROXY_READY,
    )
    return process


@dataclass(frozen=True, slots=True)
class Pod:
    sandbox_id: str
    container_id: str
    uid: str
    name: str
    port: int


@dataclass
class ProxyStack:
    ctrd: Containerd
    work: Path
    proxy: Process
    plain: Pod
    netstack: Pod
    plane: str = "relay"

    @property
    def proxy_socket(self) -> Path:
        return self.work / "proxy.sock"

    def restart_proxy(self) -> None:
        stop_process(self.proxy.proc)
        self.proxy = start_proxy(self.work, self.ctrd, plane=self.plane)


def echo_command(port: int) -> list[str]:
    return ["sh", "-c", f"echo serving on {port}; exec nc -ll -p {port} -e cat"]


def run_pod(
    ctrd: Containerd,
    runtime: pb.RuntimeServiceStub,
    name: str,
    command: list[str],
    *,
    host_network: bool,
    annotations: dict[str, str] | None = None,
    run_as_user: int | None = None,
    port: int = 0,
) -> Pod:
    """A pod with one started container (RunPodSandbox, CreateContainer, StartContainer)."""
    network = pb.NODE if host_network else pb.POD
    namespaces = pb.NamespaceOption(network=network, pid=pb.CONTAINER, ipc=pb.POD)
    logs = ctrd.base / "logs" / name
    logs.mkdir(parents=True, exist_ok=True)
    uid = str(uuid.uuid4())
    sandbox_config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=name, namespace="default", uid=uid, attempt=0),
        log_directory=str(logs),
        annotations=annotations or {},
        linux=pb.LinuxPodSandboxConfig(
            cgroup_parent=ctrd.cgroup_parent,
            security_context=pb.LinuxSandboxSecurityContext(namespace_options=namespaces),
        ),
    )
    sandbox_id = runtime.RunPodSandbox(
        pb.RunPodSandboxRequest(config=sandbox_config), timeout=CRI_CALL_SECONDS
    ).pod_sandbox_id
    ctrd.sandboxes.append(sandbox_id)
    security = pb.LinuxContainerSecurityContext(namespace_options=namespaces)
    if run_as_user is not None:
        security.run_as_user.value = run_as_user
    ports = json.dumps([{"containerPort": port, "protocol": "TCP"}]) if port else "[]"
    container_config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name="main", attempt=0),
        image=pb.ImageSpec(image=IMAGE_NAME),
        command=command,
        log_path="main.log",
        annotations={"io.kubernetes.container.ports": ports},
        linux=pb.LinuxContainerConfig(security_context=security),
    )
    container_id = runtime.CreateContainer(
        pb.CreateContainerRequest(
            pod_sandbox_id=sandbox_id, config=container_config, sandbox_config=sandbox_config
        ),
        timeout=CRI_CALL_SECONDS,
    ).container_id
    runtime.StartContainer(
        pb.StartContainerRequest(container_id=container_id), timeout=CRI_CALL_SECONDS
    )
    ctrd.wait_running(container_id)
    return Pod(sandbox_id, container_id, uid, name, port)


def setup_cni(ctrd: Containerd, device: str) -> None:
    """containerd's CNI directories: the three plugins, one network moving `device` in."""
    bin_dir = ctrd.base / "cni" / "bin"
    conf_dir = ctrd.base / "cni" / "conf"
    bin_dir.mkdir(parents=True, exist_ok=True)
    conf_dir.mkdir(parents=True, exist_ok=True)
    for plugin in CNI_PLUGINS:
        (bin_dir / plugin).symlink_to(CNI_PLUGIN_DIR / plugin)
    network = {
        "cniVersion": "0.4.0",
        "name": "podgate-proxy-test",
        "plugins": [
            {
                "type": "host-device",
                "device": device,
                "ipam": {"type": "static", "addresses": [{"address": POD_ADDRESS}]},
            }
        ],
    }
    (conf_dir / "10-podgate-proxy-test.conflist").write_text(json.dumps(network))
    deadline = time.monotonic() + CNI_READY_SECONDS
    while True:
        status = ctrd.runtime.Status(pb.StatusRequest(), timeout=CRI_CALL_SECONDS).status
        if any(c.type == "NetworkReady" and c.status for c in status.conditions):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"containerd's network never got ready: {status}")
        time.sleep(0.2)


def sandbox_pid(runtime: pb.RuntimeServiceStub, sandbox_id: str) -> int:
    response = runtime.PodSandboxStatus(
        pb.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=True),
        timeout=CRI_CALL_SECONDS,
    )
    return int(json.loads(response.info["info"])["pid"])


def iptables_rule(port: int, tag: str) -> list[str]:
    return [
        "OUTPUT", "-o", "lo", "-p", "tcp", "--dport", str(port),
        "-m", "owner", "--uid-owner", "0", "!", "--gid-owner", str(AGENT_GID),
        "-m", "comment", "--comment", tag,
        "-j", "REJECT", "--reject-with", "tcp-reset",
    ]  # fmt: skip


def in_netns(pid: int, argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["nsenter", "-t", str(pid), "-n", *argv],
        capture_output=True,
        text=True,
        timeout=CRI_CALL_SECONDS,
        check=False,
    )


def wait_listening_in(pid: int, port: int) -> None:
    """Until something listens on `port` in the namespace of `pid` (ss from the host)."""
    deadline = time.monotonic() + LISTEN_SECONDS
    while f":{port} " not in in_netns(pid, ["ss", "-Hltn"]).stdout:
        if time.monotonic() > deadline:
            raise AssertionError(f"nothing listens on {port} in the pod")
        time.sleep(0.1)


def wait_listening(port: int) -> None:
    deadline = time.monotonic() + LISTEN_SECONDS
    while (
        f":{port} "
        not in subprocess.run(["ss", "-Hltn"], capture_output=True, text=True, check=False).stdout
    ):
        if time.monotonic() > deadline:
            raise AssertionError(f"nothing listens on {port}")
        time.sleep(0.1)


def required_tools() -> None:
    if os.geteuid() != 0:
        pytest.skip("containerd, runc, CNI and iptables need root")
    missing = [p for p in CNI_PLUGINS if not (CNI_PLUGIN_DIR / p).exists()]
    if missing:
        pytest.skip(f"CNI plugins {missing} are not installed (containernetworking-plugins)")
    for tool in ("iptables", "nsenter", "ss", "ip"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (iptables, util-linux, iproute2)")


@contextlib.contextmanager
def proxy_stack(plane: str = "relay") -> Iterator[ProxyStack]:
    required_tools()
    tools, why = missing_tools()
    if tools is None:
        pytest.skip(why)
    device = f"pgpx{uuid.uuid4().hex[:8]}"
    tag = f"podgate-proxy-test-{uuid.uuid4().hex[:8]}"
    # A veth pair: one end moves into the pod, the other stays down on the host (no address,
    # no route) and takes the pair with it when deleted.
    peer = device + "h"
    subprocess.run(["ip", "link", "add", device, "type", "veth", "peer", "name", peer], check=True)
    proxy: Process | None = None
    work = Path(tempfile.mkdtemp(prefix="pgpx", dir="/tmp"))
    try:
        with private_containerd(tools) as ctrd:
            setup_cni(ctrd, device)
            runtime = ctrd.runtime
            plain_port = free_port()
            plain = run_pod(
                ctrd, runtime, "plain", echo_command(plain_port), host_network=True, port=plain_port
            )
            wait_listening(plain_port)
            net_port = free_port()
            netstack = run_pod(
                ctrd,
                runtime,
                "netstack",
                echo_command(net_port),
                host_network=False,
                annotations={SELECT_ANNOTATION: SELECT_VALUE},
                run_as_user=POD_UID,
                port=net_port,
            )
            pid = sandbox_pid(runtime, netstack.sandbox_id)
            wait_listening_in(pid, net_port)
            added = in_netns(pid, ["iptables", "-w", "-A", *iptables_rule(net_port, tag)])
            assert added.returncode == 0, added.stderr
            # The rule is in the pod's namespace and nowhere else.
            assert tag in in_netns(pid, ["iptables", "-w", "-S", "OUTPUT"]).stdout
            host_rules = subprocess.run(
                ["iptables", "-w", "-S", "OUTPUT"], capture_output=True, text=True, check=False
            )
            assert tag not in host_rules.stdout
            proxy = start_proxy(work, ctrd, plane=plane)
            stack = ProxyStack(ctrd, work, proxy, plain, netstack, plane)
            try:
                yield stack
            finally:
                stop_process(stack.proxy.proc)
    finally:
        if proxy is not None and proxy.proc.poll() is None:
            stop_process(proxy.proc)
        # Back in the host's namespace once the pod's is gone (or never left it).
        subprocess.run(["ip", "link", "del", peer], capture_output=True, check=False)
        shutil.rmtree(work, ignore_errors=True)
