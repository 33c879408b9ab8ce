"""`podgate proxy` in front of a real containerd 1.6 with runc: the pod lifecycle as the kubelet
drives it, byte-identical answers, unknown fields, the event stream, port-forward into a pod
whose listener containerd cannot reach (see proxy_support for how that pod is made), kubectl
through `podgate node` on the proxy's socket, and both the proxy and containerd restarting.

Expected values come from containerd itself (the same call made directly) or from the data
sent (sha256), never from the proxy.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from containerd_support import CRI_CALL_SECONDS, IMAGE_NAME, STOP_GRACE_SECONDS
from e2e_support import Kubectl, exchange_tcp, free_port, kubectl_binary, sha256_hex, stop_process
from proxy_support import (
    AGENT_GID,
    NODE_READY,
    READY_SECONDS,
    Process,
    ProxyStack,
    echo_command,
    proxy_stack,
    run_pod,
    sandbox_pid,
    start_process,
    start_proxy,
)

from podgate.aio.memory import memory_stream_pair
from podgate.cri import api_pb2 as pb
from podgate.cri import api_pb2_grpc as pb_grpc
from podgate.node.cri_client import CriClient
from podgate.node.upstream import EXEC_NO_UDP, CriTarget, UpstreamForwardError
from podgate.proto.datagram import DatagramDecoder, encode_datagram
from podgate.streaming.target import ExecIO, PodRef, TargetError
from udp_support import UDP_ECHO_SERVER

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

RT = "/runtime.v1.RuntimeService"
MIB = 1024 * 1024
# The acceptance transfer through the proxy's port-forward, each way.
BIG_TRANSFER_BYTES = 256 * MIB
CHUNK_BYTES = 256 * 1024
# A 256 MiB echo through two SPDY hops and a forwarder process, on a loaded 2-core machine.
BIG_TRANSFER_SECONDS = 300.0
# kubectl's transfer: several SPDY frames and flow-control windows each way.
KUBECTL_BYTES = 4 * MIB
TRANSFER_SECONDS = 60.0
# A field number runtime.v1's ListContainersRequest lacks, varint 7.
UNKNOWN_FIELD = bytes([0xB8, 0x3E, 0x07])
# Datagrams echoed through the agent, one at a time (each reply checked byte for byte).
UDP_DATAGRAMS = 50
# After containerd comes back, the proxy's channel reconnects within this.
RECOVER_SECONDS = 30.0
# The in-flight call that containerd's restart interrupts runs this long.
IN_FLIGHT_SLEEP_SECONDS = 20


@pytest.fixture(scope="module", params=["relay", "grpc"])
def stack(request: pytest.FixtureRequest) -> Iterator[ProxyStack]:
    """containerd, two pods and the proxy, once per data plane."""
    with proxy_stack(str(request.param)) as running:
        yield running


def channel_to(path: Path) -> grpc.Channel:
    return grpc.insecure_channel(f"unix://{path}")


def raw_call(channel: grpc.Channel, method: str, request: bytes) -> bytes:
    call = channel.unary_unary(method)
    return call(request, timeout=CRI_CALL_SECONDS)  # type: ignore[no-any-return]


def ref(pod: object) -> PodRef:
    return PodRef("default", pod.name, pod.uid, pod.sandbox_id)  # type: ignore[attr-defined]


# -- pass-through -----------------------------------------------------------------------------


def test_a_pod_lifecycle_through_the_proxy(stack: ProxyStack) -> None:
    """The kubelet's calls for one pod, in its order, through the proxy only."""
    with channel_to(stack.proxy_socket) as channel:
        runtime = pb_grpc.RuntimeServiceStub(channel)
        images = pb_grpc.ImageServiceStub(channel)
        version = runtime.Version(pb.VersionRequest(version="v1"), timeout=CRI_CALL_SECONDS)
        assert (version.runtime_name, version.runtime_api_version) == ("containerd", "v1")
        status = runtime.Status(pb.StatusRequest(), timeout=CRI_CALL_SECONDS).status
        assert {c.type: c.status for c in status.conditions} == {
            "RuntimeReady": True,
            "NetworkReady": True,
        }
        # imagePullPolicy IfNotPresent: ImageStatus first, PullImage only for a missing image.
        image = images.ImageStatus(
            pb.ImageStatusRequest(image=pb.ImageSpec(image=IMAGE_NAME)), timeout=CRI_CALL_SECONDS
        ).image
        assert IMAGE_NAME in image.repo_tags
        listed = images.ListImages(pb.ListImagesRequest(), timeout=CRI_CALL_SECONDS).images
        assert image.id in [i.id for i in listed]
        name = f"life-{uuid.uuid4().hex[:6]}"
        port = free_port()
        pod = run_pod(stack.ctrd, runtime, name, echo_command(port), host_network=True, port=port)
        state = runtime.ContainerStatus(
            pb.ContainerStatusRequest(container_id=pod.container_id), timeout=CRI_CALL_SECONDS
        ).status
        assert (state.state, state.image.image) == (pb.CONTAINER_RUNNING, IMAGE_NAME)
        mine = runtime.ListContainers(
            pb.ListContainersRequest(filter=pb.ContainerFilter(pod_sandbox_id=pod.sandbox_id)),
            timeout=CRI_CALL_SECONDS,
        ).containers
        assert [c.id for c in mine] == [pod.container_id]
        done = runtime.ExecSync(
            pb.ExecSyncRequest(
                container_id=pod.container_id, cmd=["sh", "-c", "echo out; echo err >&2; exit 5"]
            ),
            timeout=CRI_CALL_SECONDS,
        )
        assert (done.stdout, done.stderr, done.exit_code) == (b"out\n", b"err\n", 5)
        runtime.StopContainer(
            pb.StopContainerRequest(container_id=pod.container_id, timeout=1),
            timeout=CRI_CALL_SECONDS,
        )
        state = runtime.ContainerStatus(
            pb.ContainerStatusRequest(container_id=pod.container_id), timeout=CRI_CALL_SECONDS
        ).status
        assert state.state == pb.CONTAINER_EXITED
        runtime.RemoveContainer(
            pb.RemoveContainerRequest(container_id=pod.container_id), timeout=CRI_CALL_SECONDS
        )
        runtime.StopPodSandbox(
            pb.StopPodSandboxRequest(pod_sandbox_id=pod.sandbox_id), timeout=CRI_CALL_SECONDS
        )
        runtime.RemovePodSandbox(
            pb.RemovePodSandboxRequest(pod_sandbox_id=pod.sandbox_id), timeout=CRI_CALL_SECONDS
        )
        stack.ctrd.sandboxes.remove(pod.sandbox_id)
        with pytest.raises(grpc.RpcError) as gone:
            runtime.ContainerStatus(
                pb.ContainerStatusRequest(container_id=pod.container_id), timeout=CRI_CALL_SECONDS
            )
        assert gone.value.code() is grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
        sandboxes = runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=CRI_CALL_SECONDS)
        assert pod.sandbox_id not in [s.id for s in sandboxes.items]


