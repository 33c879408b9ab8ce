"""A private containerd for the end-to-end tests (imported by module name; keep it unique).

Everything lives under one short temporary directory: root, state, the gRPC socket, the runc
root and the image store, so a containerd that the machine may run is never touched. Outside
it are only what containerd 1.6 does not let us move: the shims' sockets in /run/containerd/s
(named by a hash of our socket path; the directory is removed if we made it), and the pods'
cgroups, kept in a directory named after ours below runc's own cgroup. The CRI
plugin serves its streaming server on 127.0.0.1 with a random port; pods use the host network,
so no CNI plugin or configuration is needed. The only image is built here from a static
busybox and imported with `ctr`; it serves as the sandbox (pause) image too.

Teardown goes from the polite to the forceful, each step by PID or by our own paths: CRI
StopPodSandbox/RemovePodSandbox, SIGTERM to containerd, `runc delete --force` for containers
left in our runc root, SIGKILL to shims started for our socket, then every mount under the
directory is unmounted before it is removed, and the pods' cgroup directories go last.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from podgate.cri import api_pb2 as pb
from podgate.cri import api_pb2_grpc as pb_grpc

# containerd's start until its CRI plugin answers Version (plugin init, image store load).
CONTAINERD_READY_SECONDS = 30.0
# One CRI call; RunPodSandbox mounts a snapshot and starts a shim and runc.
CRI_CALL_SECONDS = 60.0
# After SIGTERM, how long containerd or a shim may take to exit before SIGKILL.
STOP_GRACE_SECONDS = 10.0
# `ctr images import` of a ~1 MiB image, unpacked into the snapshotter.
IMPORT_SECONDS = 60.0
# Polling period while waiting for a socket or a container state.
POLL_SECONDS = 0.05
# A container goes from StartContainer to RUNNING (and its server to listening) within this.
CONTAINER_READY_SECONDS = 20.0
# The CRI image namespace: the plugin sees only images there.
CRI_NAMESPACE = "k8s.io"
# A name with a registry-like host, so no normalisation into docker.io/library happens.
IMAGE_NAME = "podgate.test/busybox:e2e"
# Busybox applets the image links to /bin/busybox.
APPLETS = ("sh", "sleep", "nc", "cat", "echo", "ls", "tty", "sha256sum", "stty", "true")
# Where a static busybox is (Debian's busybox-static puts it in /bin).
BUSYBOX_CANDIDATES = ("/bin/busybox", "/usr/bin/busybox")
# A unix socket path must fit in sun_path (108 bytes): keep the base directory short.
MAX_SOCKET_PATH_BYTES = 100
# The sandbox process: sleeps until the sandbox is stopped (SIGKILL from the runtime).
SANDBOX_COMMAND = ("/bin/sleep", "2147483647")
# How deep below a cgroup mount our pod parent is looked for (runc's own cgroup plus one).
CGROUP_SEARCH_DEPTH = 4
# Fixed file times inside the image, so its digests depend on the content only.
IMAGE_MTIME = 0

_GO_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le"}


class ContainerdError(Exception):
    """containerd could not be started or prepared; carries the tail of its log."""


@dataclass(frozen=True, slots=True)
class Tools:
    containerd: str
    ctr: str
    runc: str
    busybox: str


def missing_tools() -> tuple[Tools | None, str]:
    """The binaries the test needs, or None and why they are not usable here."""
    found = {name: shutil.which(name) for name in ("containerd", "ctr", "runc")}
    absent = [name for name, path in found.items() if path is None]
    if absent:
        return None, f"not installed: {', '.join(absent)} (Debian: containerd runc)"
    if shutil.which("containerd-shim-runc-v2") is None:
        return None, "containerd-shim-runc-v2 is not on PATH"
    busybox = next((p for p in BUSYBOX_CANDIDATES if os.access(p, os.X_OK)), None)
    if busybox is None:
        return None, "no busybox binary (Debian: busybox-static)"
    if not is_static_elf(Path(busybox)):
        return None, f"{busybox} is dynamically linked (Debian: busybox-static)"
    return (
        Tools(
            containerd=str(found["containerd"]),
            ctr=str(found["ctr"]),
            runc=str(found["runc"]),
            busybox=busybox,
        ),
        "",
    )


def is_static_elf(path: Path) -> bool:
    """True for a 64-bit little-endian ELF without a PT_INTERP header (no dynamic loader)."""
    with path.open("rb") as f:
        header = f.read(64)
        if header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
            return False
        phoff = int.from_bytes(header[32:40], "little")
        phentsize = int.from_bytes(header[54:56], "little")
        phnum = int.from_bytes(header[56:58], "little")
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    pt_interp = 3
    return all(
        int.from_bytes(table[i * phentsize : i * phentsize + 4], "little") != pt_interp
        for i in range(phnum)
    )


# --- the image ----------------------------------------------------------------------------


def _tar_member(tar: tarfile.TarFile, info: tarfile.TarInfo, data: bytes | None = None) -> None:
    info.mtime = IMAGE_MTIME
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    if data is None:
        tar.addfile(info)
    else:
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def busybox_layer(busybox: Path) -> bytes:
    """An uncompressed layer tar: /bin/busybox, its applet links and the usual mount points."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, mode in (("bin", 0o755), ("dev", 0o755), ("etc", 0o755), ("proc", 0o555)):
            _tar_member(tar, _dir(name, mode))
        for name, mode in (("root", 0o700), ("sys", 0o555), ("tmp", 0o1777)):
            _tar_member(tar, _dir(name, mode))
        binary = tarfile.TarInfo("bin/busybox")
        binary.mode = 0o755
        _tar_member(tar, binary, busybox.read_bytes())
        for applet in APPLETS:
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type = tarfile.SYMTYPE
            link.linkname = "busybox"
            link.mode = 0o777
            _tar_member(tar, link)
        passwd = tarfile.TarInfo("etc/passwd")
        passwd.mode = 0o644
        _tar_member(tar, passwd, b"root:x:0:0:root:/root:/bin/sh\n")
        group = tarfile.TarInfo("etc/group")
        group.mode = 0o644
        _tar_member(tar, group, b"root:x:0:\n")
    return out.getvalue()


