"""Containers with a root run through runc: a real `podgate runtime` daemon, a busybox root.

The root is a directory (Debian's busybox-static installed into it, plus /etc/passwd and
/etc/group) passed as an absolute `image.image`: the node-directory form the runtime keeps
beside images from its store (those are tested in test_runtime_images.py). Every check runs
inside the container through ExecSync (runc exec) or reads its log, and compares with what
containerd gives (the shared docs, reference/images-and-oci.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from runtime_e2e_support import (
    POD_NAMESPACE,
    WAIT_SECONDS,
    Feed,
    Pod,
    Pods,
    Resizes,
    RuntimeDaemon,
    Sink,
    rpc_error,
    running_daemon,
    state_root,
    stream_target,
    wait_for_log,
)

from busybox_rootfs import make_rootfs
from podgate.cri import api_pb2 as pb
from podgate.cri import api_pb2_grpc as pb_grpc
from podgate.runtime.store import Store
from podgate.streaming.client import ExecResult, exec_spdy

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the runtime creates namespaces"),
]

# containerd's 14 default capabilities as a /proc/<pid>/status mask, computed by hand from
# <linux/capability.h>: CHOWN 0, DAC_OVERRIDE 1, FOWNER 3, FSETID 4, KILL 5, SETGID 6,
# SETUID 7, SETPCAP 8, NET_BIND_SERVICE 10, NET_RAW 13, SYS_CHROOT 18, MKNOD 27,
# AUDIT_WRITE 29, SETFCAP 31.
DEFAULT_CAP_MASK = "00000000a80425fb"
# A secret the test puts in a container's environment and looks for in every host argv.
SECRET_VALUE = "s3cr3t-value-7f1c9a"
EXEC_TIMEOUT = 30
MASKED_FILE = "/etc/masked-secret"
MASKED_TEXT = "only the image knows\n"
# Waits until its terminal is 132x43, then says so and exits.
WAIT_FOR_SIZE = (
    'while :; do s=$(stty size 2>/dev/null); [ "$s" = "43 132" ] && { echo "now $s"; exit 0; }; '
    "sleep 0.05; done"
)


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if shutil.which("runc") is None:
        pytest.skip("runc is not installed")
    root = make_rootfs(tmp_path_factory.mktemp("busybox") / "root")
    (root / MASKED_FILE.lstrip("/")).write_text(MASKED_TEXT)
    yield str(root)


def security(**kwargs: object) -> pb.LinuxContainerSecurityContext:
    return pb.LinuxContainerSecurityContext(**kwargs)  # type: ignore[arg-type]


async def run_pod(
    cri: pb_grpc.RuntimeServiceStub,
    pods: Pods,
    name: str,
    *,
    privileged: bool = False,
    **kw: object,
) -> Pod:
    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=name, namespace=POD_NAMESPACE, uid=os.urandom(8).hex()),
        linux=pb.LinuxPodSandboxConfig(
            security_context=pb.LinuxSandboxSecurityContext(privileged=privileged)
        ),
        **kw,  # type: ignore[arg-type]
    )
    response = await cri.RunPodSandbox(pb.RunPodSandboxRequest(config=config))
    pods.created.append(response.pod_sandbox_id)
    return Pod(response.pod_sandbox_id, config)


async def container(
    cri: pb_grpc.RuntimeServiceStub,
    pod: Pod,
    rootfs: str,
    name: str,
    command: list[str],
    *,
    sec: pb.LinuxContainerSecurityContext | None = None,
    resources: pb.LinuxContainerResources | None = None,
    envs: dict[str, str] | None = None,
    start: bool = True,
    log_path: str = "",
    stdin: bool = False,
    stdin_once: bool = False,
    tty: bool = False,
) -> str:
    config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=name),
        image=pb.ImageSpec(image=rootfs),
        command=command,
        envs=[pb.KeyValue(key=k, value=v) for k, v in (envs or {}).items()],
        log_path=log_path,
        stdin=stdin,
        stdin_once=stdin_once,
        tty=tty,
        linux=pb.LinuxContainerConfig(
            security_context=sec or security(seccomp=pb.SecurityProfile()),
            resources=resources,
        ),
    )
    response = await cri.CreateContainer(
        pb.CreateContainerRequest(pod_sandbox_id=pod.id, config=config, sandbox_config=pod.config)
    )
    if start:
        await cri.StartContainer(pb.StartContainerRequest(container_id=response.container_id))
    return response.container_id


async def run(cri: pb_grpc.RuntimeServiceStub, container_id: str, *cmd: str) -> pb.ExecSyncResponse:
    return await cri.ExecSync(
        pb.ExecSyncRequest(container_id=container_id, cmd=list(cmd), timeout=EXEC_TIMEOUT)
    )


async def ok(cri: pb_grpc.RuntimeServiceStub, container_id: str, *cmd: str) -> str:
    response = await run(cri, container_id, *cmd)
    assert (response.exit_code, response.stderr) == (0, b""), response
    return response.stdout.decode()


def status_field(text: str, name: str) -> str:
    match = re.search(rf"^{name}:\s*(\S+)$", text, re.MULTILINE)
    assert match is not None, text
    return match.group(1)


def own_cap_bnd() -> str:
    return status_field(Path("/proc/self/status").read_text(), "CapBnd")


async def test_container_is_isolated_from_the_node(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, rootfs: str, runtime_daemon: RuntimeDaemon
) -> None:
    pod = await run_pod(cri, pods, "runc-iso", hostname="runc-iso")
    cid = await container(
        cri, pod, rootfs, "main", ["sleep", "1000"], envs={"SECRET": SECRET_VALUE}
    )
    state = runtime_daemon.state_dir
    record = state / "pods" / f"{pod.id}.json"
    assert record.exists()
    # The state directory and the CRI socket do not exist in the container's root...
    for path in (str(record), str(state), runtime_daemon.cri_socket):
        response = await run(cri, cid, "cat", path)
        assert response.exit_code != 0 and b"No such file or directory" in response.stderr
    response = await run(cri, cid, "nc", "-U", runtime_daemon.cri_socket)
    assert response.exit_code != 0
    # ...nor through the pod's PID 1, the holder: its root is an empty tmpfs, so even a
    # container that may ptrace it finds nothing of the node there.
    response = await run(cri, cid, "ls", f"/proc/1/root{state}")
    assert response.exit_code != 0 and b"Permission denied" in response.stderr
    tracer = await container(
        cri,
        pod,
        rootfs,
        "tracer",
        ["sleep", "1000"],
        sec=security(capabilities=pb.Capability(add_capabilities=["SYS_PTRACE"])),
    )
    assert await ok(cri, tracer, "ls", "-a", "/proc/1/root/") == ".\n..\n"
    response = await run(cri, tracer, "ls", f"/proc/1/root{state}")
    assert response.exit_code != 0 and b"No such file or directory" in response.stderr
    assert await ok(cri, tracer, "ls", "-a", "/proc/1/root/../..") == ".\n..\n"

    # Only the pod's processes: its holder (PID 1), the container's sleep and ps itself.
    ps = await ok(cri, cid, "ps", "-o", "pid,comm")
    comms = {line.split()[1] for line in ps.splitlines()[1:]}
    assert comms <= {"python3", "python", "sleep", "ps"}, ps
    assert "sleep" in comms and "ps" in comms

    status = await ok(cri, cid, "cat", "/proc/self/status")
    for field in ("CapEff", "CapPrm", "CapBnd"):
        assert status_field(status, field) == DEFAULT_CAP_MASK, field
    assert status_field(status, "CapInh") == "0000000000000000"
    assert status_field(status, "Seccomp") == "2"
    assert status_field(status, "NoNewPrivs") == "0"
    # The main process blocks no signal (nothing of the shim's mask leaks into it).
    info = await cri.ContainerStatus(pb.ContainerStatusRequest(container_id=cid, verbose=True))
    main_pid = json.loads(info.info["info"])["pid"]
    host_status = Path(f"/proc/{main_pid}/status").read_text()
    assert "sleep" in status_field(host_status, "Name")
    assert status_field(host_status, "SigBlk") == "0" * 16

    # An exec'd process has only stdin, stdout and stderr: the shell lists its own fds (the
    # trailing `true` keeps it from exec'ing ls, whose directory would be fd 3).
    fds = await ok(cri, cid, "sh", "-c", "ls /proc/$$/fd; true")
    assert fds.split() == ["0", "1", "2"]

    # The environment reaches the process, yet no host process carries it in its argv.
    task = asyncio.ensure_future(run(cri, cid, "sh", "-c", 'sleep 2; echo "$SECRET"'))
    saw_runc_exec = False
    while not task.done():
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                argv = cmdline.read_bytes()
            except OSError:
                continue
            assert SECRET_VALUE.encode() not in argv, argv
            saw_runc_exec = saw_runc_exec or (b"exec\0--process\0" in argv)
        await asyncio.sleep(0.05)
    response = await task
    assert response.stdout == f"{SECRET_VALUE}\n".encode()
    assert saw_runc_exec


async def test_user_group_and_supplemental_groups(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, rootfs: str
) -> None:
    pod = await run_pod(cri, pods, "runc-users")
    # A uid without a passwd entry: gid 0.
    cid = await container(
        cri,
        pod,
        rootfs,
        "uid",
        ["sleep", "1000"],
        sec=security(run_as_user=pb.Int64Value(value=1001)),
    )
    assert await ok(cri, cid, "id", "-u") == "1001\n"
    assert await ok(cri, cid, "id", "-g") == "0\n"
    # A user name resolved in the image's /etc/passwd.
    cid = await container(
        cri, pod, rootfs, "name", ["sleep", "1000"], sec=security(run_as_username="nobody")
    )
    assert await ok(cri, cid, "id", "-nu") == "nobody\n"
    assert await ok(cri, cid, "id", "-u") == "65534\n"
    # uid and gid, plus supplemental groups merged with the image's groups for that user.
    cid = await container(
        cri,
        pod,
        rootfs,
        "groups",
        ["sleep", "1000"],
        sec=security(
            run_as_user=pb.Int64Value(value=1000),
            supplemental_groups=[1234, 5678],
        ),
    )
    assert await ok(cri, cid, "id", "-u") == "1000\n"
    assert sorted(map(int, (await ok(cri, cid, "id", "-G")).split())) == [1000, 1234, 5678, 50000]
    cid = await container(
        cri,
        pod,
        rootfs,
        "strict",
        ["sleep", "1000"],
        sec=security(
            run_as_user=pb.Int64Value(value=1000),
            supplemental_groups=[1234],
            supplemental_groups_policy=pb.Strict,
        ),
    )
    assert sorted(map(int, (await ok(cri, cid, "id", "-G")).split())) == [1000, 1234]
    cid = await container(
        cri,
        pod,
        rootfs,
        "uidgid",
        ["sleep", "1000"],
        sec=security(run_as_user=pb.Int64Value(value=1001), run_as_group=pb.Int64Value(value=1002)),
    )
    assert await ok(cri, cid, "sh", "-c", "echo $(id -u):$(id -g)") == "1001:1002\n"
    # A group without a user is refused, as containerd does.
    err = await rpc_error(
        container(
            cri,
            pod,
            rootfs,
            "nouser",
            ["true"],
            sec=security(run_as_group=pb.Int64Value(value=1002)),
        )
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert 'user group "1002" is specified without user' in (err.details() or "")


async def test_readonly_rootfs_masked_and_readonly_paths(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, rootfs: str
) -> None:
    pod = await run_pod(cri, pods, "runc-ro")
    cid = await container(
        cri, pod, rootfs, "ro", ["sleep", "1000"], sec=security(readonly_rootfs=True)
    )
    response = await run(cri, cid, "touch", "/test.go")
    assert response.exit_code != 0
    assert response.stderr == b"touch: /test.go: Read-only file system\n"
    cid = await container(cri, pod, rootfs, "rw", ["sleep", "1000"])
    assert await ok(cri, cid, "sh", "-c", "touch /test.go && [ -f /test.go ] && echo Found") == (
        "Found\n"
    )
    cid = await container(
        cri,
        pod,
        rootfs,
        "masked",
        ["sleep", "1000"],
        sec=security(masked_paths=[MASKED_FILE], readonly_paths=["/tmp"]),
    )
    assert await ok(cri, cid, "cat", MASKED_FILE) == ""  # /dev/null over the file
    response = await run(cri, cid, "touch", "/tmp/test")
    assert response.stderr == b"touch: /tmp/test: Read-only file system\n"
    # The image itself is untouched, and the default container sees the file.
    assert Path(rootfs, MASKED_FILE.lstrip("/")).read_text() == MASKED_TEXT
    assert (
        await ok(
            cri, await container(cri, pod, rootfs, "plain", ["sleep", "1000"]), "cat", MASKED_FILE
        )
        == MASKED_TEXT
    )
    assert not Path(rootfs, "test.go").exists()  # writes went to the container's upper dir


async def test_privileged_and_capabilities(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, rootfs: str
) -> None:
    plain = await run_pod(cri, pods, "runc-caps")
    cid = await container(cri, plain, rootfs, "default", ["sleep", "1000"])
    assert (await run(cri, cid, "brctl", "addbr", "foobar")).exit_code != 0
    cid = await container(
        cri,
        plain,
        rootfs,
        "netadmin",
        ["sleep", "1000"],
        sec=security(capabilities=pb.Capability(add_capabilities=["NET_ADMIN"])),
    )
    await ok(cri, cid, "brctl", "addbr", "foobar")
    cid = await container(
        cri,
        plain,
        rootfs,
        "noraw",
        ["sleep", "1000"],
        sec=security(capabilities=pb.Capability(drop_capabilities=["NET_RAW"])),
    )
    response = await run(cri, cid, "ping", "-c", "1", "127.0.0.1")
    assert response.exit_code != 0 and b"ermission denied" in response.stderr
    cid = await container(
        cri,
        plain,
        rootfs,
        "dropall",
        ["sleep", "1000"],
        sec=security(capabilities=pb.Capability(drop_capabilities=["ALL"])),
    )
    assert status_field(await ok(cri, cid, "cat", "/proc/self/status"), "CapBnd") == "0" * 16
    cid = await container(
        cri,
        plain,
        rootfs,
        "addall",
        ["sleep", "1000"],
        sec=security(capabilities=pb.Capability(add_capabilities=["ALL"])),
    )
    assert status_field(await ok(cri, cid, "cat", "/proc/self/status"), "CapBnd") == own_cap_bnd()
    cid = await container(
        cri,
        plain,
        rootfs,
        "onlybind",
        ["sleep", "1000"],
        sec=security(
            capabilities=pb.Capability(
                drop_capabilities=["ALL"], add_capabilities=["NET_BIND_SERVICE"]
            )
        ),
    )
    assert status_field(await ok(cri, cid, "cat", "/proc/self/status"), "CapEff") == (
        f"{1 << 10:016x}"
    )
    # A privileged container needs a privileged pod.
    err = await rpc_error(
        container(cri, plain, rootfs, "priv", ["true"], sec=security(privileged=True))
    )
    assert "no privileged container allowed in sandbox" in (err.details() or "")

    priv = await run_pod(cri, pods, "runc-priv", privileged=True)
    cid = await container(
        cri,
        priv,
        rootfs,
        "priv",
        ["sleep", "1000"],
        sec=security(privileged=True, seccomp=pb.SecurityProfile()),
    )
    status = await ok(cri, cid, "cat", "/proc/self/status")
    assert status_field(status, "CapEff") == own_cap_bnd()
    assert status_field(status, "Seccomp") == "0"  # privileged ignores seccomp
    await ok(cri, cid, "brctl", "addbr", "foobar")
    assert "null" in await ok(cri, cid, "ls", "/dev")


async def test_no_new_privs_and_seccomp(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, rootfs: str
) -> None:
    pod = await run_pod(cri, pods, "runc-seccomp")
    cid = await container(
        cri, pod, rootfs, "nnp", ["sleep", "1000"], sec=security(no_new_privs=True)
    )
    assert status_field(await ok(cri, cid, "cat", "/proc/self/status"), "NoNewPrivs") == "1"

    default = await container(cri, pod, rootfs, "default", ["sleep", "1000"])
    unconfined = await container(
        cri,
        pod,
        rootfs,
        "unconfined",
        ["sleep", "1000"],
        sec=security(seccomp=pb.SecurityProfile(profile_type=pb.SecurityProfile.Unconfined)),
    )
    unset = await container(cri, pod, rootfs, "unset", ["sleep", "1000"], sec=security())
    assert status_field(await ok(cri, unconfined, "cat", "/proc/self/status"), "Seccomp") == "0"
    assert status_field(await ok(cri, unset, "cat", "/proc/self/status"), "Seccomp") == "0"
    # unshare(2) of a user namespace needs no capability; only the profile stops it.
    await ok(cri, unconfined, "unshare", "-U", "true")
    response = await run(cri, default, "unshare", "-U", "true")
    assert response.exit_code != 0 and b"Operation not permitted" in response.stderr


async def test_memory_limit_and_oom_kill(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, rootfs: str
) -> None:
    pod = await run_pod(cri, pods, "runc-mem")
    limit = 64 * 1024 * 1024
    cid = await container(
        cri,
        pod,
        rootfs,
        "limited",
        ["sleep", "1000"],
        resources=pb.LinuxContainerResources(memory_limit_in_bytes=limit, cpu_shares=512),
    )
    inside = await ok(cri, cid, "cat", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
    assert int(inside) == limit
    assert int(await ok(cri, cid, "cat", "/sys/fs/cgroup/cpu/cpu.shares")) == 512

    oom_limit = 15 * 1024 * 1024
    cid = await container(
        cri,
        pod,
        rootfs,
        "oom",
        ["dd", "if=/dev/zero", "of=/dev/null", "bs=20M"],
        resources=pb.LinuxContainerResources(
            memory_limit_in_bytes=oom_limit, memory_swap_limit_in_bytes=oom_limit
        ),
    )
    status = await Pods(cri).wait_state(cid, pb.CONTAINER_EXITED, timeout=60)
    assert (status.exit_code, status.reason) == (137, "OOMKilled")


async def test_exec_sync_returns_when_a_background_child_keeps_the_pipes(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, rootfs: str
) -> None:
    pod = await run_pod(cri, pods, "runc-bg")
    cid = await container(cri, pod, rootfs, "main", ["sleep", "1000"])
    # With the pipes held by `sleep`, waiting for EOF would run into the deadline and fail
    # with DEADLINE_EXCEEDED; the answer must come when `sh` exits.
    response = await run(cri, cid, "sh", "-c", "sleep 600 & echo started")
    assert (response.exit_code, response.stdout) == (0, b"started\n")
    response = await run(cri, cid, "sh", "-c", "echo out; echo err >&2; exit 3")
    assert (response.exit_code, response.stdout, response.stderr) == (3, b"out\n", b"err\n")


async def test_exec_sync_timeout_kills_the_process(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, rootfs: str
) -> None:
    pod = await run_pod(cri, pods, "runc-timeout")
    cid = await container(cri, pod, rootfs, "main", ["tail", "-f", "/dev/null"])
    err = await rpc_error(
        cri.ExecSync(pb.ExecSyncRequest(container_id=cid, cmd=["sleep", "4321"], timeout=1))
    )
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The timed-out process is gone from the pod's PID namespace.
    assert await ok(cri, cid, "sh", "-c", "pidof sleep || true") == ""


async def test_long_pod_name_and_hostname(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, rootfs: str
) -> None:
    name = "n" * 200
    pod = await run_pod(cri, pods, name)
    cid = await container(cri, pod, rootfs, "main", ["sleep", "1000"])
    node = socket.gethostname()
    assert await ok(cri, cid, "hostname") == f"{node}\n"
    assert await ok(cri, cid, "cat", "/etc/hostname") == f"{node}\n"
    assert f"HOSTNAME={node}\n" in await ok(cri, cid, "env")
    named = await run_pod(
        cri,
        pods,
        "runc-named",
        hostname="test-hostname",
        dns_config=pb.DNSConfig(
            servers=["10.10.10.10"], searches=["google.com"], options=["ndots:8"]
        ),
    )
    cid = await container(cri, named, rootfs, "main", ["sleep", "1000"])
    assert await ok(cri, cid, "hostname") == "test-hostname\n"
    assert await ok(cri, cid, "cat", "/etc/resolv.conf") == (
        "search google.com\nnameserver 10.10.10.10\noptions ndots:8\n"
    )
    # /dev/shm is the pod's: a file written by one container is seen by another.
    other = await container(cri, named, rootfs, "other", ["sleep", "1000"])
    await ok(cri, cid, "sh", "-c", "echo shared > /dev/shm/marker")
    assert await ok(cri, other, "cat", "/dev/shm/marker") == "shared\n"


async def test_log_path_cannot_leave_the_log_directory(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, rootfs: str, tmp_path: Path
) -> None:
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    pod = await run_pod(cri, pods, "runc-logs", log_directory=str(log_dir))
    cid = await container(
        cri, pod, rootfs, "main", ["echo", "hello World"], log_path="../../../escape.log"
    )
    log = await wait_for_log(cri, cid, b"hello World")
    assert b" stdout F hello World\n" in log
    status = await Pods(cri).status(cid)
    assert status.log_path == str(log_dir / "escape.log")


async def test_removal_leaves_no_mounts_or_runc_state(
    cri: pb_grpc.RuntimeServiceStub, rootfs: str, runtime_daemon: RuntimeDaemon
) -> None:
    pods = Pods(cri)
    pod = await run_pod(cri, pods, "runc-clean")
    cid = await container(cri, pod, rootfs, "main", ["sleep", "1000"])
    runc_root = runtime_daemon.state_dir / "runc"
    assert (runc_root / cid).is_dir()
    store = Store(runtime_daemon.state_dir)
    container_run, pod_run = str(store.run_path(cid)), str(store.run_path(pod.id))
    mounts = Path("/proc/self/mountinfo").read_text()
    assert f"{container_run}/bundle/rootfs" in mounts
    assert f"{pod_run}/shm" in mounts
    await pods.remove_all()
    mounts = Path("/proc/self/mountinfo").read_text()
    assert f"{container_run}/" not in mounts and f"{pod_run}/" not in mounts
    assert not (runc_root / cid).exists()
    assert Path(f"/sys/fs/cgroup/memory/podgate/{pod.id}").parent.is_dir()
    assert list(Path("/sys/fs/cgroup").glob(f"*/podgate/{pod.id}")) == []  # every hierarchy
    listed = subprocess.run(
        ["runc", "--root", str(runc_root), "list", "-q"], capture_output=True, text=True, check=True
    )
    assert cid not in listed.stdout


async def stream(
    url: str,
    *,
    stdin: Feed | None = None,
    stdout: Sink | None = None,
    stderr: Sink | None = None,
    tty: bool = False,
    resizes: Resizes | None = None,
) -> ExecResult:
    endpoint, path = stream_target(url)
    sizes = resizes.sizes() if resizes is not None else None
    async with asyncio.timeout(WAIT_SECONDS):
        return await exec_spdy(
            endpoint, path, stdin=stdin, stdout=stdout, stderr=stderr, tty=tty, resizes=sizes
        )


async def test_streaming_exec_through_runc(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, rootfs: str
) -> None:
    pod = await run_pod(cri, pods, "runc-exec")
    cid = await container(
        cri, pod, rootfs, "main", ["sleep", "1000"], sec=security(run_as_username="nobody")
    )
    request = pb.ExecRequest(
        container_id=cid,
        cmd=["sh", "-c", "id -u; cat; exit 5"],
        stdin=True,
        stdout=True,
        stderr=True,
    )
    url = (await cri.Exec(request)).url
    payload = os.urandom(100_000)
    stdout, stderr = Sink(), Sink()
    result = await stream(url, stdin=Feed(payload, eof=True), stdout=stdout, stderr=stderr)
    assert result.exit_code == 5
    assert bytes(stdout.data) == b"65534\n" + payload  # the container's user, its stdin
    assert stderr.data == b""


async def test_attach_through_runc(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, rootfs: str
) -> None:
    pod = await run_pod(cri, pods, "runc-attach")
    cid = await container(cri, pod, rootfs, "cat", ["cat"], stdin=True, stdin_once=True)
    request = pb.AttachRequest(container_id=cid, stdin=True, stdout=True, stderr=True)
    url = (await cri.Attach(request)).url
    stdin, stdout, stderr = Feed(b"hello attach\n"), Sink(), Sink()
    session = asyncio.create_task(stream(url, stdin=stdin, stdout=stdout, stderr=stderr))
    try:
        await stdout.wait_for(b"hello attach\n", session=session)
        stdin.close()  # stdin_once: the container's stdin closes and cat exits
        result = await session
    finally:
        session.cancel()
    assert result.exit_code == 0
    assert (await Pods(cri).wait_state(cid, pb.CONTAINER_EXITED)).exit_code == 0

    # A tty container gets its terminal from runc's console socket; resizes reach it.
    script = WAIT_FOR_SIZE
    cid = await container(cri, pod, rootfs, "shell", ["sh", "-c", script], stdin=True, tty=True)
    request = pb.AttachRequest(container_id=cid, stdin=True, stdout=True, tty=True)
    url = (await cri.Attach(request)).url
    resizes, stdout = Resizes(), Sink()
    resizes.push(132, 43)
    try:
        result = await stream(url, stdin=Feed(), stdout=stdout, tty=True, resizes=resizes)
    finally:
        resizes.close()
    assert result.exit_code == 0
    assert bytes(stdout.data) == b"now 43 132\r\n"


async def test_runc_containers_survive_a_killed_daemon(rootfs: str) -> None:
    with state_root() as root:
        first = RuntimeDaemon.start(root / "s", root / "daemon.log")
        try:
            async with first.connect() as rt:
                pod = await run_pod(rt, Pods(rt), "runc-survivor")
                cid = await container(rt, pod, rootfs, "main", ["sleep", "1000"])
                exits = await container(rt, pod, rootfs, "exits", ["sh", "-c", "sleep 2; exit 7"])
        finally:
            first.kill()
        await asyncio.sleep(3)  # `exits` ends while no daemon runs; its shim records it
        with running_daemon(root) as second:
            async with second.connect() as rt:
                pods = Pods(rt)
                assert (await pods.status(cid)).state == pb.CONTAINER_RUNNING
                assert await ok(rt, cid, "echo", "adopted") == "adopted\n"
                status = await pods.status(exits)
                assert (status.state, status.exit_code) == (pb.CONTAINER_EXITED, 7)
                await rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod.id))
                container_run = str(Store(second.state_dir).run_path(cid))
                assert container_run not in Path("/proc/self/mountinfo").read_text()


async def test_stats_update_and_status(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, rootfs: str
) -> None:
    pod = await run_pod(cri, pods, "runc-stats")
    # 20 MiB written into the root land in the upper dir: the writable layer grows.
    cid = await container(
        cri,
        pod,
        rootfs,
        "container-for-stats-1",
        ["sh", "-c", "dd if=/dev/zero of=/blob bs=1M count=20 && echo written && sleep 1000"],
        resources=pb.LinuxContainerResources(memory_limit_in_bytes=256 * 1024 * 1024),
    )
    await wait_for_log(cri, cid, b"written")
    first = (await cri.ContainerStats(pb.ContainerStatsRequest(container_id=cid))).stats
    assert first.attributes.id == cid
    assert first.attributes.metadata.name == "container-for-stats-1"
    assert first.cpu.timestamp > 0 and first.memory.timestamp > 0
    assert first.cpu.usage_core_nano_seconds.value > 0  # dd ran in this cgroup
    assert first.memory.usage_bytes.value > 0
    assert first.memory.available_bytes.value == (
        256 * 1024 * 1024 - first.memory.working_set_bytes.value
    )
    assert first.writable_layer.used_bytes.value >= 20 * 1024 * 1024
    assert first.writable_layer.inodes_used.value >= 1
    await ok(cri, cid, "sh", "-c", "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done")
    second = (await cri.ContainerStats(pb.ContainerStatsRequest(container_id=cid))).stats
    assert second.cpu.usage_core_nano_seconds.value > first.cpu.usage_core_nano_seconds.value
    assert second.cpu.HasField("usage_nano_cores")  # a rate needs two samples

    other = await container(cri, pod, rootfs, "other", ["sleep", "1000"])
    listed = await cri.ListContainerStats(
        pb.ListContainerStatsRequest(filter=pb.ContainerStatsFilter(pod_sandbox_id=pod.id))
    )
    assert {s.attributes.id for s in listed.stats} == {cid, other}
    one = await cri.ListContainerStats(
        pb.ListContainerStatsRequest(filter=pb.ContainerStatsFilter(id=other))
    )
    assert [s.attributes.id for s in one.stats] == [other]

    # UpdateContainerResources reaches the live cgroup and ContainerStatus.
    limit = 128 * 1024 * 1024
    await cri.UpdateContainerResources(
        pb.UpdateContainerResourcesRequest(
            container_id=other,
            linux=pb.LinuxContainerResources(memory_limit_in_bytes=limit, cpu_shares=256),
        )
    )
    assert int(await ok(cri, other, "cat", "/sys/fs/cgroup/memory/memory.limit_in_bytes")) == limit
    assert int(await ok(cri, other, "cat", "/sys/fs/cgroup/cpu/cpu.shares")) == 256
    status = await Pods(cri).status(other)
    assert status.resources.linux.memory_limit_in_bytes == limit
    assert status.resources.linux.cpu_shares == 256
    assert (status.user.linux.uid, status.user.linux.gid) == (0, 0)

    config = await cri.RuntimeConfig(pb.RuntimeConfigRequest())
    assert config.linux.cgroup_driver == pb.CGROUPFS
    runtime_status = await cri.Status(pb.StatusRequest())
    assert "" in [h.name for h in runtime_status.runtime_handlers]
    assert runtime_status.features.supplemental_groups_policy


async def test_reopen_container_log(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, rootfs: str, tmp_path: Path
) -> None:
    log_dir = tmp_path / "logs"
    pod = await run_pod(cri, pods, "runc-reopen", log_directory=str(log_dir))
    cid = await container(
        cri,
        pod,
        rootfs,
        "talker",
        ["sh", "-c", "i=0; while true; do echo line $i; i=$((i+1)); sleep 0.1; done"],
        log_path="talker.log",
    )
    await wait_for_log(cri, cid, b"line 2\n")
    live = log_dir / "talker.log"
    rotated = log_dir / "talker.log.20260101-000000"
    live.rename(rotated)
    await cri.ReopenContainerLog(pb.ReopenContainerLogRequest(container_id=cid))
    assert live.exists()  # the contract: the new file is there when the call returns
    await wait_for_log(cri, cid, b"F line")
    size = rotated.stat().st_size
    await wait_for_log(cri, cid, b"F line", timeout=WAIT_SECONDS)
    new_lines = live.read_bytes()
    await asyncio.sleep(1)
    assert rotated.stat().st_size == size  # the old file stopped growing
    assert b"line" in new_lines
    # Not running: an error, and no file is created.
    await cri.StopContainer(pb.StopContainerRequest(container_id=cid, timeout=0))
    live.unlink()
    err = await rpc_error(cri.ReopenContainerLog(pb.ReopenContainerLogRequest(container_id=cid)))
    assert "container is not running" in (err.details() or "")
    assert not live.exists()


async def test_kubelet_mounts_need_no_destination_in_the_image(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, rootfs: str, tmp_path: Path
) -> None:
    termination = tmp_path / "termination-log"
    termination.write_bytes(b"")
    os.chmod(termination, 0o666)
    token_dir = tmp_path / "serviceaccount"
    token_dir.mkdir()
    (token_dir / "token").write_text("tok")
    pod = await run_pod(cri, pods, "runc-kubelet")
    mounts = [
        pb.Mount(container_path="/dev/termination-log", host_path=str(termination)),
        pb.Mount(
            container_path="/var/run/secrets/kubernetes.io/serviceaccount",
            host_path=str(token_dir),
            readonly=True,
        ),
    ]
    config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name="main"),
        image=pb.ImageSpec(image=rootfs),
        command=["sleep", "1000"],
        mounts=mounts,
        linux=pb.LinuxContainerConfig(security_context=security(seccomp=pb.SecurityProfile())),
    )
    cid = (
        await cri.CreateContainer(
            pb.CreateContainerRequest(
                pod_sandbox_id=pod.id, config=config, sandbox_config=pod.config
            )
        )
    ).container_id
    await cri.StartContainer(pb.StartContainerRequest(container_id=cid))
    await ok(cri, cid, "sh", "-c", "echo finished > /dev/termination-log")
    assert termination.read_text() == "finished\n"
    assert await ok(cri, cid, "cat", "/var/run/secrets/kubernetes.io/serviceaccount/token") == "tok"
    response = await run(cri, cid, "touch", "/var/run/secrets/kubernetes.io/serviceaccount/x")
    assert b"Read-only file system" in response.stderr
    assert not Path(rootfs, "var").exists()  # destinations were made in the upper dir only
    status = await Pods(cri).status(cid)
    assert [(m.container_path, m.host_path, m.readonly) for m in status.mounts] == [
        ("/dev/termination-log", str(termination), False),
        ("/var/run/secrets/kubernetes.io/serviceaccount", str(token_dir), True),
    ]


@pytest.mark.parametrize("mode", ["POD", "CONTAINER", "NODE"])
async def test_pid_namespace_modes(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, rootfs: str, mode: str
) -> None:
    options = pb.NamespaceOption(pid=pb.NamespaceMode.Value(mode))
    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(
            name=f"runc-pid-{mode.lower()}", namespace=POD_NAMESPACE, uid=os.urandom(8).hex()
        ),
        linux=pb.LinuxPodSandboxConfig(
            security_context=pb.LinuxSandboxSecurityContext(namespace_options=options)
        ),
    )
    pod_id = (await cri.RunPodSandbox(pb.RunPodSandboxRequest(config=config))).pod_sandbox_id
    pods.created.append(pod_id)
    pod = Pod(pod_id, config)
    cid = await container(
        cri,
        pod,
        rootfs,
        "main",
        ["sleep", "1000"],
        sec=security(namespace_options=options, seccomp=pb.SecurityProfile()),
    )
    pid1 = await ok(cri, cid, "cat", "/proc/1/cmdline")
    count = len((await ok(cri, cid, "ps", "-o", "pid")).split()) - 1
    if mode == "POD":
        assert "python" in pid1  # the pod holder is PID 1 of the shared namespace
    elif mode == "CONTAINER":
        assert pid1 == "sleep\0001000\0"  # the container's own init
    else:
        assert count > 20  # the node's processes
    if mode != "NODE":
        assert count <= 4


async def test_seccomp_localhost_profile(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, rootfs: str, tmp_path: Path
) -> None:
    profile = tmp_path / "block-chmod.json"
    profile.write_text(
        json.dumps(
            {
                "defaultAction": "SCMP_ACT_ALLOW",
                "syscalls": [{"names": ["chmod", "fchmodat"], "action": "SCMP_ACT_ERRNO"}],
            }
        )
    )
    pod = await run_pod(cri, pods, "runc-localhost")
    localhost = pb.SecurityProfile(
        profile_type=pb.SecurityProfile.Localhost, localhost_ref=str(profile)
    )
    cid = await container(
        cri, pod, rootfs, "main", ["sleep", "1000"], sec=security(seccomp=localhost)
    )
    response = await run(cri, cid, "chmod", "400", "/")
    assert response.exit_code != 0 and b"Operation not permitted" in response.stderr
    # SYS_ADMIN and no filter: sethostname works (in the pod's UTS namespace).
    cid = await container(
        cri,
        pod,
        rootfs,
        "admin",
        ["sleep", "1000"],
        sec=security(
            seccomp=pb.SecurityProfile(profile_type=pb.SecurityProfile.Unconfined),
            capabilities=pb.Capability(add_capabilities=["SYS_ADMIN"]),
        ),
    )
    await ok(cri, cid, "hostname", "ANewHostName")
    missing = pb.SecurityProfile(
        profile_type=pb.SecurityProfile.Localhost, localhost_ref=str(tmp_path / "none.json")
    )
    err = await rpc_error(
        container(cri, pod, rootfs, "bad", ["true"], sec=security(seccomp=missing))
    )
    assert "cannot load seccomp profile" in (err.details() or "")


async def test_pod_sysctls(cri: pb_grpc.RuntimeServiceStub, pods: Pods, rootfs: str) -> None:
    node_msg_max = Path("/proc/sys/fs/mqueue/msg_max").read_text()
    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(
            name="runc-sysctls", namespace=POD_NAMESPACE, uid=os.urandom(8).hex()
        ),
        linux=pb.LinuxPodSandboxConfig(
            sysctls={"kernel.shm_rmid_forced": "1", "fs.mqueue.msg_max": "100"}
        ),
    )
    pod_id = (await cri.RunPodSandbox(pb.RunPodSandboxRequest(config=config))).pod_sandbox_id
    pods.created.append(pod_id)
    cid = await container(cri, Pod(pod_id, config), rootfs, "main", ["sleep", "1000"])
    assert await ok(cri, cid, "cat", "/proc/sys/kernel/shm_rmid_forced") == "1\n"
    assert await ok(cri, cid, "cat", "/proc/sys/fs/mqueue/msg_max") == "100\n"
    # containerd 2.0's defaults for a pod with its own network.
    assert await ok(cri, cid, "cat", "/proc/sys/net/ipv4/ip_unprivileged_port_start") == "0\n"
    assert (await ok(cri, cid, "cat", "/proc/sys/net/ipv4/ping_group_range")).split() == [
        "0",
        "2147483647",
    ]
    assert Path("/proc/sys/fs/mqueue/msg_max").read_text() == node_msg_max  # the node's kept

    bad = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="runc-bad-sysctl", namespace=POD_NAMESPACE, uid="x"),
        linux=pb.LinuxPodSandboxConfig(sysctls={"kernel.panic": "1"}),
    )
    err = await rpc_error(cri.RunPodSandbox(pb.RunPodSandboxRequest(config=bad)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not in a separate kernel namespace" in (err.details() or "")


async def test_devices(cri: pb_grpc.RuntimeServiceStub, pods: Pods, rootfs: str) -> None:
    pod = await run_pod(cri, pods, "runc-devices")
    config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name="main"),
        image=pb.ImageSpec(image=rootfs),
        command=["sleep", "1000"],
        devices=[pb.Device(container_path="/dev/xzero", host_path="/dev/zero", permissions="rw")],
        linux=pb.LinuxContainerConfig(security_context=security(seccomp=pb.SecurityProfile())),
    )
    request = pb.CreateContainerRequest(pod_sandbox_id=pod.id, config=config)
    cid = (await cri.CreateContainer(request)).container_id
    await cri.StartContainer(pb.StartContainerRequest(container_id=cid))
    assert await ok(cri, cid, "sh", "-c", "head -c 4 /dev/xzero | od -An -tx1") == (
        " 00 00 00 00\n"
    )
    # Not allowed by the device cgroup: /dev/kmsg exists on the host, not in the container.
    response = await run(cri, cid, "mknod", "/tmp/kmsg", "c", "1", "11")
    assert response.exit_code == 0  # mknod is allowed (runc's default rule)...
    response = await run(cri, cid, "head", "-c", "1", "/tmp/kmsg")
    assert response.exit_code != 0 and b"Operation not permitted" in response.stderr  # ...not use


async def test_start_error_carries_runc_message(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, rootfs: str, runtime_daemon: RuntimeDaemon
) -> None:
    pod = await run_pod(cri, pods, "runc-start-error")
    cid = await container(cri, pod, rootfs, "missing", ["/no/such/binary"], start=False)
    err = await rpc_error(cri.StartContainer(pb.StartContainerRequest(container_id=cid)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "/no/such/binary" in (err.details() or "")
    assert "no such file or directory" in (err.details() or "")
    status = await Pods(cri).status(cid)
    assert (status.state, status.exit_code, status.reason) == (
        pb.CONTAINER_EXITED,
        128,
        "StartError",
    )
    assert "/no/such/binary" in status.message
    # Nothing is left running in runc for it.
    listed = subprocess.run(
        ["runc", "--root", str(runtime_daemon.state_dir / "runc"), "list", "-q"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert cid not in listed.stdout.split()


async def test_exec_into_a_container_without_a_root_gets_only_stdio(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods
) -> None:
    # Containers without a root (the node's filesystem, its /proc) exec through nsenter: the
    # daemon's descriptors (sockets, epoll, log files...) must not leak into them either. ls
    # lists its own fds there: 0-2 and 3, the directory it is reading.
    pod = await pods.run("legacy-fds")
    cid = await pods.create(pod, "main", ["sleep", "1000"])
    listing = await ok(cri, cid, "ls", "-l", "/proc/self/fd")
    fds = {line.split()[-3]: line.split()[-1] for line in listing.splitlines()[1:]}
    assert sorted(fds) == ["0", "1", "2", "3"], listing
    assert fds["3"].startswith("/proc/") and fds["3"].endswith("/fd"), listing
    request = pb.ExecRequest(
        container_id=cid, cmd=["ls", "-l", "/proc/self/fd"], stdout=True, stderr=True
    )
    stdout, stderr = Sink(), Sink()
    result = await stream((await cri.Exec(request)).url, stdout=stdout, stderr=stderr)
    lines = bytes(stdout.data).decode().splitlines()[1:]
    assert result.exit_code == 0 and sorted(line.split()[-3] for line in lines) == [
        "0",
        "1",
        "2",
        "3",
    ], stdout.data