def test_a_failed_pull_fails_as_containerd_says(stack: ProxyStack) -> None:
    # A registry on a loopback port nothing listens on: the pull fails without leaving the host.
    request = pb.PullImageRequest(
        image=pb.ImageSpec(image=f"127.0.0.1:{free_port()}/nothing:1")
    ).SerializeToString()
    errors = []
    for socket_path in (stack.ctrd.socket, stack.proxy_socket):
        with channel_to(socket_path) as channel, pytest.raises(grpc.RpcError) as caught:
            raw_call(channel, "/runtime.v1.ImageService/PullImage", request)
        errors.append(caught.value)
    direct, proxied = errors
    assert proxied.code() == direct.code()  # type: ignore[attr-defined]
    assert "connection refused" in direct.details()  # type: ignore[attr-defined]
    assert "connection refused" in proxied.details()  # type: ignore[attr-defined]


def test_list_and_status_answers_are_byte_identical(stack: ProxyStack) -> None:
    with channel_to(stack.ctrd.socket) as direct, channel_to(stack.proxy_socket) as proxied:
        for pod in (stack.plain, stack.netstack):
            for method, request in (
                (
                    "ListContainers",
                    pb.ListContainersRequest(
                        filter=pb.ContainerFilter(pod_sandbox_id=pod.sandbox_id)
                    ),
                ),
                ("ContainerStatus", pb.ContainerStatusRequest(container_id=pod.container_id)),
                ("PodSandboxStatus", pb.PodSandboxStatusRequest(pod_sandbox_id=pod.sandbox_id)),
            ):
                body = request.SerializeToString()
                assert raw_call(proxied, f"{RT}/{method}", body) == raw_call(
                    direct, f"{RT}/{method}", body
                ), method
        # The whole list: containerd orders it by map iteration, so compare as a set of items.
        everything = pb.ListContainersRequest().SerializeToString()
        lists = [
            pb.ListContainersResponse.FromString(raw_call(ch, f"{RT}/ListContainers", everything))
            for ch in (direct, proxied)
        ]
        assert sorted(c.SerializeToString() for c in lists[0].containers) == sorted(
            c.SerializeToString() for c in lists[1].containers
        )
        assert len(lists[0].containers) >= 2