def _dir(name: str, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    info.mode = mode
    return info


def go_arch() -> str:
    machine = platform.machine()
    return _GO_ARCH.get(machine, machine)


def write_image_archive(busybox: Path, out: Path, name: str = IMAGE_NAME) -> str:
    """A docker-archive tarball (`docker save` layout) of the busybox image; returns the image
    config's digest (the image ID)."""
    layer = busybox_layer(busybox)
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    compressed = gzip.compress(layer, mtime=IMAGE_MTIME)
    config = json.dumps(
        {
            "architecture": go_arch(),
            "os": "linux",
            "created": "1970-01-01T00:00:00Z",
            "config": {
                "Env": ["PATH=/bin"],
                "Entrypoint": list(SANDBOX_COMMAND[:1]),
                "Cmd": list(SANDBOX_COMMAND[1:]),
                "WorkingDir": "/",
            },
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
            "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "busybox layer"}],
        },
        sort_keys=True,
    ).encode()
    config_hex = hashlib.sha256(config).hexdigest()
    layer_name = hashlib.sha256(compressed).hexdigest() + "/layer.tar.gz"
    manifest = json.dumps(
        [{"Config": f"{config_hex}.json", "RepoTags": [name], "Layers": [layer_name]}]
    ).encode()
    with tarfile.open(out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for member, data in (
            (f"{config_hex}.json", config),
            (layer_name, compressed),
            ("manifest.json", manifest),
        ):
            info = tarfile.TarInfo(member)
            info.mode = 0o644
            _tar_member(tar, info, data)
    return "sha256:" + config_hex


# --- containerd -----------------------------------------------------------------------------


def overlay_works(scratch: Path) -> bool:
    """Whether an overlay mount with two lower layers works here (as containerd's check)."""
    dirs = [scratch / d for d in ("lower1", "lower2", "upper", "work", "merged")]
    for d in dirs:
        d.mkdir(parents=True)
    lower1, lower2, upper, work, merged = dirs
    options = f"lowerdir={lower1}:{lower2},upperdir={upper},workdir={work}"
    done = subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", options, str(merged)],
        capture_output=True,
        check=False,
    )
    if done.returncode == 0:
        subprocess.run(["umount", str(merged)], capture_output=True, check=False)
    shutil.rmtree(scratch, ignore_errors=True)
    return done.returncode == 0


def containerd_config(base: Path, snapshotter: str) -> str:
    """containerd 1.6 configuration (version 2) keeping every path under `base`."""
    q = json.dumps  # TOML basic strings accept JSON string escapes
    cri = '[plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = {q(str(base / "root"))}
state = {q(str(base / "state"))}
# Plugins that would look outside our directories (opt: /opt/containerd) or need other tools.
disabled_plugins = [
  "io.containerd.internal.v1.opt",
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing",
]

[grpc]
  address = {q(str(base / "c.sock"))}

[ttrpc]
  address = {q(str(base / "c.sock.ttrpc"))}

[debug]
  address = ""
  level = "info"

[metrics]
  address = ""

{cri}]
  sandbox_image = {q(IMAGE_NAME)}
  # No AppArmor profile is loaded for the pods; their OOM score is never set below ours.
  disable_apparmor = true
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_tls_streaming = false

