"""IP address management for the native network plugin: one address per range and pod.

State is a directory shaped like host-local's: one file per allocated address, named by the
address and holding the pod id, plus `last_reserved_ip.<range>` so a freed address is not
handed out again at once. Every change happens under an exclusive fcntl lock on `lock`, so
several processes may share one state directory. Files are created complete (written aside,
then hard-linked into place), so a crash never leaves an allocation without its owner.

In each range the network address and the gateway (the first host address) are reserved, and
for IPv4 the broadcast address too.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from podgate.files import atomic_write

__all__ = [
    "IpRange",
    "Ipam",
    "IpamError",
    "IpamExhaustedError",
]

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPInterface = ipaddress.IPv4Interface | ipaddress.IPv6Interface
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

LOCK_FILE: Final = "lock"
LAST_RESERVED_PREFIX: Final = "last_reserved_ip."
# Longest prefixes that still leave one pod address after network, gateway (and broadcast).
MAX_PREFIX_V4: Final = 30
MAX_PREFIX_V6: Final = 127
# Pod ids are file contents, not names; this bounds what a corrupt file can make us read.
MAX_OWNER_BYTES: Final = 1024


class IpamError(Exception):
    """The IPAM state or configuration is unusable."""


class IpamExhaustedError(IpamError):
    """A range has no free address left."""


@dataclass(frozen=True, slots=True)
class IpRange:
    network: IPNetwork

    @classmethod
    def parse(cls, text: str | IPNetwork) -> IpRange:
        try:
            network = ipaddress.ip_network(text)
        except ValueError as exc:
            raise IpamError(f"bad range {text!r}: {exc}") from exc
        limit = MAX_PREFIX_V4 if network.version == 4 else MAX_PREFIX_V6
        if network.prefixlen > limit:
            raise IpamError(f"range {network} is too small: use a /{limit} or shorter prefix")
        return cls(network)

    @property
    def gateway(self) -> IPAddress:
        return self.network.network_address + 1

    @property
    def gateway_interface(self) -> IPInterface:
        return ipaddress.ip_interface(f"{self.gateway}/{self.network.prefixlen}")

    @property
    def first(self) -> IPAddress:
        return self.network.network_address + 2

    @property
    def last(self) -> IPAddress:
        last = self.network.broadcast_address
        return last - 1 if self.network.version == 4 else last

    @property
    def size(self) -> int:
        """How many pod addresses the range has."""
        return int(self.last) - int(self.first) + 1

    def interface(self, address: IPAddress) -> IPInterface:
        return ipaddress.ip_interface(f"{address}/{self.network.prefixlen}")

    def __contains__(self, address: object) -> bool:
        if not isinstance(address, ipaddress.IPv4Address | ipaddress.IPv6Address):
            return False
        if address.version != self.network.version:
            return False
        return int(self.first) <= int(address) <= int(self.last)


class Ipam:
    """Allocations of pod addresses from `ranges`, persisted in `state_dir`."""

    def __init__(
        self, ranges: Sequence[str | IPNetwork], state_dir: str | os.PathLike[str]
    ) -> None:
        if not ranges:
            raise IpamError("no address ranges configured")
        self.ranges = [IpRange.parse(r) for r in ranges]
        for index, one in enumerate(self.ranges):
            for other in self.ranges[:index]:
                if one.network.overlaps(other.network):
                    raise IpamError(f"ranges {other.network} and {one.network} overlap")
        self.state_dir = Path(state_dir)

    @property
    def gateways(self) -> list[IPInterface]:
        """The gateway of each range with its prefix length (the bridge's addresses)."""
        return [r.gateway_interface for r in self.ranges]

    # -- public operations (blocking: file locks and fsync) --------------------------------------

    def allocate(self, pod_id: str) -> list[IPInterface]:
        """One address per range for `pod_id`; the same ones again if it already has them."""
        _check_pod_id(pod_id)
        with self._locked():
            owned = self._owned_by(pod_id)
            created: list[Path] = []
            out: list[IPInterface] = []
            try:
                for index, one in enumerate(self.ranges):
                    existing = [a for a in owned if a in one]
                    if existing:
                        out.append(one.interface(existing[0]))
                        continue
                    address = self._pick(index, one, pod_id)
                    created.append(self._claim(address, pod_id))
                    self._write_last_reserved(index, address)
                    out.append(one.interface(address))
            except BaseException:
                for path in created:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                raise
            return out

    def lookup(self, pod_id: str) -> list[IPInterface]:
        """The addresses `pod_id` holds, in range order (no lock: files appear whole)."""
        owned = self._owned_by(pod_id)
        out: list[IPInterface] = []
        for one in self.ranges:
            out += [one.interface(a) for a in owned if a in one][:1]
        return out

    def release(self, pod_id: str) -> list[str]:
        """Free every address `pod_id` holds; returns them (empty if none: idempotent)."""
        with self._locked():
            return self._release(lambda owner: owner == pod_id).get(pod_id, [])

    def allocations(self) -> dict[str, list[str]]:
        """pod id -> its addresses (in range order)."""
        out: dict[str, list[str]] = {}
        for address, owner in sorted(self._scan(), key=lambda item: self._order(item[0])):
            out.setdefault(owner, []).append(str(address))
        return out

    def gc(self, live_pod_ids: Iterable[str]) -> dict[str, list[str]]:
        """Release the addresses of every pod not in `live_pod_ids`; returns what was freed."""
        live = set(live_pod_ids)
        with self._locked():
            freed = self._release(lambda owner: owner not in live)
        return freed

    # -- internals --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing drops the lock

    def _order(self, address: IPAddress) -> tuple[int, int]:
        for index, one in enumerate(self.ranges):
            if address in one:
                return index, int(address)
        return len(self.ranges), int(address)

    def _scan(self) -> Iterator[tuple[IPAddress, str]]:
        """(address, owner) for every allocation file of one of our ranges."""
        try:
            names = os.listdir(self.state_dir)
        except FileNotFoundError:
            return
        for name in names:
            try:
                address = ipaddress.ip_address(name)
            except ValueError:
                continue  # the lock, last_reserved_ip.N, temporary files
            if not any(address in one for one in self.ranges):
                continue
            try:
                with open(self.state_dir / name, "rb") as f:
                    owner = f.read(MAX_OWNER_BYTES).decode("utf-8", "replace").strip()
            except FileNotFoundError:
                continue
            yield address, owner

    def _owned_by(self, pod_id: str) -> list[IPAddress]:
        return sorted((a for a, owner in self._scan() if owner == pod_id), key=self._order)

    def _release(self, doomed: Callable[[str], bool]) -> dict[str, list[str]]:
        freed: dict[str, list[str]] = {}
        for address, owner in sorted(self._scan(), key=lambda item: self._order(item[0])):
            if not doomed(owner):
                continue
            with contextlib.suppress(FileNotFoundError):
                (self.state_dir / str(address)).unlink()
            freed.setdefault(owner, []).append(str(address))
        return freed

    def _read_last_reserved(self, index: int, one: IpRange) -> IPAddress | None:
        try:
            text = (self.state_dir / f"{LAST_RESERVED_PREFIX}{index}").read_text().strip()
            address = ipaddress.ip_address(text)
        except (OSError, ValueError):
            return None
        return address if address in one else None

    def _write_last_reserved(self, index: int, address: IPAddress) -> None:
        _write_whole(self.state_dir / f"{LAST_RESERVED_PREFIX}{index}", str(address), replace=True)

    def _pick(self, index: int, one: IpRange, pod_id: str) -> IPAddress:
        used = {a for a, _ in self._scan() if a in one}
        if len(used) >= one.size:
            raise IpamExhaustedError(
                f"no free address in range {one.network} for pod {pod_id}: "
                f"all {one.size} addresses are allocated"
            )
        last = self._read_last_reserved(index, one)
        offset = 0 if last is None else int(last) - int(one.first) + 1
        # At most len(used) candidates can be taken, so len(used) + 1 steps find a free one.
        for step in range(len(used) + 1):
            candidate = one.first + (offset + step) % one.size
            if candidate not in used:
                return candidate
        raise IpamError(f"range {one.network}: allocation files changed under the lock")

    def _claim(self, address: IPAddress, pod_id: str) -> Path:
        path = self.state_dir / str(address)
        try:
            _write_whole(path, pod_id, replace=False)
        except FileExistsError as exc:
            raise IpamError(f"address {address} was taken outside the lock") from exc
        return path


def _write_whole(path: Path, text: str, *, replace: bool) -> None:
    """Write `text` to `path` so it never exists half-written; without `replace` an existing
    file is kept and FileExistsError raised."""
    atomic_write(path, text.encode("utf-8"), replace=replace)


def _check_pod_id(pod_id: str) -> None:
    if not pod_id or pod_id != pod_id.strip() or "\n" in pod_id:
        raise IpamError(f"invalid pod id {pod_id!r}")
    if len(pod_id.encode()) > MAX_OWNER_BYTES:
        raise IpamError(f"pod id longer than {MAX_OWNER_BYTES} bytes")
