"""Reading the shared NRI captures (tests/nri/captures, see its README): each direction's byte
stream cut into mux frames, ttrpc messages and NRI payloads, with each response matched to its
request by connection and stream id."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import unknown_fields
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from podgate.nri import api_pb2 as api
from podgate.proto.ttrpc import envelope_pb2

CAPTURE_DIR = Path(__file__).parent / "captures"
SCENARIOS = (
    "1-logger-v0.12.2",
    "2-device-injector",
    "3-ulimit-adjuster",
    "4-logger-v0.10.0",
    "5-template",
)
PLUGIN_TO_RUNTIME = "plugin->runtime"
RUNTIME_TO_PLUGIN = "runtime->plugin"
PLUGIN_CONN = 1  # the plugin's ttrpc server (runtime calls Plugin)
RUNTIME_CONN = 2  # the runtime's ttrpc server (plugin calls Runtime)
REQUEST, RESPONSE = 1, 2
_MUX = struct.Struct(">II")
_TTRPC = struct.Struct(">IIBB")

# method -> (request type, reply type), both services.
METHOD_TYPES: dict[str, tuple[type[Message], type[Message]]] = {
    "RegisterPlugin": (api.RegisterPluginRequest, api.Empty),
    "UpdateContainers": (api.UpdateContainersRequest, api.UpdateContainersResponse),
    "Configure": (api.ConfigureRequest, api.ConfigureResponse),
    "Synchronize": (api.SynchronizeRequest, api.SynchronizeResponse),
    "Shutdown": (api.Empty, api.Empty),
    "RunPodSandbox": (api.RunPodSandboxRequest, api.RunPodSandboxResponse),
    "UpdatePodSandbox": (api.UpdatePodSandboxRequest, api.UpdatePodSandboxResponse),
    "PostUpdatePodSandbox": (api.PostUpdatePodSandboxRequest, api.PostUpdatePodSandboxResponse),
    "StopPodSandbox": (api.StopPodSandboxRequest, api.StopPodSandboxResponse),
    "RemovePodSandbox": (api.RemovePodSandboxRequest, api.RemovePodSandboxResponse),
    "CreateContainer": (api.CreateContainerRequest, api.CreateContainerResponse),
    "PostCreateContainer": (api.PostCreateContainerRequest, api.PostCreateContainerResponse),
    "StartContainer": (api.StartContainerRequest, api.StartContainerResponse),
    "PostStartContainer": (api.PostStartContainerRequest, api.PostStartContainerResponse),
    "UpdateContainer": (api.UpdateContainerRequest, api.UpdateContainerResponse),
    "PostUpdateContainer": (api.PostUpdateContainerRequest, api.PostUpdateContainerResponse),
    "StopContainer": (api.StopContainerRequest, api.StopContainerResponse),
    "RemoveContainer": (api.RemoveContainerRequest, api.RemoveContainerResponse),
    "StateChange": (api.StateChangeEvent, api.Empty),
    "ValidateContainerAdjustment": (
        api.ValidateContainerAdjustmentRequest,
        api.ValidateContainerAdjustmentResponse,
    ),
}


@dataclass
class Captured:
    """One ttrpc message of a capture."""

    direction: str
    conn: int
    stream_id: int
    kind: int  # REQUEST or RESPONSE
    frame: bytes  # the whole mux frame, header included
    envelope: envelope_pb2.Request | envelope_pb2.Response
    method: str = ""
    message: Message | None = None  # the NRI payload, decoded; None for an error reply

    @property
    def from_plugin(self) -> bool:
        return self.direction == PLUGIN_TO_RUNTIME


@dataclass
class Capture:
    name: str
    messages: list[Captured] = field(default_factory=list)

    def plugin_messages(self) -> list[Captured]:
        return [m for m in self.messages if m.from_plugin]

    def replies(self, method: str) -> list[Captured]:
        """The plugin's replies to `method` calls of the runtime, in order."""
        return [m for m in self.messages if m.kind == RESPONSE and m.method == method]

    def requests(self, method: str) -> list[Captured]:
        return [m for m in self.messages if m.kind == REQUEST and m.method == method]