{cri}.containerd]
  snapshotter = {q(snapshotter)}
  default_runtime_name = "runc"

{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

{cri}.containerd.runtimes.runc.options]
  Root = {q(str(base / "runc"))}
  SystemdCgroup = false

{cri}.cni]
  bin_dir = {q(str(base / "cni" / "bin"))}
  conf_dir = {q(str(base / "cni" / "conf"))}
"""


@dataclass(frozen=True, slots=True)
class RunningPod:
    sandbox_id: str
    container_id: str
    uid: str


@dataclass
class Containerd:
    """A running private containerd and what was made in it."""

    base: Path
    tools: Tools
    snapshotter: str
    proc: subprocess.Popen[bytes] | None = None
    channel: grpc.Channel | None = None
    sandboxes: list[str] = field(default_factory=list)

    @property
    def socket(self) -> Path:
        return self.base / "c.sock"

    @property
    def log_path(self) -> Path:
        return self.base / "containerd.log"

    @property
    def cgroup_parent(self) -> str:
        """Relative, so runc puts the pods below its own cgroup (ours), in a directory of
        their own that teardown removes; containerd's default is /k8s.io at the top."""
        return self.base.name

    @property
    def runc_root(self) -> Path:
        # The runc v2 shim adds the containerd namespace to the configured Root.
        return self.base / "runc" / CRI_NAMESPACE

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    @property
    def runtime(self) -> pb_grpc.RuntimeServiceStub:
        assert self.channel is not None
        return pb_grpc.RuntimeServiceStub(self.channel)

    # -- start

    def start(self) -> None:
        config = self.base / "config.toml"
        config.write_text(containerd_config(self.base, self.snapshotter))
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [self.tools.containerd, "--config", str(config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Its own session: a terminal's signals meant for pytest do not reach it.
                start_new_session=True,
            )
        self.channel = grpc.insecure_channel(f"unix://{self.socket}")
        deadline = time.monotonic() + CONTAINERD_READY_SECONDS
        while True:
            if self.proc.poll() is not None:
                raise ContainerdError(
                    f"containerd exited ({self.proc.returncode}):\n" + self.log_tail()
                )
            try:
                self.runtime.Version(pb.VersionRequest(), timeout=1.0)
                return
            except grpc.RpcError as exc:
                if time.monotonic() > deadline:
                    raise ContainerdError(
                        f"containerd's CRI plugin did not answer: {exc}\n" + self.log_tail()
                    ) from exc
            time.sleep(POLL_SECONDS * 4)

    def import_image(self, archive: Path) -> None:
        done = subprocess.run(
            [
                self.tools.ctr,
                "--address",
                str(self.socket),
                "--namespace",
                CRI_NAMESPACE,
                "images",
                "import",
                "--snapshotter",
                self.snapshotter,
                str(archive),
            ],
            capture_output=True,
            timeout=IMPORT_SECONDS,
            check=False,
        )
        if done.returncode != 0:
            raise ContainerdError(
                f"ctr images import failed ({done.returncode}): "
                f"{done.stderr.decode(errors='replace')}\n" + self.log_tail()
            )

    # -- pods

    def run_pod(
        self,
        name: str,
        namespace: str,
        command: list[str],
        *,
        container: str = "main",
        annotations: dict[str, str] | None = None,
        stdin_once: bool = False,
        mounts: list[pb.Mount] | None = None,
        working_dir: str = "",
    ) -> RunningPod:
        """A host-network pod with one started container; with `stdin_once` the container has
        a stdin that closes when the first attach ends (as `kubectl run -i` makes it);
        `mounts` bind host paths into the container (the benchmark runs a host program)."""
        host_network = pb.NamespaceOption(network=pb.NODE, pid=pb.CONTAINER, ipc=pb.POD)
        logs = self.base / "logs" / name
        logs.mkdir(parents=True, exist_ok=True)
        uid = str(uuid.uuid4())
        sandbox_config = pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name=name, namespace=namespace, uid=uid, attempt=0),
            log_directory=str(logs),
            linux=pb.LinuxPodSandboxConfig(
                cgroup_parent=self.cgroup_parent,
                security_context=pb.LinuxSandboxSecurityContext(namespace_options=host_network),
            ),
        )
        sandbox_id = self.runtime.RunPodSandbox(
            pb.RunPodSandboxRequest(config=sandbox_config), timeout=CRI_CALL_SECONDS
        ).pod_sandbox_id
        self.sandboxes.append(sandbox_id)
        container_config = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name=container, attempt=0),
            image=pb.ImageSpec(image=IMAGE_NAME),
            command=command,
            working_dir=working_dir,
            mounts=mounts or [],
            log_path=f"{container}.log",
            annotations=annotations or {},
            stdin=stdin_once,
            stdin_once=stdin_once,
            linux=pb.LinuxContainerConfig(
                security_context=pb.LinuxContainerSecurityContext(namespace_options=host_network)
            ),
        )
        container_id = self.runtime.CreateContainer(
            pb.CreateContainerRequest(
                pod_sandbox_id=sandbox_id, config=container_config, sandbox_config=sandbox_config
            ),
            timeout=CRI_CALL_SECONDS,
        ).container_id
        self.runtime.StartContainer(
            pb.StartContainerRequest(container_id=container_id), timeout=CRI_CALL_SECONDS
        )
        return RunningPod(sandbox_id, container_id, uid)

    def wait_running(self, container_id: str) -> None:
        deadline = time.monotonic() + CONTAINER_READY_SECONDS
        while True:
            status = self.runtime.ContainerStatus(
                pb.ContainerStatusRequest(container_id=container_id), timeout=CRI_CALL_SECONDS
            ).status
            if status.state == pb.CONTAINER_RUNNING:
                return
            if status.state == pb.CONTAINER_EXITED or time.monotonic() > deadline:
                raise ContainerdError(
                    f"container {container_id} is {pb.ContainerState.Name(status.state)} "
                    f"(exit {status.exit_code}, {status.reason} {status.message})"
                )
            time.sleep(POLL_SECONDS)

    def remove_pods(self) -> list[str]:
        """Stop and remove every sandbox made here; returns the errors (teardown goes on)."""
        errors = []
        for sandbox_id in self.sandboxes:
            try:
                self.runtime.StopPodSandbox(
                    pb.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=CRI_CALL_SECONDS
                )
            except grpc.RpcError as exc:
                errors.append(f"StopPodSandbox {sandbox_id}: {exc}")
            try:
                self.runtime.RemovePodSandbox(
                    pb.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id),
                    timeout=CRI_CALL_SECONDS,
                )
            except grpc.RpcError as exc:
                errors.append(f"RemovePodSandbox {sandbox_id}: {exc}")
        self.sandboxes.clear()
        return errors

    # -- stop

    def stop(self) -> list[str]:
        """Everything back as it was; returns what had to be forced (for the report)."""
        forced: list[str] = []
        if self.channel is not None:
            with contextlib.suppress(Exception):
                forced += self.remove_pods()
            self.channel.close()
            self.channel = None
        if self.proc is not None:
            forced += _terminate(self.proc.pid, self.proc, "containerd")
            self.proc = None
        forced += self._delete_runc_containers()
        for pid in _shims_of(self.socket):
            forced.append(f"killed shim {pid}")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        forced += unmount_under(self.base)
        forced += remove_cgroups(self.cgroup_parent)
        return forced

    def _delete_runc_containers(self) -> list[str]:
        if not self.runc_root.is_dir():
            return []
        listed = subprocess.run(
            [self.tools.runc, "--root", str(self.runc_root), "list", "--quiet"],
            capture_output=True,
            text=True,
            timeout=STOP_GRACE_SECONDS,
            check=False,
        )
        forced = []
        for container_id in listed.stdout.split():
            forced.append(f"runc delete --force {container_id}")
            subprocess.run(
                [self.tools.runc, "--root", str(self.runc_root), "delete", "--force", container_id],
                capture_output=True,
                timeout=STOP_GRACE_SECONDS,
                check=False,
            )
        return forced


