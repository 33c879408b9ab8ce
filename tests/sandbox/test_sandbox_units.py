"""Pieces of the sandbox path that need no namespaces: the shim API's generated module and its
wire numbers, backend selection, and the --backend option."""

from __future__ import annotations

import pytest
from google.protobuf.descriptor import FieldDescriptor

from podgate.aio.streams import ByteStream
from podgate.backends.base import BackendError, Backends, BackendUnavailableError
from podgate.model import PodMetadata, PodRecord, PodState
from podgate.runtime.daemon import default_backends, parse_backend_options
from podgate.shimapi import shim_pb2


def test_port_forward_request_keeps_containerd_4814_numbering() -> None:
    # runtime-and-nri.md §2.1: id=1 string, port=2 int32, addr=3 string; reply Empty.
    t = FieldDescriptor
    descriptor = shim_pb2.PortForwardRequest.DESCRIPTOR
    # protocol=4 (UDP) and hand_over=5 are podgate's extensions; a request that leaves them
    # unset encodes as PR #4814's does, and a PR #4814 shim skips them (it then copies).
    assert {f.name: (f.number, f.type) for f in descriptor.fields} == {
        "id": (1, t.TYPE_STRING),
        "port": (2, t.TYPE_INT32),
        "addr": (3, t.TYPE_STRING),
        "protocol": (4, t.TYPE_STRING),
        "hand_over": (5, t.TYPE_BOOL),
    }
    service = shim_pb2.DESCRIPTOR.services_by_name["Shim"]
    assert service.full_name == "podgate.shim.v1.Shim"
    method = service.methods_by_name["PortForward"]
    # The reply extends PR #4814's Empty: an Empty's bytes (none) decode as a reply with no
    # agent generation, and a bare reply encodes as an Empty does.
    assert method.output_type.full_name == "podgate.shim.v1.PortForwardResponse"
    assert shim_pb2.PortForwardResponse.FromString(b"").agent_generation == 0
    assert not shim_pb2.PortForwardResponse.FromString(b"").handed_over  # an Empty: copied
    assert shim_pb2.PortForwardResponse().SerializeToString() == b""
    # The encoding of {id: "a", port: 8080, addr: "unix:///x"}, field by field.
    encoded = shim_pb2.PortForwardRequest(id="a", port=8080, addr="unix:///x").SerializeToString()
    assert encoded == b"\x0a\x01a" + b"\x10\x90\x3f" + b"\x1a\x09unix:///x"
    # field 4 LEN (tag 0x22) "udp"
    udp = shim_pb2.PortForwardRequest(id="a", port=53, addr="u", protocol="udp")
    assert udp.SerializeToString() == b"\x0a\x01a" + b"\x10\x35" + b"\x1a\x01u" + b"\x22\x03udp"
    # field 5 VARINT (tag 0x28) true
    handed = shim_pb2.PortForwardRequest(id="a", port=53, addr="u", hand_over=True)
    assert handed.SerializeToString() == b"\x0a\x01a" + b"\x10\x35" + b"\x1a\x01u" + b"\x28\x01"


POD = PodRecord(id="p" * 64, metadata=PodMetadata("n", "ns"), state=PodState.READY, created_at=0)


class Fake:
    def __init__(self, name: str, error: BackendError | None = None) -> None:
        self.name = name
        self.error = error
        self.calls = 0

    async def open(self, pod: PodRecord, port: int, protocol: str = "tcp") -> ByteStream:
        self.calls += 1
        if self.error is not None:
            raise self.error
        return Opened(self.name)


