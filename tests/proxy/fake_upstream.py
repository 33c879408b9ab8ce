"""A fake CRI runtime for the proxy's unit tests: a gRPC server that records every call's raw
request bytes, metadata and deadline, and answers from a script (imported by module name)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio

STREAMING = {"/runtime.v1.RuntimeService/GetContainerEvents"}


@dataclass
class Call:
    method: str
    request: bytes
    metadata: dict[str, str | bytes]
    time_remaining: float | None


Answer = Callable[[bytes, grpc.aio.ServicerContext[Any, Any]], Awaitable[bytes]]


@dataclass
class FakeUpstream:
    socket: str
    calls: list[Call] = field(default_factory=list)
    answers: dict[str, Answer] = field(default_factory=dict)
    stream_messages: list[bytes] = field(default_factory=list)
    server: grpc.aio.Server | None = None

    def of(self, method: str) -> list[Call]:
        return [c for c in self.calls if c.method.endswith("/" + method)]

    def _record(self, method: str, request: bytes, context: Any) -> None:
        self.calls.append(
            Call(method, request, dict(context.invocation_metadata()), context.time_remaining())
        )

    async def start(self) -> None:
        fake = self

        class Handler(grpc.GenericRpcHandler):
            def service(self, details: grpc.HandlerCallDetails) -> Any:
                method = details.method

                async def unary(request: bytes, context: Any) -> bytes:
                    fake._record(method, request, context)
                    answer = fake.answers.get(method.rsplit("/", 1)[1])
                    return await answer(request, context) if answer else b""

                async def stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
                    fake._record(method, request, context)
                    for message in fake.stream_messages:
                        yield message

                if method in STREAMING:
                    return grpc.unary_stream_rpc_method_handler(stream)
                return grpc.unary_unary_rpc_method_handler(unary)

        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket)
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((Handler(),))
        self.server.add_insecure_port(f"unix://{self.socket}")
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)
            self.server = None