def _terminate(pid: int, proc: subprocess.Popen[bytes], what: str) -> list[str]:
    if proc.poll() is not None:
        return []
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    try:
        proc.wait(STOP_GRACE_SECONDS)
        return []
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        proc.wait(STOP_GRACE_SECONDS)
        return [f"{what} ({pid}) needed SIGKILL"]


def _shims_of(socket_path: Path) -> list[int]:
    """PIDs of shims started by our containerd: their command line names its socket."""
    needle = str(socket_path).encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"containerd-shim-runc-v2") and needle in argv:
            pids.append(int(entry.name))
    return pids


def mounts_under(base: Path) -> list[str]:
    """Mount points at or below `base`, deepest first (from /proc/self/mountinfo)."""
    prefix = str(base).rstrip("/") + "/"
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        # Field 5 is the mount point, with space, tab, newline and backslash octal-escaped.
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), line.split()[4])
        if point == str(base) or point.startswith(prefix):
            found.append(point)
    return sorted(set(found), key=lambda p: p.count("/"), reverse=True)


def remove_cgroups(name: str) -> list[str]:
    """rmdir every cgroup directory called `name` (our unique pod parent), children first,
    in each cgroup hierarchy; returns the ones that could not be removed."""
    left = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fstype = line.split(" - ", 1)[1].split()[0]
        if fstype not in ("cgroup", "cgroup2"):
            continue
        mount = line.split()[4]
        for dirpath, dirnames, _ in os.walk(mount):
            depth = dirpath[len(mount) :].count("/")
            if os.path.basename(dirpath) == name:
                dirnames.clear()
                left += _rmdir_tree(Path(dirpath))
            elif depth >= CGROUP_SEARCH_DEPTH:
                dirnames.clear()
    return left


