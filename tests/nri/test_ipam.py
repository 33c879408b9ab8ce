"""The native plugin's IPAM: one file per address, under a lock shared between processes."""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podgate.nri.ipam import Ipam, IpamError, IpamExhaustedError, IpRange


def files(state: Path) -> dict[str, str]:
    """Allocation files (named by address) and their contents."""
    out = {}
    for path in state.iterdir():
        try:
            ipaddress.ip_address(path.name)
        except ValueError:
            continue
        out[path.name] = path.read_text()
    return out


def test_first_allocation_skips_network_and_gateway(tmp_path: Path) -> None:
    ipam = Ipam(["10.1.2.0/24", "fd00:1:2::/64"], tmp_path)
    got = ipam.allocate("pod-a")
    assert got == [
        ipaddress.ip_interface("10.1.2.2/24"),
        ipaddress.ip_interface("fd00:1:2::2/64"),
    ]
    assert ipam.gateways == [
        ipaddress.ip_interface("10.1.2.1/24"),
        ipaddress.ip_interface("fd00:1:2::1/64"),
    ]
    assert files(tmp_path) == {"10.1.2.2": "pod-a", "fd00:1:2::2": "pod-a"}


def test_allocate_is_idempotent_per_pod(tmp_path: Path) -> None:
    ipam = Ipam(["10.1.2.0/24"], tmp_path)
    first = ipam.allocate("pod-a")
    assert ipam.allocate("pod-a") == first
    assert ipam.allocate("pod-b") == [ipaddress.ip_interface("10.1.2.3/24")]
    # A new object on the same state sees the same allocations.
    again = Ipam(["10.1.2.0/24"], tmp_path)
    assert again.allocate("pod-a") == first
    assert again.allocations() == {"pod-a": ["10.1.2.2"], "pod-b": ["10.1.2.3"]}
    assert again.lookup("pod-b") == [ipaddress.ip_interface("10.1.2.3/24")]
    assert again.lookup("pod-c") == []


def test_a_released_address_is_not_reused_at_once(tmp_path: Path) -> None:
    ipam = Ipam(["10.1.2.0/24"], tmp_path)
    ipam.allocate("a")  # .2
    ipam.allocate("b")  # .3
    assert ipam.release("a") == ["10.1.2.2"]
    assert ipam.allocate("c") == [ipaddress.ip_interface("10.1.2.4/24")]


def test_release_is_idempotent(tmp_path: Path) -> None:
    ipam = Ipam(["10.1.2.0/24", "fd00::/64"], tmp_path)
    ipam.allocate("a")
    assert ipam.release("a") == ["10.1.2.2", "fd00::2"]
    assert ipam.release("a") == []
    assert ipam.release("never") == []
    assert files(tmp_path) == {}


def test_exhaustion_error_and_wraparound(tmp_path: Path) -> None:
    # /29: .0 network, .1 gateway, .7 broadcast: .2-.6 are the five pod addresses.
    ipam = Ipam(["10.9.9.0/29"], tmp_path)
    got = [str(ipam.allocate(f"p{n}")[0].ip) for n in range(5)]
    assert got == ["10.9.9.2", "10.9.9.3", "10.9.9.4", "10.9.9.5", "10.9.9.6"]
    with pytest.raises(IpamExhaustedError) as info:
        ipam.allocate("p5")
    assert str(info.value) == (
        "no free address in range 10.9.9.0/29 for pod p5: all 5 addresses are allocated"
    )
    ipam.release("p2")  # frees .4; the search wraps around from .6
    assert ipam.allocate("p5") == [ipaddress.ip_interface("10.9.9.4/29")]


def test_a_full_second_range_rolls_back_the_first(tmp_path: Path) -> None:
    ipam = Ipam(["10.9.8.0/24", "fd00:9::/127"], tmp_path)
    # fd00:9::/127 has ::0 (network) and ::1 (gateway): no pod address at all.
    with pytest.raises(IpamExhaustedError, match="range fd00:9::/127"):
        ipam.allocate("p")
    assert files(tmp_path) == {}


def test_gc_keeps_only_live_pods(tmp_path: Path) -> None:
    ipam = Ipam(["10.3.0.0/24", "fd00:3::/64"], tmp_path)
    for pod in ("a", "b", "c"):
        ipam.allocate(pod)
    freed = ipam.gc(["b"])
    assert freed == {"a": ["10.3.0.2", "fd00:3::2"], "c": ["10.3.0.4", "fd00:3::4"]}
    assert ipam.allocations() == {"b": ["10.3.0.3", "fd00:3::3"]}
    assert ipam.gc(["b"]) == {}