def test_a_request_with_an_unknown_field_reaches_containerd(stack: ProxyStack) -> None:
    # containerd (Go protobuf) skips the field; the answer is the one to the known fields.
    known = pb.ListContainersRequest(
        filter=pb.ContainerFilter(id=stack.plain.container_id)
    ).SerializeToString()
    with channel_to(stack.ctrd.socket) as direct, channel_to(stack.proxy_socket) as proxied:
        expected = raw_call(direct, f"{RT}/ListContainers", known)
        got = raw_call(proxied, f"{RT}/ListContainers", known + UNKNOWN_FIELD)
    assert got == expected
    assert stack.plain.container_id in got.decode(errors="replace")


def test_get_container_events_is_relayed_as_a_stream(stack: ProxyStack) -> None:
    # containerd 1.6 predates the Evented PLEG: both answer with its UNIMPLEMENTED, the proxy
    # as a stream (the fake upstream of test_passthrough shows events flowing).
    codes = []
    for socket_path in (stack.ctrd.socket, stack.proxy_socket):
        with channel_to(socket_path) as channel:
            call = channel.unary_stream(f"{RT}/GetContainerEvents")(b"", timeout=CRI_CALL_SECONDS)
            with pytest.raises(grpc.RpcError) as caught:
                list(call)
            codes.append((caught.value.code(), caught.value.details()))  # type: ignore[attr-defined]
    assert codes[0] == codes[1]
    assert codes[0][0] is grpc.StatusCode.UNIMPLEMENTED


# -- port-forward ------------------------------------------------------------------------------


async def echo_through(target: CriTarget, pod: PodRef, port: int, total: int) -> tuple[str, str]:
    """Send `total` random bytes to the echo server at `port`; sha256 of sent and received."""
    stream = await target.open_port(pod, port)
    sent, received = hashlib.sha256(), hashlib.sha256()
    count = 0

    async def upload() -> None:
        left = total
        while left:
            chunk = os.urandom(min(CHUNK_BYTES, left))
            sent.update(chunk)
            await stream.send(chunk)
            left -= len(chunk)

    try:
        async with asyncio.timeout(BIG_TRANSFER_SECONDS), asyncio.TaskGroup() as tasks:
            tasks.create_task(upload())
            while count < total:
                chunk = await stream.receive(CHUNK_BYTES)
                assert chunk, f"EOF after {count} bytes"
                received.update(chunk)
                count += len(chunk)
    finally:
        await stream.aclose()
    return sent.hexdigest(), received.hexdigest()


