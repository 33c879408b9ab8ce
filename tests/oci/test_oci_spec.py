"""config.json generation against containerd's rules (the shared docs, reference/
images-and-oci.md §5): process args, env, user, capabilities, mounts, namespaces, cgroups,
privileged semantics, masked/read-only paths."""

from __future__ import annotations

from typing import Any

import pytest

from podgate.model import ContainerSpec, NamespaceMode
from podgate.oci import spec
from podgate.oci.users import Identity

HOST_CAPS = tuple(name for name in spec.CAPABILITY_NUMBERS if name != "CAP_SYS_RESOURCE")
HOST = spec.HostInfo(capabilities=HOST_CAPS, arch="amd64", kernel="6.1.0", swap_controller=True)
POD = spec.PodEnv(
    id="pod1",
    name="web",
    namespace="default",
    uid="u1",
    hostname="web-host",
    ns_pid=4242,
    hostname_file="/state/run/pod1/hostname",
    hosts_file="/state/run/pod1/hosts",
    resolv_file="/state/run/pod1/resolv.conf",
    shm_dir="/state/run/pod1/shm",
)
ROOT = Identity(0, 0, (0,))


def build(cspec: ContainerSpec, image: spec.ImageConfig | None = None, **kw: Any) -> Any:
    pod = kw.pop("pod", POD)
    return spec.build_spec(
        "c1", cspec, image or spec.ImageConfig(), pod, kw.pop("identity", ROOT), HOST, **kw
    )


@pytest.mark.parametrize(
    ("command", "args", "entrypoint", "cmd", "expected"),
    [
        ([], [], ["/ep"], ["c1", "c2"], ["/ep", "c1", "c2"]),
        ([], ["a"], ["/ep"], ["c1"], ["/ep", "a"]),
        (["/x"], ["a"], ["/ep"], ["c1"], ["/x", "a"]),
        (["/x"], [], ["/ep"], ["c1"], ["/x"]),
        ([], [], [""], ["sh"], ["sh"]),  # an empty Entrypoint string counts as none
        ([], [], [], ["sh"], ["sh"]),
        ([], ["top"], [], [], ["top"]),
    ],
)
def test_process_args_follow_containerd(
    command: list[str], args: list[str], entrypoint: list[str], cmd: list[str], expected: list[str]
) -> None:
    assert spec.process_args(command, args, entrypoint, cmd) == expected


def test_no_command_is_an_error() -> None:
    with pytest.raises(spec.SpecError, match="no command specified"):
        spec.process_args([], [], [""], [])


def test_env_order_and_overrides() -> None:
    env = spec.build_env(
        ["PATH=/image/bin", "A=image", "HOSTNAME=img", "DROP=x", "DROP"],
        {"A": "cri", "B": "b"},
        "pod-host",
        True,
    )
    assert env == ["PATH=/image/bin", "TERM=xterm", "HOSTNAME=img", "A=cri", "B=b"]
    assert spec.build_env([], {}, "h", False) == [f"PATH={spec.DEFAULT_PATH}", "HOSTNAME=h"]


def test_default_process() -> None:
    config = build(ContainerSpec(command=["top"], tty=False))
    process = config["process"]
    assert process["args"] == ["top"]
    assert process["cwd"] == "/"
    assert process["user"] == {"uid": 0, "gid": 0, "additionalGids": [0]}
    assert process["noNewPrivileges"] is False
    assert "rlimits" not in process
    caps = process["capabilities"]
    assert caps["bounding"] == list(spec.DEFAULT_CAPABILITIES)
    assert caps["effective"] == caps["permitted"] == caps["bounding"]
    assert "inheritable" not in caps and "ambient" not in caps
    assert spec.caps_mask(spec.DEFAULT_CAPABILITIES) == 0xA80425FB
    assert config["root"] == {"path": "rootfs", "readonly": False}
    assert config["hooks"] == {}


def test_working_dir_from_cri_then_image() -> None:
    image = spec.ImageConfig(cmd=("sh",), working_dir="/app")
    assert build(ContainerSpec(), image)["process"]["cwd"] == "/app"
    assert build(ContainerSpec(working_dir="/w"), image)["process"]["cwd"] == "/w"


@pytest.mark.parametrize(
    ("add", "drop", "expected"),
    [
        (["NET_ADMIN"], [], [*spec.DEFAULT_CAPABILITIES, "CAP_NET_ADMIN"]),
        ([], ["net_raw"], [c for c in spec.DEFAULT_CAPABILITIES if c != "CAP_NET_RAW"]),
        ([], ["ALL"], []),
        (["NET_BIND_SERVICE"], ["ALL"], ["CAP_NET_BIND_SERVICE"]),
        (["ALL"], [], list(HOST_CAPS)),
        (["ALL"], ["CHOWN"], [c for c in HOST_CAPS if c != "CAP_CHOWN"]),
    ],
)
def test_capabilities_add_drop(add: list[str], drop: list[str], expected: list[str]) -> None:
    assert spec.apply_capabilities(add, drop, HOST_CAPS) == expected


