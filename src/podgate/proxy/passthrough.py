"""CRI calls passed through to the upstream runtime as bytes.

Every method of runtime.v1 RuntimeService and ImageService, and any other method name a client
sends, is forwarded with identity serializers, so fields podgate's schema does not know reach
the runtime (and come back) unchanged. What is forwarded: the request bytes, the caller's
metadata, the remaining deadline; back come the response bytes, the upstream's initial and
trailing metadata and, on failure, its status code and details unchanged.

The method kinds (unary, server-streaming) come from the CRI descriptors, plus the streaming
methods of runtime.v1 that podgate's subset leaves out; any other method is taken as unary
(the kind the CRI uses for everything but event streams).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Final, NoReturn

import grpc
import grpc.aio

from podgate.cri import api_pb2

log = logging.getLogger(__name__)

# The kubelet's CRI message limit (pkg/kubelet/cri/remote maxMsgSize); big lists fit.
MAX_MESSAGE_BYTES: Final = 16 * 1024 * 1024
# Reconnect quickly after the runtime restarts: gRPC's default backoff grows to two minutes,
# during which every call would fail although the runtime is back.
RECONNECT_BACKOFF_MS: Final = 100
MAX_RECONNECT_BACKOFF_MS: Final = 1000
# Metadata gRPC itself owns; the rest is the caller's and is forwarded.
_RESERVED_PREFIXES: Final = (":", "grpc-")
_RESERVED_KEYS: Final = frozenset({"user-agent", "content-type", "te"})
# runtime.v1 methods outside podgate's subset of the schema whose server streams (the Stream*
# list methods of k8s.io/cri-api, feature gate CRIListStreaming); every other one of them is
# unary. GetContainerEvents, the Evented PLEG's stream, is in the schema.
UPSTREAM_STREAMING_METHODS: Final = frozenset(
    {
        "/runtime.v1.RuntimeService/StreamPodSandboxes",
        "/runtime.v1.RuntimeService/StreamContainers",
        "/runtime.v1.RuntimeService/StreamContainerStats",
        "/runtime.v1.RuntimeService/StreamPodSandboxStats",
        "/runtime.v1.RuntimeService/StreamPodSandboxMetrics",
        "/runtime.v1.ImageService/StreamImages",
    }
)

Metadata = Iterable[tuple[str, str | bytes]]
# An interception: the response bytes it answers with, or None to pass the call through.
Intercept = Callable[[bytes, grpc.aio.ServicerContext[Any, Any]], Awaitable[bytes | None]]
# After a call passed through: the request and response bytes (e.g. to invalidate caches).
Observer = Callable[[bytes, bytes], None]


def method_kinds() -> dict[str, bool]:
    """`/package.Service/Method` → whether the server streams, for every CRI method."""
    kinds = dict.fromkeys(UPSTREAM_STREAMING_METHODS, True)
    for service in api_pb2.DESCRIPTOR.services_by_name.values():
        for method in service.methods:
            kinds[f"/{service.full_name}/{method.name}"] = method.server_streaming
    return kinds


def forwardable(metadata: Any) -> tuple[tuple[str, str | bytes], ...]:
    """The caller's own metadata, without what gRPC sets on every call."""
    if not metadata:
        return ()
    pairs: Metadata = metadata
    return tuple(
        (key, value)
        for key, value in pairs
        if key not in _RESERVED_KEYS and not key.startswith(_RESERVED_PREFIXES)
    )


def upstream_channel(target: str) -> grpc.aio.Channel:
    """A channel to the runtime that reconnects by itself within a second of it coming back."""
    return grpc.aio.insecure_channel(
        target,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
            ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
            ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
        ],
    )


async def relay_error(context: grpc.aio.ServicerContext[Any, Any], exc: grpc.RpcError) -> NoReturn:
    """Fail the caller's call as the upstream failed ours: same code, details and trailers."""
    assert isinstance(exc, grpc.aio.AioRpcError)
    trailing = forwardable(exc.trailing_metadata()) + tuple(
        (k, v) for k, v in (exc.trailing_metadata() or ()) if k == "grpc-status-details-bin"
    )
    await context.abort(exc.code(), exc.details() or "", trailing)
    raise AssertionError("abort returned")  # pragma: no cover - abort always raises


class PassThrough(grpc.GenericRpcHandler):
    """The generic handler: one per proxy, every method."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel
        self.kinds = method_kinds()
        self.intercepts: dict[str, Intercept] = {}
        self.observers: dict[str, Observer] = {}
        self._unary: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
        self._callables: dict[str, grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]] = {}

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any]:
        method: str = handler_call_details.method
        if self.kinds.get(method, False):
            return grpc.unary_stream_rpc_method_handler(self._streaming_handler(method))
        handler = self._unary.get(method)
        if handler is None:
            handler = grpc.unary_unary_rpc_method_handler(self._unary_handler(method))
            # Bounded: CRI names are few, and unknown ones are cached only once seen.
            if len(self._unary) < len(self.kinds) * 2:
                self._unary[method] = handler
        return handler

    def _upstream(self, method: str) -> grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]:
        call = self._callables.get(method)
        if call is None:
            call = self.channel.unary_unary(method)
            if len(self._callables) < len(self.kinds) * 2:
                self._callables[method] = call
        return call

    async def call_upstream(
        self, method: str, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes:
        """The upstream's response to `request`, with its metadata put on the caller's call;
        its failure becomes the caller's."""
        call = self._upstream(method)(
            request,
            metadata=forwardable(context.invocation_metadata()),
            timeout=context.time_remaining(),
        )
        try:
            response = await call
            initial = forwardable(await call.initial_metadata())
            trailing = forwardable(await call.trailing_metadata())
        except grpc.aio.AioRpcError as exc:
            await relay_error(context, exc)
        if initial:
            await context.send_initial_metadata(initial)
        if trailing:
            context.set_trailing_metadata(trailing)
        return response

    def _unary_handler(
        self, method: str
    ) -> Callable[[bytes, grpc.aio.ServicerContext[Any, Any]], Awaitable[bytes]]:
        intercept = self.intercepts.get(method)
        observer = self.observers.get(method)

        async def handle(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            if intercept is not None:
                answer = await intercept(request, context)
                if answer is not None:
                    return answer
            response = await self.call_upstream(method, request, context)
            if observer is not None:
                observer(request, response)
            return response

        return handle

    def _streaming_handler(
        self, method: str
    ) -> Callable[[bytes, grpc.aio.ServicerContext[Any, Any]], AsyncIterator[bytes]]:
        async def handle(
            request: bytes, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[bytes]:
            upstream: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = self.channel.unary_stream(
                method
            )
            call = upstream(
                request,
                metadata=forwardable(context.invocation_metadata()),
                timeout=context.time_remaining(),
            )
            try:
                initial = forwardable(await call.initial_metadata())
                if initial:
                    await context.send_initial_metadata(initial)
                async for message in call:
                    yield message
                trailing = forwardable(await call.trailing_metadata())
            except grpc.aio.AioRpcError as exc:
                await relay_error(context, exc)
            finally:
                # The caller went away (or we failed): stop the upstream stream too.
                call.cancel()
            if trailing:
                context.set_trailing_metadata(trailing)

        return handle