async def test_containerd_cannot_reach_the_netstack_pod_but_reaches_the_plain_one(
    stack: ProxyStack,
) -> None:
    client = CriClient(str(stack.ctrd.socket))
    target = CriTarget(client)
    try:
        sent, got = await echo_through(target, ref(stack.plain), stack.plain.port, MIB)
        assert sent == got
        with pytest.raises(UpstreamForwardError) as refused:
            stream = await target.open_port(ref(stack.netstack), stack.netstack.port)
            try:
                await stream.send(b"x")
                await stream.receive()
            finally:
                await stream.aclose()
    finally:
        await target.aclose()
        await client.close()
    # containerd's own text (its port-forward dialled in the pod's namespace, as root).
    text = str(refused.value)
    assert f"error forwarding port {stack.netstack.port} to pod {stack.netstack.sandbox_id}" in text
    # runtime-and-nri.md §1.2: the dial ran in the pod's netns, v4 then v6, both failed.
    assert 'failed to execute portforward in network namespace "' in text
    port, sandbox = stack.netstack.port, stack.netstack.sandbox_id
    assert (
        f'failed to connect to localhost:{port} inside namespace "{sandbox}", '
        f"IPv4: dial tcp4 127.0.0.1:{port}: connect: connection refused IPv6 "
    ) in text


async def test_the_proxy_forwards_256_mib_into_the_netstack_pod(stack: ProxyStack) -> None:
    client = CriClient(str(stack.proxy_socket))
    target = CriTarget(client)
    try:
        url = await client.port_forward_url(stack.netstack.sandbox_id)
        direct = await CriClient(str(stack.ctrd.socket)).port_forward_url(stack.plain.sandbox_id)
        passed = await client.port_forward_url(stack.plain.sandbox_id)
        sent, got = await echo_through(
            target, ref(stack.netstack), stack.netstack.port, BIG_TRANSFER_BYTES
        )
    finally:
        await target.aclose()
        await client.close()
    assert sent == got
    # The selected pod's URL is the proxy's; the other pod keeps containerd's streaming server.
    assert url.split("/portforward/")[0] != direct.split("/portforward/")[0]
    assert passed.split("/portforward/")[0] == direct.split("/portforward/")[0]
    assert f"sandbox={stack.netstack.sandbox_id}" in stack.proxy.log()


async def test_udp_through_the_exec_forwarder_is_refused_clearly(stack: ProxyStack) -> None:
    client = CriClient(str(stack.proxy_socket))
    target = CriTarget(client)
    try:
        # The proxy's streaming server takes podgate's UDP extension; its backend cannot.
        with pytest.raises((UpstreamForwardError, TargetError)) as refused:
            stream = await target.open_port(ref(stack.netstack), 53, protocol="udp")
            try:
                await stream.send(b"\x00\x01x")
                await stream.receive()
            finally:
                await stream.aclose()
    finally:
        await target.aclose()
        await client.close()
    assert EXEC_NO_UDP in str(refused.value)


@pytest.mark.parametrize("version", ["1.27", "1.33"])
def test_kubectl_port_forward_through_podgate_node_on_the_proxy(
    stack: ProxyStack, version: str
) -> None:
    binary = kubectl_binary(version)
    node, ready = start_process(
        [
            "node",
            "--state-dir",
            str(stack.work / "node"),
            "--cri-socket",
            str(stack.proxy_socket),
            "--port",
            "0",
        ],
        stack.work / f"node-{version}.log",
        NODE_READY,
    )
    try:
        home = stack.work / f"home-{version}"
        home.mkdir(exist_ok=True)
        kubectl = Kubectl(binary, ready[3].decode(), home)
        local = free_port()
        data = os.urandom(KUBECTL_BYTES)
        with kubectl.port_forward(stack.netstack.name, local, stack.netstack.port) as forwarder:
            got = exchange_tcp(local, data, TRANSFER_SECONDS, half_close=False)
            assert forwarder.proc.poll() is None, forwarder.stderr
        assert (got.nbytes, got.sha256) == (len(data), sha256_hex(data))
    finally:
        stop_process(node.proc)


async def test_exec_via_proxy_relays_and_audits(stack: ProxyStack) -> None:
    work = stack.work / "execproxy"
    work.mkdir()
    second = start_proxy(work, stack.ctrd, "--exec-via-proxy", plane=stack.plane)
    client = CriClient(str(work / "proxy.sock"))
    target = CriTarget(client)
    try:
        url = await client.exec_url(stack.plain.container_id, ["true"])
        direct = await CriClient(str(stack.ctrd.socket)).exec_url(
            stack.plain.container_id, ["true"]
        )
        out, sink = memory_stream_pair()
        io = ExecIO(stdin=None, stdout=sink, stderr=None, tty=False)
        code = await target.exec(
            ref(stack.plain),
            stack.plain.container_id,
            ["sh", "-c", "echo relayed; exit 7"],
            io,
        )
        await sink.send_eof()
        output = b""
        while chunk := await out.receive():
            output += chunk
    finally:
        await target.aclose()
        await client.close()
        stop_process(second.proc)
    assert url.split("/exec/")[0] != direct.split("/exec/")[0]
    assert (code, output) == (7, b"relayed\n")
    log = second.log()
    assert '\\"event\\":\\"stream_started\\",\\"kind\\":\\"exec\\"' in log, log
    assert '\\"exit_code\\":7' in log, log


