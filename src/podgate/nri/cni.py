"""CNI invocation: run the real CNI plugin binaries for a pod, as containerd's go-cni does.

A network config list (conflist) names a chain of plugins. ADD runs them in order, each getting
the previous plugin's result as `prevResult`; DEL runs them in reverse with the stored ADD result.
Each plugin is an executable found by its `type` in the plugin directories, run in the host
netns with the CNI_* environment and one JSON plugin config on stdin. Errors come back as
`{"code", "msg", "details"}` JSON with a non-zero exit; real plugins print it on stdout.

The loopback interface is a separate network ("cni-loopback", plugin `loopback`, ifname "lo")
set up before the main network, as containerd does unless `use_internal_loopback` is set.

Results are stored per container id under the state dir (written atomically, and written
before ADD starts so a crash mid-ADD still leaves a record for DEL), so DEL gets its
`prevResult` and the pod's IPs can be reported again after a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import ipaddress
import json
import logging
import os
import re
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any, Final

from podgate.linux.proc import atomic_write_json, read_json

__all__ = [
    "DEFAULT_PLUGIN_DIRS",
    "LOOPBACK_NETWORK",
    "PLUGIN_TIMEOUT",
    "Cni",
    "CniCode",
    "CniConfig",
    "CniConfigError",
    "CniError",
    "CniInterface",
    "CniIp",
    "CniResult",
    "default_conflist",
    "split_primary",
]

log = logging.getLogger(__name__)

# Debian's containernetworking-plugins install here, not in /opt/cni/bin.
DEFAULT_PLUGIN_DIRS: Final = ("/usr/lib/cni",)
# containerd's in-sandbox interface name.
DEFAULT_IFNAME: Final = "eth0"
# The loopback network containerd adds in front of the configured one.
LOOPBACK_NETWORK: Final = "cni-loopback"
LOOPBACK_IFNAME: Final = "lo"
# One plugin call, seconds: host-local and iptables take file locks other pods may hold.
PLUGIN_TIMEOUT: Final = 30.0
# How long a killed plugin gets to be reaped, seconds.
KILL_WAIT: Final = 5.0
# Bytes of a failing plugin's stderr quoted in an error: the last lines of a Go panic.
STDERR_TAIL_BYTES: Final = 2048
# Search path for tools the plugins run (iptables for portmap and ipMasq).
PLUGIN_SEARCH_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Result format 0.3.0+ has `interfaces` and per-IP `interface` indexes; older ones do not.
OLDEST_CNI_VERSION: Final = (0, 3, 0)
# CHECK exists from spec 0.4.0 on; so does `prevResult` on DEL.
CHECK_CNI_VERSION: Final = (0, 4, 0)
# The spec's container id: alphanumeric first, then [A-Za-z0-9_.-]; also safe as a file name.
_CONTAINER_ID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")
# Record layout version of the stored results.
_RECORD_VERSION: Final = 1


class CniCode(IntEnum):
    """Well-known error codes of the CNI spec; plugins use 100+ (Debian's build: 999)."""

    INCOMPATIBLE_VERSION = 1
    UNSUPPORTED_FIELD = 2
    UNKNOWN_CONTAINER = 3
    INVALID_ENVIRONMENT = 4
    IO_FAILURE = 5
    DECODE_FAILURE = 6
    INVALID_NETWORK_CONFIG = 7
    TRY_AGAIN_LATER = 11


# Code of failures that no plugin reported: it could not be found or run, timed out, or
# printed something that is not a CNI answer.
NO_PLUGIN_CODE: Final = 0


class CniError(Exception):
    """A CNI plugin failed; `code` and `msg` are the plugin's own (0: it gave none)."""

    def __init__(
        self,
        code: int,
        msg: str,
        details: str = "",
        *,
        plugin: str = "",
        command: str = "",
    ) -> None:
        self.code = code
        self.msg = msg
        self.details = details
        self.plugin = plugin
        self.command = command
        where = f"plugin type={plugin!r} {command}: " if plugin else ""
        text = f"{where}{msg}" + (f" ({details})" if details else "")
        super().__init__(text + (f" [code {code}]" if code else ""))


class CniConfigError(ValueError):
    """The network config list itself is unusable (before any plugin runs)."""


def plugin_name_error(plugin_type: str) -> str | None:
    """Why `plugin_type` cannot name a plugin binary, or None. As libcni's FindInPath: a type
    is a file name looked up in the plugin directories, never a path (`../x` would run any
    binary on the host)."""
    if not plugin_type:
        return "empty plugin type"
    if "/" in plugin_type or os.sep in plugin_type or plugin_type in (".", ".."):
        return f"invalid plugin name {plugin_type!r}: a plugin type is a file name, not a path"
    if "\0" in plugin_type:
        return f"invalid plugin name {plugin_type!r}: contains NUL"
    return None


def _version_tuple(version: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in version.split("."))
    except ValueError:
        return ()


@dataclass(frozen=True, slots=True)
class CniConfig:
    """A network config list: `name`, `cniVersion` and the plugin chain."""

    name: str
    cni_version: str
    plugins: tuple[Mapping[str, Any], ...]
    disable_check: bool = False

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> CniConfig:
        if not isinstance(obj, Mapping):
            raise CniConfigError("network config must be a JSON object")
        if "plugins" not in obj and "type" in obj:
            # A single-plugin .conf, taken as a list of one (libcni's ConfListFromConf).
            plugin = {k: v for k, v in obj.items() if k not in ("cniVersion", "name")}
            obj = {
                "name": obj.get("name"),
                "cniVersion": obj.get("cniVersion"),
                "plugins": [plugin],
            }
        name = obj.get("name")
        version = obj.get("cniVersion")
        plugins = obj.get("plugins")
        if not isinstance(name, str) or not name:
            raise CniConfigError("network config list has no name")
        if not isinstance(version, str) or not version:
            raise CniConfigError(f"network {name!r}: cniVersion is missing")
        parsed = _version_tuple(version)
        if parsed and parsed < OLDEST_CNI_VERSION:
            raise CniConfigError(
                f"network {name!r}: cniVersion {version} results carry no interface indexes; "
                "use 0.3.0 or later"
            )
        if not isinstance(plugins, list) or not plugins:
            raise CniConfigError(f"network {name!r}: plugins must be a non-empty list")
        for index, plugin in enumerate(plugins):
            if not isinstance(plugin, dict) or not isinstance(plugin.get("type"), str):
                raise CniConfigError(f"network {name!r}: plugin {index} has no type")
            if (why := plugin_name_error(plugin["type"])) is not None:
                raise CniConfigError(f"network {name!r}: plugin {index}: {why}")
        return cls(
            name=name,
            cni_version=version,
            plugins=tuple(copy.deepcopy(plugins)),
            disable_check=bool(obj.get("disableCheck", False)),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> CniConfig:
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise CniConfigError(f"network config is not JSON: {exc}") from exc
        return cls.from_dict(obj)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> CniConfig:
        try:
            text = Path(path).read_bytes()
        except OSError as exc:
            raise CniConfigError(f"read {os.fspath(path)}: {exc.strerror}") from exc
        return cls.from_json(text)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "cniVersion": self.cni_version,
            "name": self.name,
            "plugins": copy.deepcopy(list(self.plugins)),
        }
        if self.disable_check:
            out["disableCheck"] = True
        return out

    @property
    def plugin_types(self) -> list[str]:
        return [str(p["type"]) for p in self.plugins]


@dataclass(frozen=True, slots=True)
class CniInterface:
    name: str
    mac: str = ""
    sandbox: str = ""


@dataclass(frozen=True, slots=True)
class CniIp:
    address: ipaddress.IPv4Interface | ipaddress.IPv6Interface
    gateway: ipaddress.IPv4Address | ipaddress.IPv6Address | None = None
    interface: int | None = None


@dataclass(frozen=True, slots=True)
class CniResult:
    """A plugin's ADD result (spec 0.3.0+); `raw` is the JSON as printed, for `prevResult`."""

    cni_version: str
    interfaces: tuple[CniInterface, ...]
    ips: tuple[CniIp, ...]
    raw: Mapping[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, obj: Any) -> CniResult:
        if not isinstance(obj, dict):
            raise ValueError("result is not a JSON object")
        interfaces: list[CniInterface] = []
        for item in obj.get("interfaces") or []:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                raise ValueError(f"bad interface entry {item!r}")
            interfaces.append(
                CniInterface(
                    name=item["name"],
                    mac=str(item.get("mac") or ""),
                    sandbox=str(item.get("sandbox") or ""),
                )
            )
        ips: list[CniIp] = []
        for item in obj.get("ips") or []:
            if not isinstance(item, dict) or not isinstance(item.get("address"), str):
                raise ValueError(f"bad ips entry {item!r}")
            index = item.get("interface")
            if index is not None and not isinstance(index, int):
                raise ValueError(f"bad interface index {index!r}")
            gateway = item.get("gateway")
            ips.append(
                CniIp(
                    address=ipaddress.ip_interface(item["address"]),
                    gateway=ipaddress.ip_address(gateway) if gateway else None,
                    interface=index,
                )
            )
        return cls(
            cni_version=str(obj.get("cniVersion") or ""),
            interfaces=tuple(interfaces),
            ips=tuple(ips),
            raw=obj,
        )

    def ips_for(self, ifname: str) -> list[str]:
        """The addresses (no prefix length) on the in-sandbox interface `ifname`, in order.

        Like containerd: an IP counts when its `interface` index names an interface called
        `ifname` that has a `sandbox`.
        """
        out: list[str] = []
        for ip in self.ips:
            index = ip.interface
            if index is None or not 0 <= index < len(self.interfaces):
                continue
            interface = self.interfaces[index]
            if interface.name == ifname and interface.sandbox:
                out.append(str(ip.address.ip))
        return out


def split_primary(ips: Sequence[str], prefer: str = "ipv4") -> tuple[str, list[str]]:
    """(primary, additional) as containerd's `ip_pref`: the first IP of the preferred family
    ("ipv4" or "ipv6") leads, the others follow in order; "cni" keeps the given order."""
    if not ips:
        return "", []
    version = {"ipv4": 4, "ipv6": 6}.get(prefer)
    primary = 0
    if version is not None:
        for index, text in enumerate(ips):
            if ipaddress.ip_address(text).version == version:
                primary = index
                break
    return ips[primary], [ip for index, ip in enumerate(ips) if index != primary]


def default_conflist(
    name: str,
    bridge: str,
    subnet: str | Sequence[str],
    *,
    state_dir: str | os.PathLike[str],
    data_dir: str | os.PathLike[str] | None = None,
    port_map: bool = False,
    mtu: int | None = None,
    default_route: bool = True,
    cni_version: str = "1.0.0",
) -> dict[str, Any]:
    """A bridge + host-local (+ portmap) network config list.

    The bridge gets the gateway address of every subnet (`isGateway`), so traffic to pods stays
    on the host; no masquerading. host-local keeps its leases under `data_dir` (default:
    `<state_dir>/networks`, instead of the system-wide /var/lib/cni/networks).
    """
    subnets = [subnet] if isinstance(subnet, str) else list(subnet)
    if not subnets:
        raise CniConfigError("default_conflist needs at least one subnet")
    ranges = [[{"subnet": str(ipaddress.ip_network(s))}] for s in subnets]
    ipam: dict[str, Any] = {
        "type": "host-local",
        "ranges": ranges,
        "dataDir": os.fspath(data_dir)
        if data_dir is not None
        else str(Path(state_dir) / "networks"),
    }
    if default_route:
        families = {ipaddress.ip_network(s).version for s in subnets}
        ipam["routes"] = [
            {"dst": "0.0.0.0/0" if version == 4 else "::/0"} for version in sorted(families)
        ]
    bridge_plugin: dict[str, Any] = {
        "type": "bridge",
        "bridge": bridge,
        "isGateway": True,
        "ipMasq": False,
        "hairpinMode": True,
        "ipam": ipam,
    }
    if mtu is not None:
        bridge_plugin["mtu"] = mtu
    plugins: list[dict[str, Any]] = [bridge_plugin]
    if port_map:
        plugins.append({"type": "portmap", "capabilities": {"portMappings": True}})
    return {"cniVersion": cni_version, "name": name, "plugins": plugins}


def _loopback_config(cni_version: str) -> CniConfig:
    return CniConfig(
        name=LOOPBACK_NETWORK, cni_version=cni_version, plugins=({"type": "loopback"},)
    )


def _tail(data: bytes, limit: int = STDERR_TAIL_BYTES) -> str:
    return data[-limit:].decode("utf-8", "replace").strip()


class Cni:
    """One CNI network (plus the loopback network) for many pods."""

    def __init__(
        self,
        conflist: CniConfig | Mapping[str, Any] | str | os.PathLike[str],
        *,
        state_dir: str | os.PathLike[str],
        plugin_dirs: Sequence[str] = DEFAULT_PLUGIN_DIRS,
        ifname: str = DEFAULT_IFNAME,
        loopback: bool = True,
        timeout: float = PLUGIN_TIMEOUT,
    ) -> None:
        if isinstance(conflist, CniConfig):
            self.config = conflist
        elif isinstance(conflist, Mapping):
            self.config = CniConfig.from_dict(conflist)
        else:
            self.config = CniConfig.from_file(conflist)
        if not plugin_dirs:
            raise CniConfigError("no CNI plugin directories")
        self.plugin_dirs = [os.fspath(d) for d in plugin_dirs]
        self.state_dir = Path(state_dir)
        self.ifname = ifname
        self.loopback = _loopback_config(self.config.cni_version) if loopback else None
        self.timeout = timeout
        self._results_dir = self.state_dir / "results"
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    # -- stored results -------------------------------------------------------------------

    def _record_path(self, container_id: str) -> Path:
        return self._results_dir / f"{container_id}.json"

    def _write_record(self, container_id: str, record: Mapping[str, Any]) -> None:
        self._results_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write_json(str(self._record_path(container_id)), record)

    def _read_record(self, container_id: str) -> dict[str, Any] | None:
        try:
            record = read_json(str(self._record_path(container_id)))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("cni: unreadable result record for %s: %s", container_id, exc)
            return None
        return record if isinstance(record, dict) else None

    def stored_ids(self) -> list[str]:
        """Container ids that have a stored record (added, or an ADD that did not finish)."""
        try:
            names = os.listdir(self._results_dir)
        except FileNotFoundError:
            return []
        return sorted(
            name[: -len(".json")]
            for name in names
            if name.endswith(".json") and _CONTAINER_ID.fullmatch(name[: -len(".json")])
        )

    def has_record(self, container_id: str) -> bool:
        """Whether something is stored for `container_id` (so DEL has work to do)."""
        _check_container_id(container_id)
        return self._record_path(container_id).exists()

    def stored_result(self, container_id: str) -> CniResult | None:
        """The stored ADD result of the main network, if ADD finished."""
        _check_container_id(container_id)
        record = self._read_record(container_id)
        if record is None or not isinstance(record.get("result"), dict):
            return None
        try:
            return CniResult.from_json(record["result"])
        except ValueError as exc:
            log.warning("cni: bad stored result for %s: %s", container_id, exc)
            return None

    # -- commands -------------------------------------------------------------------------

    def _lock(self, container_id: str) -> asyncio.Lock:
        lock = self._locks.get(container_id)
        if lock is None:
            lock = asyncio.Lock()
            self._locks[container_id] = lock
        return lock

    async def add(
        self,
        container_id: str,
        netns_path: str,
        *,
        pod: tuple[str, str, str] | None = None,
        capability_args: Mapping[str, Any] | None = None,
    ) -> CniResult:
        """Set up loopback and the network in `netns_path`; returns the main network's result.

        `pod` is (namespace, name, uid) for the K8S_POD_* CNI_ARGS. `capability_args` are
        runtime config values (e.g. portMappings), passed only to plugins that declare them.
        On failure the partial setup is deleted again and the CniError raised.
        """
        _check_container_id(container_id)
        if not netns_path:
            raise CniConfigError("ADD needs a network namespace path")
        args = dict(capability_args or {})
        async with self._lock(container_id):
            record: dict[str, Any] = {
                "version": _RECORD_VERSION,
                "containerId": container_id,
                "network": self.config.name,
                "cniVersion": self.config.cni_version,
                "ifname": self.ifname,
                "netns": netns_path,
                "pod": list(pod) if pod is not None else None,
                "capabilityArgs": args,
                "loopback": None,
                "result": None,
            }
            await asyncio.to_thread(self._write_record, container_id, record)
            try:
                if self.loopback is not None:
                    lo = await self._add_chain(
                        self.loopback, container_id, netns_path, LOOPBACK_IFNAME, pod, {}
                    )
                    record["loopback"] = lo
                record["result"] = await self._add_chain(
                    self.config, container_id, netns_path, self.ifname, pod, args
                )
                parsed = CniResult.from_json(record["result"])
            except ValueError as exc:
                await self._delete_locked(container_id, netns_path, pod, record, quiet=True)
                raise CniError(
                    NO_PLUGIN_CODE, f"unusable ADD result: {exc}", command="ADD"
                ) from exc
            except BaseException:
                # Undo the partial setup; a failed undo keeps the record for a later DEL.
                await self._delete_locked(container_id, netns_path, pod, record, quiet=True)
                raise
            await asyncio.to_thread(self._write_record, container_id, record)
            return parsed

    async def delete(
        self,
        container_id: str,
        netns_path: str = "",
        *,
        pod: tuple[str, str, str] | None = None,
    ) -> None:
        """Tear down (DEL, reverse order, best effort) and forget the stored result.

        Idempotent: without a stored result DEL still runs, with no `prevResult`. Every plugin
        is tried; if any failed, the record is kept (so a retry gets the same `prevResult`)
        and the first error is raised.
        """
        _check_container_id(container_id)
        async with self._lock(container_id):
            record = self._read_record(container_id)
            await self._delete_locked(container_id, netns_path, pod, record, quiet=False)

    async def check(
        self,
        container_id: str,
        netns_path: str,
        *,
        pod: tuple[str, str, str] | None = None,
    ) -> None:
        """CHECK the chain against the stored ADD result (spec 0.4.0+)."""
        _check_container_id(container_id)
        if _version_tuple(self.config.cni_version) < CHECK_CNI_VERSION:
            raise CniConfigError(f"CHECK needs cniVersion 0.4.0+, not {self.config.cni_version}")
        if self.config.disable_check:
            return
        async with self._lock(container_id):
            record = self._read_record(container_id)
            if record is None or not isinstance(record.get("result"), dict):
                raise CniError(
                    CniCode.UNKNOWN_CONTAINER,
                    f"no stored ADD result for container {container_id}",
                    command="CHECK",
                )
            args = record.get("capabilityArgs") or {}
            for plugin in self.config.plugins:
                stdin = self._plugin_config(self.config, plugin, record["result"], args)
                await self._invoke(
                    "CHECK", plugin, stdin, container_id, netns_path, self.ifname, pod
                )

    # -- chains -----------------------------------------------------------------------------

    async def _add_chain(
        self,
        config: CniConfig,
        container_id: str,
        netns_path: str,
        ifname: str,
        pod: tuple[str, str, str] | None,
        args: Mapping[str, Any],
    ) -> dict[str, Any]:
        prev: dict[str, Any] | None = None
        for plugin in config.plugins:
            stdin = self._plugin_config(config, plugin, prev, args)
            out = await self._invoke("ADD", plugin, stdin, container_id, netns_path, ifname, pod)
            if not isinstance(out, dict):
                raise CniError(
                    NO_PLUGIN_CODE,
                    "ADD printed no result",
                    plugin=str(plugin["type"]),
                    command="ADD",
                )
            prev = out
        assert prev is not None  # a config list has at least one plugin
        return prev

    async def _del_chain(
        self,
        config: CniConfig,
        container_id: str,
        netns_path: str,
        ifname: str,
        pod: tuple[str, str, str] | None,
        prev: Mapping[str, Any] | None,
        args: Mapping[str, Any],
    ) -> list[CniError]:
        errors: list[CniError] = []
        if _version_tuple(config.cni_version) < CHECK_CNI_VERSION:
            prev = None  # prevResult on DEL exists from spec 0.4.0 on
        for plugin in reversed(config.plugins):
            stdin = self._plugin_config(config, plugin, prev, args)
            try:
                await self._invoke("DEL", plugin, stdin, container_id, netns_path, ifname, pod)
            except CniError as exc:
                errors.append(exc)
        return errors

    async def _delete_locked(
        self,
        container_id: str,
        netns_path: str,
        pod: tuple[str, str, str] | None,
        record: Mapping[str, Any] | None,
        *,
        quiet: bool,
    ) -> None:
        if pod is None and record is not None and isinstance(record.get("pod"), list):
            pod = (str(record["pod"][0]), str(record["pod"][1]), str(record["pod"][2]))
        args = (record or {}).get("capabilityArgs") or {}
        errors: list[CniError] = []
        if self.loopback is not None:
            errors += await self._del_chain(
                self.loopback,
                container_id,
                netns_path,
                LOOPBACK_IFNAME,
                pod,
                (record or {}).get("loopback"),
                {},
            )
        errors += await self._del_chain(
            self.config,
            container_id,
            netns_path,
            self.ifname,
            pod,
            (record or {}).get("result"),
            args,
        )
        for exc in errors:
            log.warning("cni: DEL %s: %s", container_id, exc)
        if errors:
            # Keep the record: a later DEL (Synchronize, RemovePodSandbox) retries with it.
            if quiet:
                return
            raise errors[0]
        with contextlib.suppress(FileNotFoundError):
            self._record_path(container_id).unlink()

    def _plugin_config(
        self,
        config: CniConfig,
        plugin: Mapping[str, Any],
        prev: Mapping[str, Any] | None,
        args: Mapping[str, Any],
    ) -> dict[str, Any]:
        out = dict(plugin)
        capabilities = out.pop("capabilities", None) or {}
        out["cniVersion"] = config.cni_version
        out["name"] = config.name
        runtime = {k: v for k, v in args.items() if capabilities.get(k) is True}
        if runtime:
            out["runtimeConfig"] = runtime
        if prev is not None:
            out["prevResult"] = prev
        return out

    # -- one plugin -------------------------------------------------------------------------

    def _find(self, plugin_type: str) -> str:
        if (why := plugin_name_error(plugin_type)) is not None:
            raise CniError(NO_PLUGIN_CODE, why, plugin=plugin_type)
        for directory in self.plugin_dirs:
            path = os.path.join(directory, plugin_type)
            if os.path.isfile(path) and os.access(path, os.X_OK):
                return path
        raise CniError(
            NO_PLUGIN_CODE,
            f"failed to find plugin {plugin_type!r} in path {self.plugin_dirs}",
            plugin=plugin_type,
        )

    def _env(
        self,
        command: str,
        container_id: str,
        netns_path: str,
        ifname: str,
        pod: tuple[str, str, str] | None,
    ) -> dict[str, str]:
        cni_args = []
        if pod is not None:
            namespace, name, uid = pod
            cni_args += [
                f"K8S_POD_NAMESPACE={namespace}",
                f"K8S_POD_NAME={name}",
                f"K8S_POD_INFRA_CONTAINER_ID={container_id}",
                f"K8S_POD_UID={uid}",
            ]
        cni_args.append("IgnoreUnknown=1")
        return {
            "CNI_COMMAND": command,
            "CNI_CONTAINERID": container_id,
            "CNI_NETNS": netns_path,
            "CNI_IFNAME": ifname,
            "CNI_ARGS": ";".join(cni_args),
            "CNI_PATH": os.pathsep.join(self.plugin_dirs),
            "PATH": PLUGIN_SEARCH_PATH,
        }

    async def _invoke(
        self,
        command: str,
        plugin: Mapping[str, Any],
        stdin: Mapping[str, Any],
        container_id: str,
        netns_path: str,
        ifname: str,
        pod: tuple[str, str, str] | None,
    ) -> Any:
        plugin_type = str(plugin["type"])
        path = self._find(plugin_type)
        env = self._env(command, container_id, netns_path, ifname, pod)
        data = json.dumps(stdin).encode()
        try:
            proc = await asyncio.create_subprocess_exec(
                path,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                close_fds=True,
            )
        except OSError as exc:
            raise CniError(
                NO_PLUGIN_CODE,
                f"cannot run {path}: {exc.strerror}",
                plugin=plugin_type,
                command=command,
            ) from exc
        try:
            async with asyncio.timeout(self.timeout):
                stdout, stderr = await proc.communicate(data)
        except TimeoutError:
            raise CniError(
                NO_PLUGIN_CODE,
                f"no answer within {self.timeout:g} s",
                plugin=plugin_type,
                command=command,
            ) from None
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(KILL_WAIT):
                        await proc.wait()
        if proc.returncode != 0:
            raise _plugin_error(plugin_type, command, proc.returncode or 0, stdout, stderr)
        if command != "ADD" or not stdout.strip():
            return None  # only ADD answers with a result; exit 0 is success for the rest
        try:
            return json.loads(stdout)
        except ValueError:
            raise CniError(
                NO_PLUGIN_CODE,
                f"output is not JSON: {_tail(stdout)!r}",
                plugin=plugin_type,
                command=command,
            ) from None


def _plugin_error(
    plugin_type: str, command: str, status: int, stdout: bytes, stderr: bytes
) -> CniError:
    # libcni's skel prints the error on stdout; the spec text says stderr: try both.
    for stream in (stdout, stderr):
        try:
            obj = json.loads(stream)
        except ValueError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("code"), int):
            return CniError(
                obj["code"],
                str(obj.get("msg") or ""),
                str(obj.get("details") or ""),
                plugin=plugin_type,
                command=command,
            )
    text = _tail(stderr) or _tail(stdout)
    return CniError(
        NO_PLUGIN_CODE,
        f"exit status {status}" + (f": {text}" if text else ""),
        plugin=plugin_type,
        command=command,
    )


def _check_container_id(container_id: str) -> None:
    if not _CONTAINER_ID.fullmatch(container_id):
        raise CniConfigError(f"invalid CNI container id {container_id!r}")