def _frames(stream: bytes) -> Iterator[tuple[int, bytes, bytes]]:
    while stream:
        conn, length = _MUX.unpack_from(stream)
        end = _MUX.size + length
        assert len(stream) >= end, "truncated mux frame"
        yield conn, stream[_MUX.size : end], stream[:end]
        stream = stream[end:]


def load(name: str) -> Capture:
    rows = [json.loads(line) for line in (CAPTURE_DIR / f"{name}.jsonl").read_text().splitlines()]
    capture = Capture(name)
    pending: dict[tuple[int, int], str] = {}  # (conn, stream id) -> method of the request
    streams = {
        direction: b"".join(bytes.fromhex(r["hex"]) for r in rows if r["dir"] == direction)
        for direction in (PLUGIN_TO_RUNTIME, RUNTIME_TO_PLUGIN)
    }
    # Every ttrpc message sits in one mux frame here (captures README), so frames are messages.
    # Interleave the directions by each frame's first chunk time for request/reply matching.
    timed: list[tuple[float, str, int, bytes, bytes]] = []
    for direction, stream in streams.items():
        times = _frame_times(rows, direction)
        for (conn, payload, frame), t in zip(_frames(stream), times, strict=True):
            timed.append((t, direction, conn, payload, frame))
    timed.sort(key=lambda item: item[0])
    for _, direction, conn, payload, frame in timed:
        length, stream_id, kind, _flags = _TTRPC.unpack_from(payload)
        data = payload[_TTRPC.size : _TTRPC.size + length]
        assert len(data) == length
        if kind == REQUEST:
            request = envelope_pb2.Request.FromString(data)
            pending[(conn, stream_id)] = request.method
            message = METHOD_TYPES[request.method][0].FromString(request.payload)
            capture.messages.append(
                Captured(direction, conn, stream_id, kind, frame, request, request.method, message)
            )
        else:
            response = envelope_pb2.Response.FromString(data)
            method = pending.pop((conn, stream_id))
            reply = (
                None
                if response.HasField("status") and response.status.code
                else METHOD_TYPES[method][1].FromString(response.payload)
            )
            capture.messages.append(
                Captured(direction, conn, stream_id, kind, frame, response, method, reply)
            )
    return capture


def _frame_times(rows: list[dict[str, object]], direction: str) -> list[float]:
    """The time of the chunk each frame of `direction` starts in."""
    chunks = [(float(r["t"]), bytes.fromhex(str(r["hex"]))) for r in rows if r["dir"] == direction]  # type: ignore[arg-type]
    stream = b"".join(chunk for _, chunk in chunks)
    times: list[float] = []
    offset = position = 0  # where the next frame starts; bytes of the stream read so far
    for t, chunk in chunks:
        position += len(chunk)
        while offset < position:
            times.append(t)
            _, length = _MUX.unpack_from(stream, offset)
            offset += _MUX.size + length
    return times


def unknown_field_paths(message: Message, path: str = "") -> list[str]:
    """Where in `message` (recursively) protobuf kept fields it does not know."""
    found: list[str] = []
    here = path or message.DESCRIPTOR.name
    unknown = unknown_fields.UnknownFieldSet(message)
    found.extend(f"{here}#{unknown[i].field_number}" for i in range(len(unknown)))
    for descriptor, value in message.ListFields():
        if descriptor.type != FieldDescriptor.TYPE_MESSAGE:
            continue
        child = f"{here}.{descriptor.name}"
        if descriptor.message_type.GetOptions().map_entry:
            if descriptor.message_type.fields_by_name["value"].type == FieldDescriptor.TYPE_MESSAGE:
                for key, item in value.items():
                    found.extend(unknown_field_paths(item, f"{child}[{key}]"))
        elif descriptor.is_repeated:
            for i, item in enumerate(value):
                found.extend(unknown_field_paths(item, f"{child}[{i}]"))
        else:
            found.extend(unknown_field_paths(value, child))
    return found