def test_files_of_other_ranges_and_strangers_are_left_alone(tmp_path: Path) -> None:
    (tmp_path / "192.168.7.9").write_text("someone-else")
    (tmp_path / "notes.txt").write_text("x")
    ipam = Ipam(["10.3.0.0/24"], tmp_path)
    ipam.allocate("a")
    assert ipam.gc([]) == {"a": ["10.3.0.2"]}
    assert (tmp_path / "192.168.7.9").read_text() == "someone-else"
    assert (tmp_path / "notes.txt").exists()


@pytest.mark.parametrize(
    ("ranges", "message"),
    [
        ([], "no address ranges configured"),
        (["10.0.0.0/31"], "range 10.0.0.0/31 is too small: use a /30 or shorter prefix"),
        (["10.0.0.0/24", "10.0.0.128/25"], "ranges 10.0.0.0/24 and 10.0.0.128/25 overlap"),
        (["10.0.0.1/24"], "bad range '10.0.0.1/24': 10.0.0.1/24 has host bits set"),
    ],
)
def test_bad_ranges(tmp_path: Path, ranges: list[str], message: str) -> None:
    with pytest.raises(IpamError) as info:
        Ipam(ranges, tmp_path)
    assert str(info.value) == message


@pytest.mark.parametrize("pod_id", ["", " padded", "two\nlines"])
def test_bad_pod_ids(tmp_path: Path, pod_id: str) -> None:
    with pytest.raises(IpamError, match="invalid pod id"):
        Ipam(["10.0.0.0/24"], tmp_path).allocate(pod_id)


@settings(max_examples=50, deadline=None)
@given(prefix=st.integers(min_value=24, max_value=30), count=st.integers(min_value=1, max_value=70))
def test_allocations_stay_inside_the_pod_range(
    prefix: int, count: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    state = tmp_path_factory.mktemp("ipam")
    network = ipaddress.ip_network(f"10.77.0.0/{prefix}")
    capacity = network.num_addresses - 3  # network, gateway, broadcast
    ipam = Ipam([str(network)], state)
    seen = set()
    for n in range(min(count, capacity)):
        (address,) = ipam.allocate(f"pod{n}")
        assert address.network == network
        assert network.network_address + 2 <= address.ip <= network.broadcast_address - 1
        seen.add(address.ip)
    assert len(seen) == min(count, capacity)
    if count > capacity:
        with pytest.raises(IpamExhaustedError):
            ipam.allocate("one-more")


def test_range_sizes() -> None:
    assert IpRange.parse("10.0.0.0/30").size == 1
    assert IpRange.parse("10.0.0.0/24").size == 253
    assert IpRange.parse("fd00::/126").size == 2
    assert IpRange.parse("fd00::/64").size == 2**64 - 2


_WORKER = r"""
import json, os, sys, time
from podgate.nri.ipam import Ipam
state, tag, count, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
deadline = time.monotonic() + 30
while not os.path.exists(go):  # start together
    assert time.monotonic() < deadline
    time.sleep(0.005)
ipam = Ipam(["10.50.0.0/24", "fd00:50::/120"], state)
out = {}
for n in range(count):
    out[f"{tag}-{n}"] = [str(a) for a in ipam.allocate(f"{tag}-{n}")]
print(json.dumps(out))
"""


def test_two_processes_get_distinct_addresses(tmp_path: Path) -> None:
    count = 100
    state_dir, go = tmp_path / "state", tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(state_dir), tag, str(count), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for tag in ("left", "right")
    ]
    time.sleep(0.5)  # both interpreters up and polling
    go.touch()
    results: dict[str, list[str]] = {}
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err.decode()
        results.update(json.loads(out))
    assert len(results) == 2 * count
    v4 = [ips[0] for ips in results.values()]
    v6 = [ips[1] for ips in results.values()]
    assert len(set(v4)) == 2 * count
    assert len(set(v6)) == 2 * count
    assert {str(ipaddress.ip_interface(a).network) for a in v4} == {"10.50.0.0/24"}
    assert {str(ipaddress.ip_interface(a).network) for a in v6} == {"fd00:50::/120"}
    # What the files say matches what each process was told.
    state = Ipam(["10.50.0.0/24", "fd00:50::/120"], state_dir).allocations()
    assert state == {pod: [a.split("/")[0] for a in ips] for pod, ips in results.items()}