def mounts_by_dest(config: Any) -> dict[str, Any]:
    return {m["destination"]: m for m in config["mounts"]}


def test_default_mounts_and_pod_files() -> None:
    config = build(ContainerSpec(command=["top"]))
    mounts = mounts_by_dest(config)
    assert [m["destination"] for m in config["mounts"]] == [
        "/proc",
        "/dev",
        "/dev/pts",
        "/dev/mqueue",
        "/sys",
        "/sys/fs/cgroup",
        "/etc/hostname",
        "/etc/hosts",
        "/etc/resolv.conf",
        "/dev/shm",
    ]
    assert mounts["/proc"]["options"] == ["nosuid", "noexec", "nodev"]
    assert mounts["/sys"]["options"][-1] == "ro"
    assert mounts["/sys/fs/cgroup"]["options"][-1] == "ro"
    assert mounts["/dev/shm"] == {
        "destination": "/dev/shm",
        "type": "bind",
        "source": "/state/run/pod1/shm",
        "options": ["rbind", "rprivate", "rw"],
    }
    assert mounts["/etc/hosts"]["options"] == ["rbind", "rprivate", "rw"]
    ro = mounts_by_dest(build(ContainerSpec(command=["top"], readonly_rootfs=True)))
    assert ro["/etc/resolv.conf"]["options"] == ["rbind", "rprivate", "ro"]
    assert ro["/dev/shm"]["options"][-1] == "rw"


def test_cri_mounts_propagation_and_overrides() -> None:
    cri = [
        {"container_path": "/data/a/b", "host_path": "/h/ab", "readonly": True},
        {
            "container_path": "/data",
            "host_path": "/h/data",
            "propagation": "PROPAGATION_HOST_TO_CONTAINER",
        },
        {"container_path": "/etc/hosts", "host_path": "/kubelet/etc-hosts"},
        {"container_path": "/dev", "host_path": "/h/dev"},
    ]
    config = build(ContainerSpec(command=["top"], mounts=cri))
    mounts = mounts_by_dest(config)
    assert mounts["/data/a/b"]["options"] == ["rbind", "rprivate", "ro"]
    assert mounts["/data"]["options"] == ["rbind", "rslave", "rw"]
    assert mounts["/etc/hosts"]["source"] == "/kubelet/etc-hosts"  # the runtime's is skipped
    # A mount on /dev drops every default /dev mount (and /dev/shm's runtime mount stays).
    assert {"/dev/pts", "/dev/mqueue"}.isdisjoint(mounts)
    assert mounts["/dev"]["type"] == "bind"
    dests = [m["destination"] for m in config["mounts"] if m["type"] == "bind"]
    assert dests.index("/data") < dests.index("/data/a/b")  # sorted by depth
    assert config["linux"]["rootfsPropagation"] == "rslave"
    bidi = [{"container_path": "/x", "host_path": "/h", "propagation": "PROPAGATION_BIDIRECTIONAL"}]
    assert build(ContainerSpec(command=["t"], mounts=bidi))["linux"]["rootfsPropagation"] == (
        "rshared"
    )


@pytest.mark.parametrize(
    ("mount", "message"),
    [
        ({"readonly": False, "recursive_read_only": True}, "conflicts with RW mount"),
        (
            {
                "readonly": True,
                "recursive_read_only": True,
                "propagation": "PROPAGATION_HOST_TO_CONTAINER",
            },
            "needs private propagation",
        ),
        ({"readonly": True, "recursive_read_only": True}, "RROUnsupported"),
    ],
)
def test_recursive_read_only_errors(mount: dict[str, Any], message: str) -> None:
    mounts = [{"container_path": "/m", "host_path": "/h", **mount}]
    with pytest.raises(spec.SpecError, match=message):
        build(ContainerSpec(command=["t"], mounts=mounts))


def test_namespaces_and_cgroups() -> None:
    linux = build(ContainerSpec(command=["t"], pid_mode=NamespaceMode.POD))["linux"]
    assert linux["namespaces"] == [
        {"type": "mount"},
        {"type": "network", "path": "/proc/4242/ns/net"},
        {"type": "uts", "path": "/proc/4242/ns/uts"},
        {"type": "ipc", "path": "/proc/4242/ns/ipc"},
        {"type": "pid", "path": "/proc/4242/ns/pid"},
    ]
    assert linux["cgroupsPath"] == "/podgate/c1"
    own = build(ContainerSpec(command=["t"], pid_mode=NamespaceMode.CONTAINER))["linux"]
    assert {"type": "pid"} in own["namespaces"]
    host_pod = spec.PodEnv(
        **{**_pod_fields(), "pid_mode": NamespaceMode.NODE, "host_network": True, "host_ipc": True}
    )
    host_linux = build(ContainerSpec(command=["t"]), pod=host_pod)["linux"]
    assert host_linux["namespaces"] == [{"type": "mount"}]
    parented = spec.PodEnv(**{**_pod_fields(), "cgroup_parent": "/kubepods/pod-x/"})
    assert build(ContainerSpec(command=["t"]), pod=parented)["linux"]["cgroupsPath"] == (
        "/kubepods/pod-x/c1"
    )