# -- restarts (last: containerd goes away) -----------------------------------------------------


async def test_the_proxy_restarts_without_losing_what_matters(stack: ProxyStack) -> None:
    stack.restart_proxy()
    client = CriClient(str(stack.proxy_socket))
    target = CriTarget(client)
    try:
        sent, got = await echo_through(target, ref(stack.netstack), stack.netstack.port, MIB)
    finally:
        await target.aclose()
        await client.close()
    assert sent == got
    assert f"sandbox={stack.netstack.sandbox_id}" in stack.proxy.log()


def test_containerd_restarting_fails_calls_then_they_recover(stack: ProxyStack) -> None:
    ctrd = stack.ctrd
    assert ctrd.proc is not None
    # One call through the proxy and the same call straight to containerd, both in flight.
    in_flight: dict[str, BaseException | None] = {"proxy": None, "direct": None}
    sleeping = pb.ExecSyncRequest(
        container_id=stack.plain.container_id,
        cmd=["sleep", str(IN_FLIGHT_SLEEP_SECONDS)],
        timeout=IN_FLIGHT_SLEEP_SECONDS * 2,
    )

    def call(path: str, socket_path: Path) -> None:
        with channel_to(socket_path) as channel:
            try:
                pb_grpc.RuntimeServiceStub(channel).ExecSync(
                    sleeping, timeout=IN_FLIGHT_SLEEP_SECONDS * 3
                )
            except grpc.RpcError as exc:
                in_flight[path] = exc

    callers = [
        threading.Thread(target=call, args=("proxy", stack.proxy_socket)),
        threading.Thread(target=call, args=("direct", ctrd.socket)),
    ]
    for caller in callers:
        caller.start()
    # Both calls have reached containerd once both `sleep`s run in the container.
    for _ in range(int(RECOVER_SECONDS / 0.05)):
        ps = subprocess.run(
            ["pgrep", "-c", "-f", f"^sleep {IN_FLIGHT_SLEEP_SECONDS}$"],
            capture_output=True,
            text=True,
            check=False,
        )
        if ps.stdout.strip().isdigit() and int(ps.stdout) >= 2:
            break
        threading.Event().wait(0.05)
    os.kill(ctrd.proc.pid, signal.SIGTERM)
    ctrd.proc.wait(STOP_GRACE_SECONDS * 3)
    for caller in callers:
        caller.join(CRI_CALL_SECONDS)
        assert not caller.is_alive()
    proxied, direct = in_flight["proxy"], in_flight["direct"]
    assert isinstance(proxied, grpc.RpcError), "the in-flight call did not fail"
    assert isinstance(direct, grpc.RpcError), "the direct in-flight call did not fail"
    # The proxy's caller sees what a direct caller of containerd sees.
    assert proxied.code() is direct.code() is grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    with channel_to(stack.proxy_socket) as channel, pytest.raises(grpc.RpcError) as down:
        pb_grpc.RuntimeServiceStub(channel).Version(pb.VersionRequest(), timeout=CRI_CALL_SECONDS)
    assert down.value.code() is grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]

    assert ctrd.channel is not None
    ctrd.channel.close()
    ctrd.proc = None
    ctrd.start()
    with channel_to(stack.proxy_socket) as channel:
        runtime = pb_grpc.RuntimeServiceStub(channel)
        for _ in range(int(RECOVER_SECONDS / 0.2)):
            try:
                runtime.Version(pb.VersionRequest(), timeout=CRI_CALL_SECONDS)
                break
            except grpc.RpcError as exc:
                assert exc.code() is grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
                threading.Event().wait(0.2)
        else:
            pytest.fail(f"no answer through the proxy {RECOVER_SECONDS} s after the restart")
        # The pods are still there, and the proxy still answers their port-forward.
        mine = runtime.ListContainers(
            pb.ListContainersRequest(
                filter=pb.ContainerFilter(pod_sandbox_id=stack.netstack.sandbox_id)
            ),
            timeout=CRI_CALL_SECONDS,
        ).containers
        assert [c.id for c in mine] == [stack.netstack.container_id]

    async def forward() -> tuple[str, str]:
        client = CriClient(str(stack.proxy_socket))
        target = CriTarget(client)
        try:
            return await echo_through(target, ref(stack.netstack), stack.netstack.port, MIB)
        finally:
            await target.aclose()
            await client.close()

    sent, got = asyncio.run(forward())
    assert sent == got