def _rmdir_tree(top: Path) -> list[str]:
    left = []
    for dirpath, _, _ in sorted(os.walk(top), key=lambda w: w[0].count("/"), reverse=True):
        try:
            os.rmdir(dirpath)
        except OSError as exc:
            left.append(f"cgroup {dirpath} not removed: {exc}")
    return left


def unmount_under(base: Path) -> list[str]:
    forced = []
    for point in mounts_under(base):
        forced.append(f"umount {point}")
        subprocess.run(["umount", "-R", point], capture_output=True, check=False)
    for point in mounts_under(base):
        forced.append(f"umount -l {point}")
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)
    return forced


@contextlib.contextmanager
def private_containerd(tools: Tools) -> Iterator[Containerd]:
    """A running containerd with the busybox image imported; all of it gone afterwards."""
    base = Path(tempfile.mkdtemp(prefix="pgc", dir="/tmp"))
    run_dir_existed = Path("/run/containerd").exists()
    ctrd: Containerd | None = None
    try:
        if len(str(base / "c.sock.ttrpc").encode()) > MAX_SOCKET_PATH_BYTES:
            raise ContainerdError(f"temporary directory path too long for a socket: {base}")
        snapshotter = "overlayfs" if overlay_works(base / "probe") else "native"
        ctrd = Containerd(base, tools, snapshotter)
        archive = base / "image.tar"
        write_image_archive(Path(tools.busybox), archive)
        ctrd.start()
        ctrd.import_image(archive)
        yield ctrd
    finally:
        leftovers = ctrd.stop() if ctrd is not None else unmount_under(base)
        still_mounted = mounts_under(base)
        if not still_mounted:
            shutil.rmtree(base, ignore_errors=True)
        if not run_dir_existed:
            _remove_empty_tree(Path("/run/containerd"))
        if still_mounted:
            raise ContainerdError(f"still mounted after teardown: {still_mounted}")
        if leftovers:
            print("containerd teardown forced:", *leftovers, sep="\n  ")


def _remove_empty_tree(top: Path) -> None:
    """rmdir every empty directory under `top`, then `top` (a shim's socket dir we caused)."""
    if not top.is_dir():
        return
    for dirpath, _, _ in sorted(os.walk(top), key=lambda w: w[0].count("/"), reverse=True):
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)