def _pod_fields() -> dict[str, Any]:
    return {name: getattr(POD, name) for name in POD.__dataclass_fields__}


def test_resources() -> None:
    resources = {
        "cpu_shares": 512,
        "cpu_quota": 50000,
        "cpu_period": 100000,
        "memory_limit_in_bytes": 1 << 26,
        "oom_score_adj": 999,
    }
    config = build(ContainerSpec(command=["t"], resources=resources))
    res = config["linux"]["resources"]
    assert res["cpu"] == {"shares": 512, "quota": 50000, "period": 100000}
    assert res["memory"] == {"limit": 1 << 26, "swap": 1 << 26}  # no swap beyond the limit
    assert res["devices"] == [{"allow": False, "access": "rwm"}]
    assert config["process"]["oomScoreAdj"] == 999
    empty = build(ContainerSpec(command=["t"]))["linux"]["resources"]
    assert "cpu" not in empty and "memory" not in empty  # zero values are not written


def test_masked_readonly_paths_and_privileged() -> None:
    cspec = ContainerSpec(
        command=["t"],
        masked_paths=["/proc/kcore"],
        readonly_paths=["/proc/sys"],
        seccomp="RuntimeDefault",
    )
    linux = build(cspec)["linux"]
    assert (linux["maskedPaths"], linux["readonlyPaths"]) == (["/proc/kcore"], ["/proc/sys"])
    assert linux["seccomp"]["defaultAction"] == "SCMP_ACT_ERRNO"
    # containerd clears its defaults for CRI: nothing masked unless asked.
    plain = build(ContainerSpec(command=["t"]))["linux"]
    assert (plain["maskedPaths"], plain["readonlyPaths"]) == ([], [])
    assert "seccomp" not in plain  # unset = no filter
    with pytest.raises(spec.SpecError, match="no privileged container allowed in sandbox"):
        build(ContainerSpec(command=["t"], privileged=True))
    priv_pod = spec.PodEnv(**{**_pod_fields(), "privileged": True})
    cspec = ContainerSpec(
        command=["t"], privileged=True, masked_paths=["/proc/kcore"], seccomp="RuntimeDefault"
    )
    config = build(cspec, pod=priv_pod)
    assert config["process"]["capabilities"]["bounding"] == list(HOST_CAPS)
    assert (config["linux"]["maskedPaths"], config["linux"]["readonlyPaths"]) == ([], [])
    assert "seccomp" not in config["linux"]
    assert config["linux"]["resources"]["devices"] == [{"allow": True, "access": "rwm"}]
    mounts = mounts_by_dest(config)
    assert "ro" not in mounts["/sys"]["options"] and "rw" in mounts["/sys"]["options"]


def test_apparmor_without_host_support() -> None:
    assert (
        "apparmorProfile"
        not in build(ContainerSpec(command=["t"], apparmor="Unconfined"))["process"]
    )
    with pytest.raises(spec.SpecError, match="apparmor is not supported"):
        build(ContainerSpec(command=["t"], apparmor="RuntimeDefault"))


def test_exec_process_keeps_identity() -> None:
    identity = Identity(1000, 1000, (1000, 50000))
    config = build(
        ContainerSpec(command=["t"], no_new_privs=True, envs={"K": "v"}), identity=identity
    )
    process = spec.exec_process(config["process"], ["ls", "-l"], True)
    assert process["args"] == ["ls", "-l"]
    assert process["terminal"] is True
    for key in ("user", "env", "cwd", "capabilities", "noNewPrivileges"):
        assert process[key] == config["process"][key]
    assert "oomScoreAdj" not in process


def test_pod_sysctls() -> None:
    got = spec.pod_sysctls({"kernel.shm_rmid_forced": "1"}, host_network=False, host_ipc=False)
    assert got == {
        "net.ipv4.ip_unprivileged_port_start": "0",
        "net.ipv4.ping_group_range": "0 2147483647",
        "kernel.shm_rmid_forced": "1",
    }
    override = {"net.ipv4.ip_unprivileged_port_start": "1024"}
    assert (
        spec.pod_sysctls(override, host_network=False, host_ipc=False)[
            "net.ipv4.ip_unprivileged_port_start"
        ]
        == "1024"
    )
    assert spec.pod_sysctls({}, host_network=True, host_ipc=False) == {}
    for key, kw, message in (
        ("kernel.panic", {}, "not in a separate kernel namespace"),
        ("net.core.somaxconn", {"host_network": True}, "host network"),
        ("fs.mqueue.msg_max", {"host_ipc": True}, "host's IPC namespace"),
    ):
        flags = {"host_network": False, "host_ipc": False, **kw}
        with pytest.raises(spec.SpecError, match=message):
            spec.pod_sysctls({key: "1"}, **flags)
