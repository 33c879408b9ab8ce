"""podgate.oci.adjust: an NRI adjustment (as podgate.nri.convert makes it from the message)
applied to a config.json, and what a host refuses. Table tests over the pure functions."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from podgate.nri import api_pb2 as api
from podgate.nri.adjust import Adjustment
from podgate.nri.convert import oci_adjustment
from podgate.oci.adjust import AdjustError, HostSupport, Refusal, apply, check

V1 = HostSupport(
    controllers=frozenset({"cpu", "cpuset", "memory", "pids", "devices"}),
    cgroup_files=frozenset({"memory/memory.memsw.limit_in_bytes", "memory/memory.swappiness"}),
    runtime="runc 1.1.5",
    namespaces=frozenset({"cgroup", "ipc", "mount", "network", "pid", "user", "uts"}),
    seccomp_actions=frozenset({"SCMP_ACT_ALLOW", "SCMP_ACT_ERRNO"}),
)


def base() -> dict[str, Any]:
    return {
        "process": {
            "args": ["sh"],
            "env": ["PATH=/bin", "A=1", "B=2"],
            "oomScoreAdj": 0,
            "user": {"uid": 0, "gid": 0, "additionalGids": []},
        },
        "mounts": [],
        "hooks": {},
        "linux": {
            "cgroupsPath": "/podgate/p/c",
            "namespaces": [{"type": "mount"}, {"type": "pid"}],
            "devices": [],
            "resources": {"devices": [{"allow": False, "access": "rwm"}]},
        },
    }


def adjusted(message: api.ContainerAdjustment) -> dict[str, Any]:
    config = base()
    apply(config, oci_adjustment(message))
    return config


def linux(**fields: Any) -> api.ContainerAdjustment:
    return api.ContainerAdjustment(linux=api.LinuxContainerAdjustment(**fields))


CASES: list[tuple[str, api.ContainerAdjustment, str, Any]] = [
    (
        "env changed in place, removed, appended",
        api.ContainerAdjustment(
            env=[
                api.KeyValue(key="A", value="x"),
                api.KeyValue(key="-B"),
                api.KeyValue(key="C", value="3"),
            ]
        ),
        "process.env",
        ["PATH=/bin", "A=x", "C=3"],
    ),
    ("args replace", api.ContainerAdjustment(args=["", "top"]), "process.args", ["top"]),
    (
        "hooks by kind",
        Adjustment()
        .add_hook("prestart", "/bin/a", ["a"])
        .add_hook("create_runtime", "/bin/b")
        .message,
        "hooks",
        {"prestart": [{"path": "/bin/a", "args": ["a"]}], "createRuntime": [{"path": "/bin/b"}]},
    ),
    (
        "device node",
        linux(devices=[api.LinuxDevice(path="/dev/x", type="c", major=1, minor=3)]),
        "linux.devices",
        [{"path": "/dev/x", "type": "c", "major": 1, "minor": 3}],
    ),
    (
        "device cgroup rule for the node (block devices get mknod)",
        linux(devices=[api.LinuxDevice(path="/dev/b", type="b", major=7, minor=0)]),
        "linux.resources.devices",
        [
            {"allow": False, "access": "rwm"},
            {"allow": True, "type": "b", "major": 7, "minor": 0, "access": "rwm"},
        ],
    ),
    (
        "device cgroup rules",
        linux(
            resources=api.LinuxResources(
                devices=[
                    api.LinuxDeviceCgroup(
                        allow=True, type="c", major=api.OptionalInt64(value=10), access="r"
                    )
                ]
            )
        ),
        "linux.resources.devices",
        [
            {"allow": False, "access": "rwm"},
            {"allow": True, "access": "r", "type": "c", "major": 10},
        ],
    ),
    (
        "rlimits",
        api.ContainerAdjustment(rlimits=[api.POSIXRlimit(type="RLIMIT_NOFILE", hard=9, soft=8)]),
        "process.rlimits",
        [{"type": "RLIMIT_NOFILE", "hard": 9, "soft": 8}],
    ),
    (
        "memory limit caps swap too",
        Adjustment().set_memory_limit(1 << 26).message,
        "linux.resources.memory",
        {"limit": 1 << 26, "swap": 1 << 26},
    ),
    (
        "cpu",
        linux(
            resources=api.LinuxResources(
                cpu=api.LinuxCPU(
                    shares=api.OptionalUInt64(value=512),
                    quota=api.OptionalInt64(value=20000),
                    period=api.OptionalUInt64(value=100000),
                    cpus="0",
                )
            )
        ),
        "linux.resources.cpu",
        {"shares": 512, "quota": 20000, "period": 100000, "cpus": "0"},
    ),
    (
        "pids",
        linux(resources=api.LinuxResources(pids=api.LinuxPids(limit=64))),
        "linux.resources.pids",
        {"limit": 64},
    ),
    (
        "a non-bind mount, sorted by depth",
        Adjustment()
        .add_mount("/a/b", "tmpfs", "tmpfs", ["nosuid"])
        .add_mount("/c", "", "bind")
        .message,
        "mounts",
        [{"destination": "/a/b", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid"]}],
    ),
    ("oom score adj", linux(oom_score_adj=api.OptionalInt(value=500)), "process.oomScoreAdj", 500),
    ("cgroups path", linux(cgroups_path="/elsewhere/c"), "linux.cgroupsPath", "/elsewhere/c"),
    (
        "namespaces: replace and remove",
        linux(
            namespaces=[
                api.LinuxNamespace(type="pid", path="/proc/1/ns/pid"),
                api.LinuxNamespace(type="-mount"),
            ]
        ),
        "linux.namespaces",
        [{"type": "pid", "path": "/proc/1/ns/pid"}],
    ),
    (
        "sysctls",
        linux(sysctl={"net.ipv4.ip_forward": "1"}),
        "linux.sysctl",
        {"net.ipv4.ip_forward": "1"},
    ),
    (
        "seccomp policy",
        linux(
            seccomp_policy=api.LinuxSeccomp(
                default_action="SCMP_ACT_ALLOW",
                syscalls=[api.LinuxSyscall(names=["mkdir"], action="SCMP_ACT_ERRNO")],
            )
        ),
        "linux.seccomp",
        {
            "defaultAction": "SCMP_ACT_ALLOW",
            "syscalls": [{"names": ["mkdir"], "action": "SCMP_ACT_ERRNO"}],
        },
    ),
]


def lookup(config: dict[str, Any], path: str) -> Any:
    value: Any = config
    for part in path.split("."):
        value = value[part]
    return value


@pytest.mark.parametrize(("what", "message", "path", "expected"), CASES, ids=[c[0] for c in CASES])
def test_applied(what: str, message: api.ContainerAdjustment, path: str, expected: Any) -> None:
    assert lookup(adjusted(message), path) == expected


def test_nothing_else_changes() -> None:
    before = base()
    config = copy.deepcopy(before)
    apply(config, oci_adjustment(api.ContainerAdjustment()))
    assert config["process"] == before["process"]
    assert config["linux"]["devices"] == before["linux"]["devices"]


def test_cdi_edits() -> None:
    config = base()
    edits = {
        "env": ["VENDOR=1"],
        "deviceNodes": [{"path": "/dev/v0", "type": "c", "major": 1, "minor": 5}],
        "mounts": [{"hostPath": "/opt/v", "containerPath": "/v", "options": ["ro", "bind"]}],
        "hooks": [{"hookName": "createContainer", "path": "/bin/v-hook"}],
        "additionalGids": [44],
    }
    apply(config, {"cdiEdits": [edits]})
    assert config["process"]["env"][-1] == "VENDOR=1"
    assert config["linux"]["devices"] == [{"path": "/dev/v0", "type": "c", "major": 1, "minor": 5}]
    assert config["linux"]["resources"]["devices"][-1]["access"] == "rwm"
    assert config["mounts"] == [
        {"destination": "/v", "type": "bind", "source": "/opt/v", "options": ["ro", "bind"]}
    ]
    assert config["hooks"]["createContainer"] == [{"path": "/bin/v-hook"}]
    assert config["process"]["user"]["additionalGids"] == [44]
    with pytest.raises(AdjustError, match="unknown CDI hook name"):
        apply(base(), {"cdiEdits": [{"hooks": [{"hookName": "later", "path": "/x"}]}]})


REFUSED: list[tuple[str, api.ContainerAdjustment, Refusal]] = [
    (
        "hugepages without hugetlb",
        linux(
            resources=api.LinuxResources(
                hugepage_limits=[api.HugepageLimit(page_size="2MB", limit=1 << 21)]
            )
        ),
        Refusal("HugepageLimits", "2MB", "no hugetlb cgroup controller here"),
    ),
    (
        "unified on cgroup v1",
        linux(resources=api.LinuxResources(unified={"memory.high": "1"})),
        Refusal("CgroupsUnified", "memory.high", "the host runs cgroup v1 (unified needs v2)"),
    ),
    (
        "I/O priority on runc 1.1",
        linux(io_priority=api.LinuxIOPriority(priority=4)),
        Refusal("IoPriority", "", "runc 1.1.5 does not support process.ioPriority"),
    ),
    (
        "scheduler on runc 1.1",
        linux(scheduler=api.LinuxScheduler(policy=api.SCHED_BATCH)),
        Refusal("LinuxSched", "", "runc 1.1.5 does not support process.scheduler"),
    ),
    (
        "memory policy on runc 1.1",
        linux(memory_policy=api.LinuxMemoryPolicy(mode=api.MPOL_BIND, nodes="0")),
        Refusal("MemoryPolicy", "", "runc 1.1.5 does not support linux.memoryPolicy"),
    ),
    (
        "block I/O class not configured",
        linux(resources=api.LinuxResources(blockio_class=api.OptionalString(value="slow"))),
        Refusal(
            "BlockioClass", "slow", "no block I/O class of that name is configured on this node"
        ),
    ),
    (
        "RDT class without resctrl",
        linux(resources=api.LinuxResources(rdt_class=api.OptionalString(value="gold"))),
        Refusal("RdtClass", "gold", "the host has no resctrl filesystem (Intel RDT)"),
    ),
    (
        "kernel memory limit",
        linux(
            resources=api.LinuxResources(
                memory=api.LinuxMemory(kernel=api.OptionalInt64(value=1 << 20))
            )
        ),
        Refusal("MemKernelLimit", "", "runc 1.1.5 ignores it (deprecated by the kernel)"),
    ),
    (
        "real-time CPU without the kernel's RT group scheduling",
        linux(
            resources=api.LinuxResources(
                cpu=api.LinuxCPU(realtime_runtime=api.OptionalInt64(value=1000))
            )
        ),
        Refusal("CPURealtimeRuntime", "", "the kernel has no real-time group scheduling"),
    ),
    (
        "a time namespace on runc 1.1",
        linux(namespaces=[api.LinuxNamespace(type="time")]),
        Refusal("Namespace", "time", "runc 1.1.5 does not support it"),
    ),
    (
        "a sysctl outside the container's namespaces",
        linux(sysctl={"vm.swappiness": "1"}),
        Refusal("Sysctl", "vm.swappiness", "not in a separate kernel namespace"),
    ),
    (
        "a seccomp action runc does not know",
        linux(seccomp_policy=api.LinuxSeccomp(default_action="SCMP_ACT_KILL_EVERYTHING")),
        Refusal("SeccompPolicy", "SCMP_ACT_KILL_EVERYTHING", "runc 1.1.5 does not know it"),
    ),
    (
        "network devices on runc 1.1",
        linux(net_devices={"eth1": api.LinuxNetDevice(name="net1")}),
        Refusal("LinuxNetDevices", "eth1", "runc 1.1.5 does not support linux.netDevices"),
    ),
]


@pytest.mark.parametrize(("what", "message", "refusal"), REFUSED, ids=[c[0] for c in REFUSED])
def test_refused(what: str, message: api.ContainerAdjustment, refusal: Refusal) -> None:
    assert check(oci_adjustment(message), V1) == [refusal]


def test_supported_knobs_pass_the_check() -> None:
    message = Adjustment().set_memory_limit(1 << 26).message
    message.linux.resources.memory.swappiness.value = 10
    message.linux.resources.pids.limit = 10
    assert check(oci_adjustment(message), V1) == []
    # … and not where the knob's file is missing
    message.linux.resources.memory.disable_oom_killer.value = True
    [refusal] = check(oci_adjustment(message), V1)
    assert refusal.field == "MemDisableOomKiller"


def test_v2_host_takes_unified_and_hugepages() -> None:
    v2 = HostSupport(cgroup_v2=True, controllers=frozenset({"memory", "hugetlb", "pids"}))
    message = linux(
        resources=api.LinuxResources(
            unified={"memory.high": "1"},
            hugepage_limits=[api.HugepageLimit(page_size="2MB", limit=1 << 21)],
        )
    )
    assert check(oci_adjustment(message), v2) == []
    config = adjusted(message)
    assert config["linux"]["resources"]["unified"] == {"memory.high": "1"}
    assert config["linux"]["resources"]["hugepageLimits"] == [{"pageSize": "2MB", "limit": 1 << 21}]
