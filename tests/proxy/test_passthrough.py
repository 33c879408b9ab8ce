"""The proxy's pass-through against a fake upstream that records raw bytes: unknown fields,
metadata, deadlines, the upstream's errors, streaming, unknown methods, the upstream going
away and coming back, and which PortForward calls the proxy answers itself."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from fake_upstream import FakeUpstream

from podgate.cri import api_pb2 as pb
from podgate.proxy.config import AnnotationMatch, ProxyConfig, Selector
from podgate.proxy.server import CriProxy

RT = "/runtime.v1.RuntimeService"
# Field 999 of a ListContainers request, varint 7: a field podgate's schema lacks.
UNKNOWN_FIELD = bytes([0xB8, 0x3E, 0x07])
CALL_SECONDS = 10.0


def raw(channel: grpc.aio.Channel, method: str) -> Any:
    return channel.unary_unary(f"{RT}/{method}")


@pytest.fixture
async def upstream(tmp_path: Path) -> AsyncIterator[FakeUpstream]:
    fake = FakeUpstream(str(tmp_path / "up.sock"))
    await fake.start()
    yield fake
    await fake.stop()


@pytest.fixture(params=["relay", "grpc"])
def plane(request: pytest.FixtureRequest) -> str:
    """Every test runs on both data planes."""
    return str(request.param)


async def start_proxy(tmp_path: Path, upstream: FakeUpstream, plane: str, **kw: Any) -> CriProxy:
    config = ProxyConfig(
        listen=str(tmp_path / "proxy.sock"), upstream=upstream.socket, data_plane=plane, **kw
    )
    proxy = CriProxy(config)
    await proxy.start()
    return proxy


@pytest.fixture
async def proxied(
    tmp_path: Path, upstream: FakeUpstream, plane: str
) -> AsyncIterator[tuple[CriProxy, grpc.aio.Channel]]:
    proxy = await start_proxy(
        tmp_path,
        upstream,
        plane,
        select=Selector(
            runtime_handlers=frozenset({"kata"}), annotations=(AnnotationMatch("fwd", "exec"),)
        ),
    )
    channel = grpc.aio.insecure_channel(f"unix://{proxy.config.listen}")
    yield proxy, channel
    await channel.close()
    await proxy.stop()


async def test_unknown_fields_reach_the_upstream_and_come_back(
    upstream: FakeUpstream, proxied: tuple[CriProxy, grpc.aio.Channel]
) -> None:
    request = pb.ListContainersRequest(filter=pb.ContainerFilter(id="abc")).SerializeToString()
    request += UNKNOWN_FIELD
    response = pb.ListContainersResponse(containers=[pb.Container(id="c1")]).SerializeToString()
    response += UNKNOWN_FIELD

    async def answer(req: bytes, context: Any) -> bytes:
        return response

    upstream.answers["ListContainers"] = answer
    _, channel = proxied
    got = await raw(channel, "ListContainers")(request, timeout=CALL_SECONDS)
    (call,) = upstream.of("ListContainers")
    assert call.request == request
    assert got == response
    # ...and the schema indeed lacks field 999.
    assert 999 not in {f.number for f in pb.ListContainersRequest.DESCRIPTOR.fields}


async def test_metadata_and_deadline_are_forwarded(
    upstream: FakeUpstream, proxied: tuple[CriProxy, grpc.aio.Channel]
) -> None:
    _, channel = proxied
    await raw(channel, "Version")(
        b"", metadata=(("x-trace", "t-1"), ("x-bin", b"\x00\x01")), timeout=CALL_SECONDS
    )
    await raw(channel, "Version")(b"")
    with_deadline, without = upstream.of("Version")
    assert with_deadline.metadata["x-trace"] == "t-1"
    assert with_deadline.metadata["x-bin"] == b"\x00\x01"
    assert with_deadline.time_remaining is not None
    # grpc-timeout travels in coarse units, rounded up: a few percent over is the same deadline.
    assert 0 < with_deadline.time_remaining <= CALL_SECONDS * 1.05
    assert "x-trace" not in without.metadata
    # No deadline from the caller, none to the upstream (gRPC reports "far away", not None).
    assert without.time_remaining is None or without.time_remaining > CALL_SECONDS * 1000


async def test_upstream_errors_come_back_unchanged(
    upstream: FakeUpstream, proxied: tuple[CriProxy, grpc.aio.Channel]
) -> None:
    async def answer(req: bytes, context: Any) -> bytes:
        context.set_trailing_metadata((("x-why", "gone"),))
        await context.abort(grpc.StatusCode.NOT_FOUND, 'an error occurred when try to find "c9"')
        raise AssertionError

    upstream.answers["ContainerStatus"] = answer
    _, channel = proxied
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await raw(channel, "ContainerStatus")(b"\n\x02c9", timeout=CALL_SECONDS)
    assert caught.value.code() is grpc.StatusCode.NOT_FOUND
    assert caught.value.details() == 'an error occurred when try to find "c9"'
    assert ("x-why", "gone") in tuple(caught.value.trailing_metadata() or ())


async def test_initial_and_trailing_metadata_of_a_success_come_back(
    upstream: FakeUpstream, proxied: tuple[CriProxy, grpc.aio.Channel]
) -> None:
    async def answer(req: bytes, context: Any) -> bytes:
        await context.send_initial_metadata((("x-first", "1"),))
        context.set_trailing_metadata((("x-last", "2"),))
        return b"\n\x010"

    upstream.answers["Status"] = answer
    _, channel = proxied
    call = raw(channel, "Status")(b"", timeout=CALL_SECONDS)
    assert await call == b"\n\x010"
    assert ("x-first", "1") in tuple(await call.initial_metadata())
    assert ("x-last", "2") in tuple(await call.trailing_metadata())


async def test_server_streaming_events_pass_through(
    upstream: FakeUpstream, proxied: tuple[CriProxy, grpc.aio.Channel]
) -> None:
    # ContainerEventResponse{container_id: "cI"} (podgate's schema has no event messages).
    events = [b"\n\x02c" + str(i).encode() + UNKNOWN_FIELD for i in range(5)]
    upstream.stream_messages = events
    _, channel = proxied
    call = channel.unary_stream(f"{RT}/GetContainerEvents")(b"", timeout=CALL_SECONDS)
    got = [message async for message in call]
    assert got == events


async def test_an_unknown_method_passes_through_as_unary(
    upstream: FakeUpstream, proxied: tuple[CriProxy, grpc.aio.Channel]
) -> None:
    async def answer(req: bytes, context: Any) -> bytes:
        return req[::-1]

    upstream.answers["FutureMethod"] = answer
    _, channel = proxied
    assert await raw(channel, "FutureMethod")(b"abc", timeout=CALL_SECONDS) == b"cba"
    assert [c.request for c in upstream.of("FutureMethod")] == [b"abc"]


async def test_calls_fail_while_the_upstream_is_down_then_recover(
    upstream: FakeUpstream, proxied: tuple[CriProxy, grpc.aio.Channel]
) -> None:
    _, channel = proxied
    await raw(channel, "Version")(b"", timeout=CALL_SECONDS)
    await upstream.stop()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await raw(channel, "Version")(b"", timeout=CALL_SECONDS)
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
    await upstream.start()
    async with asyncio.timeout(CALL_SECONDS * 3):
        while True:
            try:
                await raw(channel, "Version")(b"", timeout=CALL_SECONDS)
                break
            except grpc.aio.AioRpcError as exc:
                assert exc.code() is grpc.StatusCode.UNAVAILABLE
                await asyncio.sleep(0.1)


def sandbox_answer(handler: str, annotations: dict[str, str]) -> Any:
    async def answer(req: bytes, context: Any) -> bytes:
        sid = pb.PodSandboxStatusRequest.FromString(req).pod_sandbox_id
        status = pb.PodSandboxStatus(
            id=sid,
            metadata=pb.PodSandboxMetadata(name="p", namespace="ns", uid="u"),
            runtime_handler=handler,
            annotations=annotations,
        )
        return pb.PodSandboxStatusResponse(status=status).SerializeToString()

    return answer


async def upstream_url(req: bytes, context: Any) -> bytes:
    return pb.PortForwardResponse(url="http://127.0.0.1:1/portforward/UPSTREAM").SerializeToString()


@pytest.mark.parametrize(
    ("handler", "annotations", "selected"),
    [
        ("kata", {}, True),
        ("runc", {"fwd": "exec"}, True),
        ("runc", {"fwd": "other"}, False),
        ("runc", {}, False),
    ],
)
async def test_port_forward_is_answered_for_selected_pods_only(
    upstream: FakeUpstream,
    proxied: tuple[CriProxy, grpc.aio.Channel],
    handler: str,
    annotations: dict[str, str],
    selected: bool,
) -> None:
    upstream.answers["PodSandboxStatus"] = sandbox_answer(handler, annotations)
    upstream.answers["PortForward"] = upstream_url
    proxy, channel = proxied
    stub = channel.unary_unary(
        f"{RT}/PortForward",
        request_serializer=pb.PortForwardRequest.SerializeToString,
        response_deserializer=pb.PortForwardResponse.FromString,
    )
    response = await stub(pb.PortForwardRequest(pod_sandbox_id="s1"), timeout=CALL_SECONDS)
    if selected:
        assert response.url.startswith(proxy.streaming.base_url + "/portforward/")
        # The gRPC plane answers itself; the relay has the runtime answer and swaps the URL.
        expected_upstream_calls = 1 if proxy.config.data_plane == "relay" else 0
        assert len(upstream.of("PortForward")) == expected_upstream_calls
    else:
        assert response.url == "http://127.0.0.1:1/portforward/UPSTREAM"
        assert len(upstream.of("PortForward")) == 1


async def test_the_sandbox_is_looked_up_once_until_it_is_removed(
    upstream: FakeUpstream, proxied: tuple[CriProxy, grpc.aio.Channel]
) -> None:
    upstream.answers["PodSandboxStatus"] = sandbox_answer("kata", {})
    proxy, channel = proxied
    request = pb.PortForwardRequest(pod_sandbox_id="s1").SerializeToString()
    for _ in range(3):
        await raw(channel, "PortForward")(request, timeout=CALL_SECONDS)
    assert len(upstream.of("PodSandboxStatus")) == 1
    remove = pb.RemovePodSandboxRequest(pod_sandbox_id="s1").SerializeToString()
    await raw(channel, "RemovePodSandbox")(remove, timeout=CALL_SECONDS)
    assert len(proxy.sandboxes) == 0
    await raw(channel, "PortForward")(request, timeout=CALL_SECONDS)
    assert len(upstream.of("PodSandboxStatus")) == 2


async def test_a_sandbox_the_upstream_does_not_know_gets_the_upstreams_answer(
    upstream: FakeUpstream, proxied: tuple[CriProxy, grpc.aio.Channel]
) -> None:
    async def missing(req: bytes, context: Any) -> bytes:
        await context.abort(grpc.StatusCode.NOT_FOUND, "sandbox not found")
        raise AssertionError

    upstream.answers["PodSandboxStatus"] = missing
    upstream.answers["PortForward"] = missing
    _, channel = proxied
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await raw(channel, "PortForward")(b"\n\x02s1", timeout=CALL_SECONDS)
    assert (caught.value.code(), caught.value.details()) == (
        grpc.StatusCode.NOT_FOUND,
        "sandbox not found",
    )


async def test_exec_via_proxy_wraps_the_upstream_url_and_keeps_unknown_fields(
    tmp_path: Path, upstream: FakeUpstream, plane: str
) -> None:
    response = pb.ExecResponse(url="http://127.0.0.1:1/exec/UP").SerializeToString()

    async def answer(req: bytes, context: Any) -> bytes:
        return response + UNKNOWN_FIELD

    upstream.answers["Exec"] = answer
    proxy = await start_proxy(tmp_path, upstream, plane, exec_via_proxy=True)
    try:
        async with grpc.aio.insecure_channel(f"unix://{proxy.config.listen}") as channel:
            request = pb.ExecRequest(container_id="c1", cmd=["ls"], stdout=True)
            got = await raw(channel, "Exec")(request.SerializeToString(), timeout=CALL_SECONDS)
    finally:
        await proxy.stop()
    parsed = pb.ExecResponse.FromString(got)
    assert parsed.url.startswith(proxy.streaming.base_url + "/exec/")
    assert got.endswith(UNKNOWN_FIELD)
    (call,) = upstream.of("Exec")
    assert call.request == request.SerializeToString()


async def test_without_exec_via_proxy_exec_urls_pass_through(
    upstream: FakeUpstream, proxied: tuple[CriProxy, grpc.aio.Channel]
) -> None:
    response = pb.ExecResponse(url="http://127.0.0.1:1/exec/UP").SerializeToString()

    async def answer(req: bytes, context: Any) -> bytes:
        return response

    upstream.answers["Exec"] = answer
    _, channel = proxied
    assert await raw(channel, "Exec")(b"\n\x02c1", timeout=CALL_SECONDS) == response


async def test_a_malformed_port_forward_request_goes_to_the_upstream_as_is(
    upstream: FakeUpstream, proxied: tuple[CriProxy, grpc.aio.Channel]
) -> None:
    async def refuse(req: bytes, context: Any) -> bytes:
        await context.abort(grpc.StatusCode.INTERNAL, "grpc: error unmarshalling request")
        raise AssertionError

    upstream.answers["PortForward"] = refuse
    _, channel = proxied
    garbage = b"\x0a\xff\xff"  # field 1, a length running past the end
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await raw(channel, "PortForward")(garbage, timeout=CALL_SECONDS)
    assert caught.value.code() is grpc.StatusCode.INTERNAL
    assert [c.request for c in upstream.of("PortForward")] == [garbage]
    assert upstream.of("PodSandboxStatus") == []
    # ...and the proxy goes on serving.
    assert await raw(channel, "Version")(b"", timeout=CALL_SECONDS) == b""


async def test_an_exec_answer_the_proxy_cannot_read_is_passed_on_unchanged(
    tmp_path: Path, upstream: FakeUpstream, plane: str
) -> None:
    odd = b"\x0a\xff\xff"

    async def answer(req: bytes, context: Any) -> bytes:
        return odd

    upstream.answers["Exec"] = answer
    proxy = await start_proxy(tmp_path, upstream, plane, exec_via_proxy=True)
    try:
        async with grpc.aio.insecure_channel(f"unix://{proxy.config.listen}") as channel:
            got = await raw(channel, "Exec")(b"\n\x02c1", timeout=CALL_SECONDS)
    finally:
        await proxy.stop()
    assert got == odd


async def test_streaming_urls_on_a_unix_socket(
    tmp_path: Path, upstream: FakeUpstream, plane: str
) -> None:
    upstream.answers["PodSandboxStatus"] = sandbox_answer("kata", {})
    stream_socket = tmp_path / "stream.sock"
    proxy = await start_proxy(
        tmp_path,
        upstream,
        plane,
        select=Selector(all=True),
        stream_socket=str(stream_socket),
    )
    try:
        async with grpc.aio.insecure_channel(f"unix://{proxy.config.listen}") as channel:
            got = await raw(channel, "PortForward")(
                pb.PortForwardRequest(pod_sandbox_id="s1").SerializeToString(),
                timeout=CALL_SECONDS,
            )
    finally:
        await proxy.stop()
    url = pb.PortForwardResponse.FromString(got).url
    assert url.startswith("http+unix://" + str(stream_socket).replace("/", "%2F") + "/portforward/")


async def test_attach_via_proxy_wraps_the_upstream_url(
    tmp_path: Path, upstream: FakeUpstream, plane: str
) -> None:
    async def answer(req: bytes, context: Any) -> bytes:
        return pb.AttachResponse(url="http://127.0.0.1:1/attach/UP").SerializeToString()

    upstream.answers["Attach"] = answer
    proxy = await start_proxy(tmp_path, upstream, plane, exec_via_proxy=True)
    try:
        async with grpc.aio.insecure_channel(f"unix://{proxy.config.listen}") as channel:
            request = pb.AttachRequest(container_id="c1", stdin=True, stdout=True)
            got = await raw(channel, "Attach")(request.SerializeToString(), timeout=CALL_SECONDS)
    finally:
        await proxy.stop()
    assert pb.AttachResponse.FromString(got).url.startswith(proxy.streaming.base_url + "/attach/")


async def test_stopping_removes_the_socket(
    tmp_path: Path, upstream: FakeUpstream, plane: str
) -> None:
    proxy = await start_proxy(tmp_path, upstream, plane)
    assert Path(proxy.config.listen).exists()
    assert Path(proxy.config.listen).stat().st_mode & 0o777 == 0o660
    await proxy.stop()
    assert not Path(proxy.config.listen).exists()


async def test_a_client_that_is_not_http2_is_dropped_and_others_go_on(
    tmp_path: Path, upstream: FakeUpstream
) -> None:
    proxy = await start_proxy(tmp_path, upstream, "relay")
    try:
        reader, writer = await asyncio.open_unix_connection(proxy.config.listen)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        async with asyncio.timeout(CALL_SECONDS):
            assert await reader.read() == b""  # closed, nothing relayed back
        writer.close()
        async with grpc.aio.insecure_channel(f"unix://{proxy.config.listen}") as channel:
            assert await raw(channel, "Version")(b"", timeout=CALL_SECONDS) == b""
    finally:
        await proxy.stop()
    assert [c.method for c in upstream.calls] == [f"{RT}/Version"]


async def test_many_concurrent_calls_on_one_connection_each_get_their_own_answer(
    upstream: FakeUpstream, proxied: tuple[CriProxy, grpc.aio.Channel]
) -> None:
    """Intercepted and plain calls interleaved on one HTTP/2 connection (the kubelet's way):
    every answer is the one for its own request."""
    upstream.answers["PodSandboxStatus"] = sandbox_answer("kata", {})

    async def echo(req: bytes, context: Any) -> bytes:
        await asyncio.sleep(0.001 * (len(req) % 7))  # answers come back out of order
        return req[::-1]

    upstream.answers["FutureMethod"] = echo
    upstream.answers["PortForward"] = upstream_url
    proxy, channel = proxied
    forward = channel.unary_unary(
        f"{RT}/PortForward",
        request_serializer=pb.PortForwardRequest.SerializeToString,
        response_deserializer=pb.PortForwardResponse.FromString,
    )
    plain = raw(channel, "FutureMethod")
    count = 100

    async def one_plain(i: int) -> None:
        body = f"request {i} ".encode() * (i % 13 + 1)
        assert await plain(body, timeout=CALL_SECONDS) == body[::-1]

    async def one_forward(i: int) -> str:
        request = pb.PortForwardRequest(pod_sandbox_id=f"s{i % 5}", port=[1000 + i])
        response = await forward(request, timeout=CALL_SECONDS)
        return str(response.url)

    async with asyncio.TaskGroup() as tasks:
        plains = [tasks.create_task(one_plain(i)) for i in range(count)]
        forwards = [tasks.create_task(one_forward(i)) for i in range(count)]
    assert all(p.done() for p in plains)
    urls = [f.result() for f in forwards]
    assert all(u.startswith(proxy.streaming.base_url + "/portforward/") for u in urls)
    assert len(set(urls)) == count  # one token each
    # Each URL's token stands for its own call's sandbox and port.
    now = proxy.streaming.clock()
    for i, url in enumerate(urls):
        pending = proxy.streaming.tokens.consume(url.rsplit("/", 1)[1], now)
        assert pending is not None
        assert (pending.pod.sandbox_id, pending.ports) == (f"s{i % 5}", (1000 + i,))


async def test_large_messages_pass_whole(
    upstream: FakeUpstream, proxied: tuple[CriProxy, grpc.aio.Channel]
) -> None:
    """Messages of several flow-control windows (HTTP/2's initial window is 64 KiB) each way."""
    big_answer = os.urandom(3 * 1024 * 1024)

    async def answer(req: bytes, context: Any) -> bytes:
        return hashlib.sha256(req).digest() + big_answer

    upstream.answers["ListContainers"] = answer
    _, channel = proxied
    request = os.urandom(2 * 1024 * 1024)
    got = await raw(channel, "ListContainers")(request, timeout=CALL_SECONDS)
    assert got == hashlib.sha256(request).digest() + big_answer