# -- the sandbox agent --------------------------------------------------------------------------


async def test_the_sandbox_agent_forwards_tcp_and_udp_through_the_proxy(
    stack: ProxyStack,
) -> None:
    """`podgate agent serve` in the netstack pod's namespace stands in for the agent inside a
    gVisor or Kata sandbox; a second proxy is configured with its socket. UDP works there (the
    agent frames datagrams), where the exec forwarder refuses it."""
    work = stack.work / "ag"
    work.mkdir()
    sandbox = stack.netstack.sandbox_id
    pid = sandbox_pid(stack.ctrd.runtime, sandbox)
    agent_log = work / "agent.log"
    udp_port = free_port()
    with agent_log.open("wb") as log:
        agent = subprocess.Popen(
            [
                *("nsenter", "-t", str(pid), "-n"),
                *("setpriv", "--regid", str(AGENT_GID), "--clear-groups"),
                *(sys.executable, "-m", "podgate", "agent", "serve"),
                *("--listen", f"unix://{work}/{sandbox}.sock"),
                *("--host", f"hvsock://{work}/db"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    echo = subprocess.Popen(
        [
            "nsenter",
            "-t",
            str(pid),
            "-n",
            sys.executable,
            "-c",
            UDP_ECHO_SERVER,
            "127.0.0.1",
            str(udp_port),
        ],
        stdout=subprocess.PIPE,
    )
    second: Process | None = None
    try:
        assert echo.stdout is not None and echo.stdout.readline().startswith(b"listening")
        for _ in range(int(READY_SECONDS / 0.05)):
            if (work / f"{sandbox}.sock").exists() or agent.poll() is not None:
                break
            await asyncio.sleep(0.05)
        assert (work / f"{sandbox}.sock").exists(), agent_log.read_text()
        second = start_proxy(
            work,
            stack.ctrd,
            *("--agent-socket", f"{work}/{{sandbox_id}}.sock"),
            *("--agent-dialback", f"{work}/db"),
            plane=stack.plane,
        )
        client = CriClient(str(work / "proxy.sock"))
        target = CriTarget(client)
        try:
            sent, got = await echo_through(target, ref(stack.netstack), stack.netstack.port, MIB)
            assert sent == got
            stream = await target.open_port(ref(stack.netstack), udp_port, protocol="udp")
            payloads = [f"datagram {i}".encode() * (i + 1) for i in range(UDP_DATAGRAMS)]
            decoder, replies = DatagramDecoder(), []
            try:
                async with asyncio.timeout(TRANSFER_SECONDS):
                    for data in payloads:
                        await stream.send(encode_datagram(data))
                        while not (batch := decoder.feed(await stream.receive())):
                            pass
                        replies += batch
            finally:
                await stream.aclose()
            assert replies == payloads
        finally:
            await target.aclose()
            await client.close()
    finally:
        if second is not None:
            stop_process(second.proc)
        for proc in (echo, agent):
            proc.terminate()
            proc.wait(STOP_GRACE_SECONDS)
        if echo.stdout is not None:
            echo.stdout.close()
    log = agent_log.read_text()
    assert f"port={stack.netstack.port} " in log and "protocol=tcp" in log, log
    assert f"port={udp_port} " in log and "protocol=udp" in log, log