class Opened(ByteStream):
    def __init__(self, name: str) -> None:
        self.name = name

    async def receive(self, max_bytes: int = 0) -> bytes:
        return b""

    async def send(self, data: object) -> None:
        pass

    async def send_eof(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


def sandboxed(handler: str) -> PodRecord:
    return PodRecord(
        id=POD.id, metadata=POD.metadata, state=POD.state, created_at=0, runtime_handler=handler
    )


async def test_an_unavailable_backend_hands_over_to_the_next() -> None:
    agent = Fake("agent", BackendUnavailableError("sandbox has no agent"))
    exec_ = Fake("exec")
    backends = Backends(Fake("netns"), {"sandboxed": [agent, exec_]})
    stream = await backends.open(sandboxed("sandboxed"), 80)
    assert isinstance(stream, Opened) and stream.name == "exec"
    assert (agent.calls, exec_.calls) == (1, 1)


async def test_a_refused_port_is_final() -> None:
    agent = Fake("agent", BackendError("port 80 refused inside the sandbox"))
    exec_ = Fake("exec")
    backends = Backends(Fake("netns"), {"sandboxed": [agent, exec_]})
    with pytest.raises(BackendError) as failed:
        await backends.open(sandboxed("sandboxed"), 80)
    assert str(failed.value) == "port 80 refused inside the sandbox"
    assert exec_.calls == 0


async def test_every_backend_unavailable_says_why_each() -> None:
    backends = Backends(
        Fake("netns"),
        {
            "sandboxed": [
                Fake("agent", BackendUnavailableError("no agent")),
                Fake("exec", BackendUnavailableError("no tool")),
            ]
        },
    )
    with pytest.raises(BackendUnavailableError) as failed:
        await backends.open(sandboxed("sandboxed"), 80)
    assert str(failed.value) == "agent: no agent; exec: no tool"
    # A single backend's reason is passed on as it is.
    single = Backends(Fake("netns", BackendUnavailableError("closed")))
    with pytest.raises(BackendUnavailableError) as failed:
        await single.open(POD, 80)
    assert str(failed.value) == "closed"


async def test_unknown_handlers_use_the_default_list() -> None:
    netns = Fake("netns")
    backends = Backends([netns], {"sandboxed": [Fake("agent")]})
    stream = await backends.open(sandboxed("runsc"), 80)
    assert isinstance(stream, Opened) and stream.name == "netns"
    assert backends.for_pod(sandboxed("sandboxed")).name == "agent"


def test_backend_options() -> None:
    assert default_backends() == {"": ["netns"], "sandboxed": ["agent", "exec"]}
    assert parse_backend_options([]) == default_backends()
    assert parse_backend_options(["sandboxed=netns", "=exec, netns", "kata=agent"]) == {
        "": ["exec", "netns"],
        "sandboxed": ["netns"],
        "kata": ["agent"],
    }
    for bad, reason in [
        ("sandboxed", "want HANDLER=NAME"),
        ("sandboxed=", "want HANDLER=NAME"),
        ("sandboxed=agent,vsock", "unknown backend 'vsock'"),
    ]:
        with pytest.raises(ValueError, match=reason):
            parse_backend_options([bad])


def test_the_sandbox_shims_own_argument_parsing(capsys: pytest.CaptureFixture[str]) -> None:
    # Forked from a warm interpreter, the shim parses its arguments without argparse: the
    # command line the runtime gives it, in both spellings, and the same refusals.
    from podgate.runtime.sandbox import shim

    args = shim._parse_args(
        ["--dir", "/run/p", "--ready-file", "/run/p/r.json", "--hostname", "h", "--foreground"]
    )
    assert (args.dir, args.ready_file, args.hostname, args.adopt_guest) == (
        "/run/p",
        "/run/p/r.json",
        "h",
        "",
    )
    assert args.foreground and not args.verbose
    args = shim._parse_args(["--dir=/run/p", "--adopt-guest=1:2:3:4", "-v"])
    assert (args.ready_file, args.adopt_guest, args.verbose) == (
        "/run/p/sandbox.json",
        "1:2:3:4",
        True,
    )
    for bad in ([], ["--dir"], ["--dir", "d", "--bogus"], ["d"], ["--hostname", "h"]):
        with pytest.raises(ValueError):
            shim._parse_args(bad)
    assert shim.main(["--bogus"]) == 2
    assert "usage: python -m podgate.runtime.sandbox.shim --dir DIR" in capsys.readouterr().err
