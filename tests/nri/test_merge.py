"""Adjustment merging, event masks and PodSandboxStatus aggregation: pure tables.

Expected conflict texts follow upstream's format `plugins %q and %q both tried to set %s`, the
plugin asking now first, %s the field's upstream `api.Field` name, a space and the entry key;
owner keys are upstream's `api.Field` numbers (Env = 6, Args = 7, MemLimit = 8, CPUShares = 16,
OciHooks = 3, Annotations = 1, Mounts = 2, Rlimits = 30).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podgate.nri import api_pb2 as api
from podgate.nri.merge import (
    VALID_EVENTS,
    AdjustmentMerger,
    ConflictError,
    Field,
    NriError,
    UnappliedAdjustmentError,
    UpdateCollector,
    aggregate_pod_ips,
    event_bit,
    event_mask,
    merge_adjustments,
    subscribed,
    unapplied,
)

CONTAINER = api.Container(
    id="ctr1",
    env=["PATH=/bin", "FOO=orig"],
    annotations={"keep": "1"},
    args=["/bin/sleep", "1"],
    mounts=[api.Mount(destination="/data", source="/srv/data", type="bind", options=["rbind"])],
)


def env(**values: str) -> api.ContainerAdjustment:
    return api.ContainerAdjustment(env=[api.KeyValue(key=k, value=v) for k, v in values.items()])


def removal(*names: str) -> list[api.KeyValue]:
    return [api.KeyValue(key="-" + name) for name in names]


def env_of(adjust: api.ContainerAdjustment) -> list[tuple[str, str]]:
    return [(kv.key, kv.value) for kv in adjust.env]


# ----------------------------------------------------------------------------- conflicts


@pytest.mark.parametrize(
    ("first", "second", "message"),
    [
        (
            env(FOO="1"),
            env(FOO="2"),
            'plugins "20-b" and "10-a" both tried to set Env FOO',
        ),
        (
            api.ContainerAdjustment(annotations={"k": "1"}),
            api.ContainerAdjustment(annotations={"k": "2"}),
            'plugins "20-b" and "10-a" both tried to set Annotations k',
        ),
        (
            api.ContainerAdjustment(mounts=[api.Mount(destination="/dst", source="/a")]),
            api.ContainerAdjustment(mounts=[api.Mount(destination="/dst", source="/b")]),
            'plugins "20-b" and "10-a" both tried to set Mounts /dst',
        ),
        (
            api.ContainerAdjustment(args=["/a"]),
            api.ContainerAdjustment(args=["/b"]),
            'plugins "20-b" and "10-a" both tried to set Args ',
        ),
        (
            api.ContainerAdjustment(rlimits=[api.POSIXRlimit(type="RLIMIT_NOFILE", hard=1)]),
            api.ContainerAdjustment(rlimits=[api.POSIXRlimit(type="RLIMIT_NOFILE", hard=2)]),
            'plugins "20-b" and "10-a" both tried to set Rlimits RLIMIT_NOFILE',
        ),
        (
            api.ContainerAdjustment(
                linux=api.LinuxContainerAdjustment(
                    resources=api.LinuxResources(
                        memory=api.LinuxMemory(limit=api.OptionalInt64(value=1 << 20))
                    )
                )
            ),
            api.ContainerAdjustment(
                linux=api.LinuxContainerAdjustment(
                    resources=api.LinuxResources(
                        memory=api.LinuxMemory(limit=api.OptionalInt64(value=2 << 20))
                    )
                )
            ),
            'plugins "20-b" and "10-a" both tried to set MemLimit ',
        ),
        (
            api.ContainerAdjustment(
                linux=api.LinuxContainerAdjustment(
                    resources=api.LinuxResources(cpu=api.LinuxCPU(cpus="0-1"))
                )
            ),
            api.ContainerAdjustment(
                linux=api.LinuxContainerAdjustment(
                    resources=api.LinuxResources(cpu=api.LinuxCPU(cpus="2"))
                )
            ),
            'plugins "20-b" and "10-a" both tried to set CPUSetCPUs ',
        ),
        (
            api.ContainerAdjustment(
                linux=api.LinuxContainerAdjustment(
                    resources=api.LinuxResources(pids=api.LinuxPids(limit=10))
                )
            ),
            api.ContainerAdjustment(
                linux=api.LinuxContainerAdjustment(
                    resources=api.LinuxResources(pids=api.LinuxPids(limit=20))
                )
            ),
            'plugins "20-b" and "10-a" both tried to set PidsLimit ',
        ),
        (
            api.ContainerAdjustment(
                linux=api.LinuxContainerAdjustment(oom_score_adj=api.OptionalInt(value=5))
            ),
            api.ContainerAdjustment(
                linux=api.LinuxContainerAdjustment(oom_score_adj=api.OptionalInt(value=6))
            ),
            'plugins "20-b" and "10-a" both tried to set OomScoreAdj ',
        ),
    ],
)
def test_two_plugins_setting_the_same_thing_conflict(
    first: api.ContainerAdjustment, second: api.ContainerAdjustment, message: str
) -> None:
    with pytest.raises(ConflictError) as info:
        merge_adjustments(CONTAINER, [("10-a", first), ("20-b", second)])
    assert str(info.value) == message
    assert (info.value.plugin, info.value.other) == ("20-b", "10-a")
    assert isinstance(info.value, NriError)


def test_different_keys_merge_and_record_their_owners() -> None:
    first = api.ContainerAdjustment(
        env=[api.KeyValue(key="FOO", value="1")],
        annotations={"x": "1"},
        mounts=[api.Mount(destination="/a", source="/src/a", type="bind")],
        linux=api.LinuxContainerAdjustment(
            resources=api.LinuxResources(
                memory=api.LinuxMemory(limit=api.OptionalInt64(value=1 << 30))
            )
        ),
    )
    second = api.ContainerAdjustment(
        env=[api.KeyValue(key="BAR", value="2")],
        annotations={"y": "2"},
        mounts=[api.Mount(destination="/b", source="/src/b", type="bind")],
        linux=api.LinuxContainerAdjustment(
            resources=api.LinuxResources(cpu=api.LinuxCPU(shares=api.OptionalUInt64(value=512)))
        ),
    )
    result = merge_adjustments(CONTAINER, [("10-a", first), ("20-b", second)])
    assert env_of(result.adjust) == [("FOO", "1"), ("BAR", "2")]
    assert dict(result.adjust.annotations) == {"x": "1", "y": "2"}
    assert [m.destination for m in result.adjust.mounts] == ["/a", "/b"]
    assert result.adjust.linux.resources.memory.limit.value == 1 << 30
    assert result.adjust.linux.resources.cpu.shares.value == 512
    owners = result.owners.owners["ctr1"]
    assert dict(owners.simple) == {8: "10-a", 16: "20-b"}
    assert dict(owners.compound[6].owners) == {"FOO": "10-a", "BAR": "20-b"}
    assert dict(owners.compound[1].owners) == {"x": "10-a", "y": "20-b"}
    assert dict(owners.compound[2].owners) == {"/a": "10-a", "/b": "20-b"}


def test_a_plugin_may_reset_an_entry_it_removed() -> None:
    # 20-b overrides 10-a on purpose: remove, then set, in one reply.
    override = api.ContainerAdjustment(env=[*removal("FOO"), api.KeyValue(key="FOO", value="2")])
    merger = AdjustmentMerger(CONTAINER)
    merger.apply("10-a", env(FOO="1"))
    merger.apply("20-b", override)
    assert env_of(merger.adjustment()) == [("FOO", "2")]
    assert dict(merger.owners().owners["ctr1"].compound[6].owners) == {"FOO": "20-b"}
    # What the next plugin sees: the original FOO replaced, nothing else touched.
    assert list(merger.container.env) == ["PATH=/bin", "FOO=2"]
    # A third plugin setting it conflicts with the one that took it over.
    with pytest.raises(ConflictError) as info:
        merger.apply("30-c", env(FOO="3"))
    assert str(info.value) == ('plugins "30-c" and "20-b" both tried to set Env FOO')


def test_removal_alone_is_recorded_and_owned_by_the_remover() -> None:
    merger = AdjustmentMerger(CONTAINER)
    merger.apply("10-a", env(FOO="1"))
    merger.apply("20-b", api.ContainerAdjustment(env=removal("FOO")))
    assert env_of(merger.adjustment()) == [("-FOO", "")]
    assert dict(merger.owners().owners["ctr1"].compound[6].owners) == {"FOO": "-20-b"}
    assert list(merger.container.env) == ["PATH=/bin"]
    # The remover may set it again later on; anyone else conflicts.
    merger.apply("20-b", env(FOO="back"))
    assert env_of(merger.adjustment()) == [("FOO", "back")]


def test_setting_an_entry_someone_removed_conflicts_with_the_remover() -> None:
    merger = AdjustmentMerger(CONTAINER)
    merger.apply("10-a", api.ContainerAdjustment(annotations={"-keep": ""}))
    with pytest.raises(ConflictError) as info:
        merger.apply("20-b", api.ContainerAdjustment(annotations={"keep": "again"}))
    assert str(info.value) == 'plugins "20-b" and "10-a" both tried to set Annotations keep'


def test_removing_twice_does_not_conflict() -> None:
    result = merge_adjustments(
        CONTAINER,
        [
            ("10-a", api.ContainerAdjustment(env=removal("FOO"))),
            ("20-b", api.ContainerAdjustment(env=removal("FOO"))),
        ],
    )
    assert env_of(result.adjust) == [("-FOO", "")]
    assert dict(result.owners.owners["ctr1"].compound[6].owners) == {"FOO": "-20-b"}


def test_mount_removal_and_replacement() -> None:
    merger = AdjustmentMerger(CONTAINER)
    merger.apply(
        "10-a",
        api.ContainerAdjustment(
            mounts=[
                api.Mount(destination="-/data"),
                api.Mount(destination="/new", source="/srv/new", type="bind"),
            ]
        ),
    )
    adjust = merger.adjustment()
    assert [(m.destination, m.source) for m in adjust.mounts] == [
        ("-/data", ""),
        ("/new", "/srv/new"),
    ]
    assert [m.destination for m in merger.container.mounts] == ["/new"]


def test_hooks_accumulate_without_conflict() -> None:
    first = api.ContainerAdjustment(
        hooks=api.Hooks(prestart=[api.Hook(path="/hooks/one", args=["one"])])
    )
    second = api.ContainerAdjustment(
        hooks=api.Hooks(
            prestart=[api.Hook(path="/hooks/two")], poststop=[api.Hook(path="/hooks/three")]
        )
    )
    result = merge_adjustments(CONTAINER, [("10-a", first), ("20-b", second)])
    assert [h.path for h in result.adjust.hooks.prestart] == ["/hooks/one", "/hooks/two"]
    assert [h.path for h in result.adjust.hooks.poststop] == ["/hooks/three"]
    assert result.owners.owners["ctr1"].simple[3] == "10-a,20-b"


def test_args_marker_lets_a_later_plugin_replace_args() -> None:
    merger = AdjustmentMerger(CONTAINER)
    merger.apply("10-a", api.ContainerAdjustment(args=["/bin/a"]))
    merger.apply("20-b", api.ContainerAdjustment(args=["", "/bin/b", "x"]))
    assert list(merger.adjustment().args) == ["/bin/b", "x"]
    assert merger.owners().owners["ctr1"].simple[7] == "20-b"
    assert list(merger.container.args) == ["/bin/b", "x"]


def test_later_plugins_see_earlier_adjustments_and_the_original_is_untouched() -> None:
    merger = AdjustmentMerger(CONTAINER)
    merger.apply(
        "10-a",
        api.ContainerAdjustment(
            env=[api.KeyValue(key="NEW", value="v")],
            annotations={"-keep": "", "added": "yes"},
            rlimits=[api.POSIXRlimit(type="RLIMIT_NOFILE", hard=4096, soft=1024)],
        ),
    )
    seen = merger.container
    assert list(seen.env) == ["PATH=/bin", "FOO=orig", "NEW=v"]
    assert dict(seen.annotations) == {"added": "yes"}
    assert [(r.type, r.hard, r.soft) for r in seen.rlimits] == [("RLIMIT_NOFILE", 4096, 1024)]
    assert list(CONTAINER.env) == ["PATH=/bin", "FOO=orig"]
    assert dict(CONTAINER.annotations) == {"keep": "1"}


def test_nothing_to_merge_gives_an_empty_adjustment() -> None:
    result = merge_adjustments(CONTAINER, [("10-a", None), ("20-b", api.ContainerAdjustment())])
    assert result.adjust == api.ContainerAdjustment()
    assert dict(result.owners.owners["ctr1"].simple) == {}


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sets(st.sampled_from(["A", "B", "C", "D", "E"]), max_size=3), min_size=1, max_size=5
    )
)
def test_env_conflict_iff_two_plugins_set_one_name(plugin_keys: list[set[str]]) -> None:
    replies = [
        (f"{i:02d}-p", env(**{key: str(i) for key in sorted(keys)}))
        for i, keys in enumerate(plugin_keys)
    ]
    owner: dict[str, str] = {}
    expected_conflict: str | None = None
    for plugin, adjust in replies:
        for kv in adjust.env:
            if kv.key in owner:
                expected_conflict = (
                    f'plugins "{plugin}" and "{owner[kv.key]}" both tried to set Env {kv.key}'
                )
                break
            owner[kv.key] = plugin
        if expected_conflict:
            break
    if expected_conflict:
        with pytest.raises(ConflictError) as info:
            merge_adjustments(CONTAINER, replies)
        assert str(info.value) == expected_conflict
    else:
        result = merge_adjustments(CONTAINER, replies)
        assert {kv.key: kv.value for kv in result.adjust.env} == {
            key: str(int(plugin[:2])) for key, plugin in owner.items()
        }


# ----------------------------------------------------------------------------- event masks


def test_event_bits_follow_the_reference_table() -> None:
    assert event_bit(api.RUN_POD_SANDBOX) == 0x0001
    assert event_bit(api.CREATE_CONTAINER) == 0x0008
    assert event_bit(api.VALIDATE_CONTAINER_ADJUSTMENT) == 0x2000
    assert event_bit(api.POD_SANDBOX_STATUS) == 0x4000
    assert VALID_EVENTS == 0x7FFF


@pytest.mark.parametrize(
    ("events", "mask"),
    [(0, 0x7FFF), (0x0001, 0x0001), (0x4000, 0x4000), (0x7FFF, 0x7FFF), (0x2008, 0x2008)],
)
def test_valid_masks(events: int, mask: int) -> None:
    assert event_mask(events) == mask


@pytest.mark.parametrize(
    ("events", "message"),
    [
        (0x8000, "invalid plugin events: 0x8000"),
        (0x18001, "invalid plugin events: 0x18000"),
        (-1, "invalid plugin events: 0xffff8000"),  # an int32 with every bit set
    ],
)
def test_masks_with_unknown_bits_are_rejected(events: int, message: str) -> None:
    with pytest.raises(NriError) as info:
        event_mask(events)
    assert str(info.value) == message


def test_subscribed() -> None:
    assert subscribed(0x0009, api.CREATE_CONTAINER)
    assert subscribed(0x0009, api.RUN_POD_SANDBOX)
    assert not subscribed(0x0009, api.STOP_POD_SANDBOX)


# ----------------------------------------------------------------------------- PodSandboxStatus


def status(ip: str = "", *additional: str) -> api.PodSandboxStatusResponse:
    return api.PodSandboxStatusResponse(ip=ip, additional_ips=list(additional))


@pytest.mark.parametrize(
    ("replies", "expected"),
    [
        ([], ("", [])),
        ([status(), status()], ("", [])),
        ([status("192.0.2.1")], ("192.0.2.1", [])),
        # The first non-empty ip wins; the later ip and every additional ip follow in order.
        (
            [status("192.0.2.1", "2001:db8::1"), status("192.0.2.2", "2001:db8::2")],
            ("192.0.2.1", ["2001:db8::1", "192.0.2.2", "2001:db8::2"]),
        ),
        # A plugin without an ip still contributes additional ips, in plugin order.
        (
            [status("", "2001:db8::1"), status("192.0.2.2", "192.0.2.3")],
            ("192.0.2.2", ["2001:db8::1", "192.0.2.3"]),
        ),
        # Duplicates are dropped, the first occurrence kept, the primary never repeated.
        (
            [
                status("192.0.2.1", "2001:db8::1", "192.0.2.1"),
                status("192.0.2.1", "2001:db8::1", "192.0.2.9"),
            ],
            ("192.0.2.1", ["2001:db8::1", "192.0.2.9"]),
        ),
        (
            [status("", "192.0.2.5", ""), status("192.0.2.5", "192.0.2.6")],
            ("192.0.2.5", ["192.0.2.6"]),
        ),
    ],
)
def test_pod_ip_aggregation(
    replies: list[api.PodSandboxStatusResponse], expected: tuple[str, list[str]]
) -> None:
    assert aggregate_pod_ips(replies) == expected


# ----------------------------------------------------------------------------- every field


def linux(**fields: object) -> api.ContainerAdjustment:
    return api.ContainerAdjustment(linux=api.LinuxContainerAdjustment(**fields))  # type: ignore[arg-type]


NULL = api.LinuxDevice(path="/dev/nri-null", type="c", major=1, minor=3)
QUOTA = api.LinuxResources(cpu=api.LinuxCPU(quota=api.OptionalInt64(value=5000)))


@pytest.mark.parametrize(
    ("adjust", "subject"),
    [
        (linux(devices=[NULL]), "Devices /dev/nri-null"),
        (
            api.ContainerAdjustment(CDI_devices=[api.CDIDevice(name="v.com/gpu=0")]),
            "CdiDevices v.com/gpu=0",
        ),
        (linux(namespaces=[api.LinuxNamespace(type="network", path="/x")]), "Namespace network"),
        (linux(sysctl={"net.ipv4.ip_forward": "1"}), "Sysctl net.ipv4.ip_forward"),
        (linux(net_devices={"eth1": api.LinuxNetDevice(name="net1")}), "LinuxNetDevices eth1"),
        (linux(scheduler=api.LinuxScheduler(policy=api.SCHED_BATCH)), "LinuxSched "),
        (
            linux(memory_policy=api.LinuxMemoryPolicy(mode=api.MPOL_BIND, nodes="0")),
            "MemoryPolicy ",
        ),
        (linux(io_priority=api.LinuxIOPriority(priority=4)), "IoPriority "),
        (linux(seccomp_policy=api.LinuxSeccomp(default_action="SCMP_ACT_ALLOW")), "SeccompPolicy "),
        (linux(rdt=api.LinuxRdt(clos_id=api.OptionalString(value="gold"))), "RdtClosID "),
        (
            linux(
                resources=api.LinuxResources(
                    hugepage_limits=[api.HugepageLimit(page_size="2MB", limit=1)]
                )
            ),
            "HugepageLimits 2MB",
        ),
        (linux(resources=QUOTA), "CPUQuota "),
        (
            linux(resources=api.LinuxResources(unified={"memory.high": "1"})),
            "CgroupsUnified memory.high",
        ),
    ],
)
def test_every_field_conflicts_in_upstream_words(
    adjust: api.ContainerAdjustment, subject: str
) -> None:
    with pytest.raises(ConflictError) as info:
        merge_adjustments(CONTAINER, [("10-a", adjust), ("20-b", adjust)])
    assert str(info.value) == f'plugins "20-b" and "10-a" both tried to set {subject}'


def test_new_fields_are_merged_with_owners_and_claims() -> None:
    result = merge_adjustments(
        CONTAINER,
        [
            ("10-a", linux(devices=[NULL], sysctl={"kernel.shm_rmid_forced": "1"})),
            ("20-b", api.ContainerAdjustment(CDI_devices=[api.CDIDevice(name="v.com/gpu=0")])),
            (
                "30-c",
                linux(
                    scheduler=api.LinuxScheduler(policy=api.SCHED_IDLE, nice=5),
                    net_devices={"eth1": api.LinuxNetDevice(name="net1")},
                    memory_policy=api.LinuxMemoryPolicy(mode=api.MPOL_INTERLEAVE, nodes="0-1"),
                    rdt=api.LinuxRdt(schemata=api.OptionalRepeatedString(value=["L3:0=f"])),
                ),
            ),
        ],
    )
    adjust = result.adjust
    assert list(adjust.linux.devices) == [NULL]
    assert dict(adjust.linux.sysctl) == {"kernel.shm_rmid_forced": "1"}
    assert [d.name for d in adjust.CDI_devices] == ["v.com/gpu=0"]
    assert adjust.linux.scheduler.nice == 5
    assert adjust.linux.net_devices["eth1"].name == "net1"
    assert adjust.linux.memory_policy.nodes == "0-1"
    assert list(adjust.linux.rdt.schemata.value) == ["L3:0=f"]
    owners = result.owners.owners["ctr1"]
    assert dict(owners.compound[api.Devices].owners) == {"/dev/nri-null": "10-a"}
    assert dict(owners.compound[api.CdiDevices].owners) == {"v.com/gpu=0": "20-b"}
    assert owners.simple[api.LinuxSched] == "30-c"
    assert owners.simple[api.RdtSchemata] == "30-c"
    assert [(c.plugin, c.field.upstream_name, c.key) for c in result.claims] == [
        ("10-a", "Devices", "/dev/nri-null"),
        ("10-a", "Sysctl", "kernel.shm_rmid_forced"),
        ("20-b", "CdiDevices", "v.com/gpu=0"),
        ("30-c", "LinuxSched", ""),
        ("30-c", "MemoryPolicy", ""),
        ("30-c", "LinuxNetDevices", "eth1"),
        ("30-c", "RdtSchemata", ""),
    ]


def test_a_removed_device_may_be_set_again_only_by_its_remover() -> None:
    container = api.Container(id="ctr1", linux=api.LinuxContainer(devices=[NULL]))
    gone = linux(devices=[api.LinuxDevice(path="-/dev/nri-null")])
    result = merge_adjustments(container, [("10-a", gone)])
    assert [d.path for d in result.adjust.linux.devices] == ["-/dev/nri-null"]
    again = linux(devices=[NULL])
    merged = merge_adjustments(container, [("10-a", gone), ("10-a", again)])
    assert list(merged.adjust.linux.devices) == [NULL]
    with pytest.raises(ConflictError, match='"20-b" and "10-a" both tried to set Devices'):
        merge_adjustments(container, [("10-a", gone), ("20-b", again)])


def test_device_cgroup_rules_accumulate_without_an_owner() -> None:
    rule = api.LinuxDeviceCgroup(allow=True, type="c", access="rwm")
    adjust = linux(resources=api.LinuxResources(devices=[rule]))
    result = merge_adjustments(CONTAINER, [("10-a", adjust), ("20-b", adjust)])
    assert list(result.adjust.linux.resources.devices) == [rule, rule]
    assert all(c.field is Field.DEVICE_CGROUP_RULES for c in result.claims)


def test_rdt_removal_clears_the_owners() -> None:
    gold = linux(rdt=api.LinuxRdt(clos_id=api.OptionalString(value="gold")))
    silver = linux(rdt=api.LinuxRdt(clos_id=api.OptionalString(value="silver")))
    replace = linux(rdt=api.LinuxRdt(remove=True, clos_id=api.OptionalString(value="silver")))
    with pytest.raises(ConflictError, match="RdtClosID"):
        merge_adjustments(CONTAINER, [("10-a", gold), ("20-b", silver)])
    # removing first is overriding on purpose (upstream's ClearRdt), by any plugin
    result = merge_adjustments(CONTAINER, [("10-a", gold), ("20-b", replace)])
    assert result.adjust.linux.rdt.remove and result.adjust.linux.rdt.clos_id.value == "silver"
    assert result.owners.owners["ctr1"].simple[api.RdtClosID] == "20-b"


def test_unapplied_names_plugin_and_field() -> None:
    result = merge_adjustments(CONTAINER, [("10-a", env(X="1")), ("20-b", linux(devices=[NULL]))])
    refused = unapplied(result.claims, {Field.ENV})
    assert [(c.plugin, c.field, c.key) for c in refused] == [
        ("20-b", Field.DEVICES, "/dev/nri-null")
    ]
    assert "20-b" in str(UnappliedAdjustmentError(refused))
    assert unapplied(result.claims, {Field.ENV, Field.DEVICES}) == []


def test_update_collector_merges_per_container_and_refuses_the_created_one() -> None:
    collector = UpdateCollector(creating="new")
    collector.add(
        "10-a",
        [
            api.ContainerUpdate(
                container_id="old",
                linux=api.LinuxContainerUpdate(resources=QUOTA),
                ignore_failure=True,
            )
        ],
    )
    limit = api.LinuxResources(memory=api.LinuxMemory(limit=api.OptionalInt64(value=1 << 20)))
    collector.add(
        "20-b",
        [api.ContainerUpdate(container_id="old", linux=api.LinuxContainerUpdate(resources=limit))],
    )
    [update] = collector.updates()
    assert update.container_id == "old" and not update.ignore_failure
    assert update.linux.resources.cpu.quota.value == 5000
    assert update.linux.resources.memory.limit.value == 1 << 20
    with pytest.raises(ConflictError, match='"30-c" and "10-a" both tried to set CPUQuota'):
        collector.add(
            "30-c",
            [
                api.ContainerUpdate(
                    container_id="old", linux=api.LinuxContainerUpdate(resources=QUOTA)
                )
            ],
        )
    with pytest.raises(NriError, match='plugin "30-c" asked update of "new" during creation'):
        collector.add("30-c", [api.ContainerUpdate(container_id="new")])
