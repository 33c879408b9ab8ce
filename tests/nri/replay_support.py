"""Replaying a capture's plugin side against a real Adaptation on its unix socket.

The scripted plugin sends the captured plugin->runtime frames byte for byte: RegisterPlugin
first, then each captured reply as soon as podgate has sent the request it answers (same
connection and stream id, same method). It records every frame podgate sends. The driver calls
the Adaptation's event methods with the pods and containers podgate sent in the capture, so
podgate's requests can be compared with the captured ones.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from capture_support import REQUEST, RESPONSE, Capture, Captured

from podgate.nri import api_pb2 as api
from podgate.nri.adaptation import Adaptation
from podgate.proto.ttrpc import envelope_pb2

WAIT_SECONDS = 10.0  # bound on every wait of a replay
_MUX = struct.Struct(">II")
_TTRPC = struct.Struct(">IIBB")


@dataclass
class Sent:
    """A frame podgate sent during the replay."""

    conn: int
    stream_id: int
    kind: int
    frame: bytes
    envelope: envelope_pb2.Request | envelope_pb2.Response


@dataclass
class Replay:
    capture: Capture
    sent: list[Sent] = field(default_factory=list)
    results: dict[str, list[Any]] = field(default_factory=dict)  # method -> what it returned

    def requests(self, method: str) -> list[Sent]:
        return [
            s
            for s in self.sent
            if s.kind == REQUEST
            and isinstance(s.envelope, envelope_pb2.Request)
            and s.envelope.method == method
        ]


class ScriptedPlugin:
    def __init__(self, capture: Capture, replay: Replay) -> None:
        self.capture = capture
        self.replay = replay
        self._arrived = asyncio.Condition()
        self._requests: dict[tuple[int, int], str] = {}  # podgate's requests by (conn, sid)

    async def run(self, socket_path: str) -> None:
        reader, writer = await asyncio.open_unix_connection(socket_path)
        reading = asyncio.create_task(self._read(reader))
        try:
            for message in self.capture.plugin_messages():
                if message.kind == RESPONSE:
                    await self._wait_for_request(message)
                writer.write(message.frame)
                await writer.drain()
            await self._wait_idle()
        finally:
            writer.close()
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)

    async def _wait_for_request(self, reply: Captured) -> None:
        key = (reply.conn, reply.stream_id)
        async with asyncio.timeout(WAIT_SECONDS), self._arrived:
            await self._arrived.wait_for(lambda: key in self._requests)
        assert self._requests[key] == reply.method, (key, self._requests[key], reply.method)

    async def _wait_idle(self) -> None:
        """Until podgate has sent as many frames as the capture shows it sending."""
        expected = len([m for m in self.capture.messages if not m.from_plugin])
        async with asyncio.timeout(WAIT_SECONDS), self._arrived:
            await self._arrived.wait_for(lambda: len(self.replay.sent) >= expected)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while True:
            header = await reader.readexactly(_MUX.size)
            conn, length = _MUX.unpack(header)
            payload = await reader.readexactly(length)
            size, stream_id, kind, _ = _TTRPC.unpack_from(payload)
            data = payload[_TTRPC.size : _TTRPC.size + size]
            envelope: envelope_pb2.Request | envelope_pb2.Response
            if kind == REQUEST:
                envelope = envelope_pb2.Request.FromString(data)
            else:
                envelope = envelope_pb2.Response.FromString(data)
            async with self._arrived:
                if isinstance(envelope, envelope_pb2.Request):
                    self._requests[(conn, stream_id)] = envelope.method
                self.replay.sent.append(Sent(conn, stream_id, kind, header + payload, envelope))
                self._arrived.notify_all()


def _event_calls(adaptation: Adaptation) -> dict[str, Callable[[Any], Awaitable[Any]]]:
    """Captured podgate request -> the Adaptation call that makes podgate send it."""
    return {
        "RunPodSandbox": lambda r: adaptation.run_pod_sandbox(r.pod),
        "StopPodSandbox": lambda r: adaptation.stop_pod_sandbox(r.pod),
        "RemovePodSandbox": lambda r: adaptation.remove_pod_sandbox(r.pod),
        "CreateContainer": lambda r: adaptation.create_container(r.pod, r.container),
        "PostCreateContainer": lambda r: adaptation.post_create_container(r.pod, r.container),
        "StartContainer": lambda r: adaptation.start_container(r.pod, r.container),
        "PostStartContainer": lambda r: adaptation.post_start_container(r.pod, r.container),
        "StopContainer": lambda r: adaptation.stop_container(r.pod, r.container),
        "RemoveContainer": lambda r: adaptation.remove_container(r.pod, r.container),
    }


async def replay(capture: Capture, adaptation: Adaptation, socket_path: str) -> Replay:
    """Run the capture's plugin side against `adaptation` and drive its events in order."""
    result = Replay(capture)
    plugin = ScriptedPlugin(capture, result)
    calls = _event_calls(adaptation)
    async with asyncio.TaskGroup() as group:
        group.create_task(plugin.run(socket_path))
        async with asyncio.timeout(WAIT_SECONDS):
            while not adaptation.plugins:  # noqa: ASYNC110 - the registry has no event
                await asyncio.sleep(0.01)
        for message in capture.messages:
            if message.from_plugin or message.kind != REQUEST or message.method not in calls:
                continue
            returned = await calls[message.method](message.message)
            result.results.setdefault(message.method, []).append(returned)
    return result


def synchronized(capture: Capture) -> tuple[list[api.PodSandbox], list[api.Container]]:
    """The pods and containers podgate synchronized the plugin with."""
    [sync] = capture.requests("Synchronize")
    assert isinstance(sync.message, api.SynchronizeRequest)
    return list(sync.message.pods), list(sync.message.containers)
