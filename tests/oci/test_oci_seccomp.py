"""The shipped RuntimeDefault profile against the reference (§7.2) and profile selection."""

from __future__ import annotations

from typing import Any

import pytest

from podgate.oci import seccomp, spec


def allowed(profile: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    rules: dict[str, list[dict[str, Any]]] = {}
    for rule in profile["syscalls"]:
        for name in rule["names"]:
            rules.setdefault(name, []).append(rule)
    return rules


def test_default_profile_shape() -> None:
    profile = seccomp.runtime_default(spec.DEFAULT_CAPABILITIES, "amd64", "6.1.0")
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"
    assert profile["architectures"] == ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]
    rules = allowed(profile)
    assert len(profile["syscalls"][0]["names"]) == 352  # the always-allowed list
    for name in ("read", "chroot", "ptrace", "arch_prctl", "socket", "personality"):
        assert name in rules, name
    for name in ("mount", "unshare", "setns", "sethostname", "bpf", "io_uring_setup", "reboot"):
        assert name not in rules, name
    (clone,) = rules["clone"]
    assert clone["args"] == [
        {"index": 0, "value": 2114060288, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}
    ]
    (clone3,) = rules["clone3"]
    assert (clone3["action"], clone3["errnoRet"]) == ("SCMP_ACT_ERRNO", 38)
    assert [r["args"][0]["op"] for r in rules["socket"]] == ["SCMP_CMP_NE"]
    assert sorted(r["args"][0]["value"] for r in rules["personality"]) == [
        0,
        8,
        0x20000,
        0x20008,
        0xFFFFFFFF,
    ]


def test_capabilities_open_syscalls() -> None:
    rules = allowed(seccomp.runtime_default(["CAP_SYS_ADMIN", "CAP_SYS_TIME"], "arm64", "6.1"))
    for name in ("mount", "unshare", "setns", "clone3", "settimeofday"):
        assert name in rules, name
    assert all("args" not in r for r in rules["clone"])  # no flag filter with SYS_ADMIN
    assert "arch_prctl" not in rules and "cacheflush" in rules
    old = allowed(seccomp.runtime_default([], "amd64", "4.4.0"))
    assert "ptrace" not in old


@pytest.mark.parametrize(
    ("kind", "ref", "expected"),
    [
        ("", "", ("", "")),
        ("RuntimeDefault", "", ("RuntimeDefault", "")),
        ("runtime/default", "", ("RuntimeDefault", "")),
        ("docker/default", "", ("RuntimeDefault", "")),
        ("unconfined", "", ("Unconfined", "")),
        ("localhost/p.json", "", ("Localhost", "p.json")),
        ("Localhost", "localhost//abs/p.json", ("Localhost", "/abs/p.json")),
    ],
)
def test_select_profile(kind: str, ref: str, expected: tuple[str, str]) -> None:
    assert seccomp.select_profile(kind, ref) == expected


def test_localhost_ref_needs_localhost() -> None:
    with pytest.raises(seccomp.SeccompError, match="LocalhostRef must only be set"):
        seccomp.select_profile("RuntimeDefault", "/p.json")
    with pytest.raises(seccomp.SeccompError, match="cannot load seccomp profile"):
        seccomp.load_localhost("{", "/p.json")
