"""Reading one pod from the API (a plain GET), to follow a pod across restarts.

A port-forward session is bound to the pod it was opened for; when a pod of the same name is
created again the old session keeps failing. The engine reads the pod's uid now and then: a
new uid means "reconnect", a 404 means "gone (for now)".
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import h11

from podgate.aio.errors import StreamError
from podgate.aio.streams import SocketStream
from podgate.streaming.client import Endpoint

# Bound on one pod GET, connect to last byte.
POD_GET_TIMEOUT_SECONDS = 10.0
# A pod's JSON is a few KiB; a response bigger than this is not one.
MAX_POD_BYTES = 4 * 1024 * 1024


class PodLookupError(Exception):
    """The pod could not be read (network, TLS, a malformed answer)."""


@dataclass(frozen=True, slots=True)
class PodInfo:
    """What a GET said: `status` 200 with uid and phase, or the HTTP error status."""

    status: int
    uid: str = ""
    phase: str = ""
    message: str = ""
    # What tells one incarnation of the pod from the next: the uid, and (for runtimes that
    # reuse a pod's uid when it is created again) its creation time and IP.
    identity: str = ""

    @property
    def found(self) -> bool:
        return self.status == 200


async def _get(endpoint: Endpoint, path: str) -> tuple[int, bytes]:
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=64 * 1024)
    headers = [("Host", endpoint.authority), ("Accept", "application/json")]
    headers += list(endpoint.headers)
    server_hostname = endpoint.server_hostname or endpoint.host
    if endpoint.unix_path is not None:
        stream = await SocketStream.connect_unix(
            endpoint.unix_path, ssl_context=endpoint.ssl_context, server_hostname=server_hostname
        )
    else:
        stream = await SocketStream.connect(
            endpoint.host,
            endpoint.port,
            ssl_context=endpoint.ssl_context,
            server_hostname=server_hostname,
        )
    try:
        stream.write(conn.send(h11.Request(method="GET", target=path, headers=headers)) or b"")
        stream.write(conn.send(h11.EndOfMessage()) or b"")
        await stream.drain()
        status = 0
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive())
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_POD_BYTES:
                    raise PodLookupError(f"pod answer larger than {MAX_POD_BYTES} bytes")
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return status, bytes(body)
    except h11.RemoteProtocolError as exc:
        raise PodLookupError(f"malformed answer to GET {path}: {exc}") from exc
    finally:
        await stream.aclose()


async def get_pod(endpoint: Endpoint, path: str) -> PodInfo:
    """GET `path` (…/namespaces/NS/pods/NAME); raises PodLookupError when there is no answer."""
    try:
        async with asyncio.timeout(POD_GET_TIMEOUT_SECONDS):
            status, body = await _get(endpoint, path)
    except (StreamError, OSError, TimeoutError) as exc:
        raise PodLookupError(str(exc) or type(exc).__name__) from exc
    try:
        doc = json.loads(body) if body else {}
    except ValueError:
        doc = {}
    if not isinstance(doc, dict):
        doc = {}
    if status != 200:
        message = doc.get("message") if isinstance(doc.get("message"), str) else ""
        return PodInfo(status, message=message or f"HTTP {status}")
    metadata = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
    pod_status = doc.get("status") if isinstance(doc.get("status"), dict) else {}
    assert isinstance(metadata, dict) and isinstance(pod_status, dict)
    uid = str(metadata.get("uid") or "")
    created = str(metadata.get("creationTimestamp") or "")
    identity = f"{uid}|{created}|{pod_status.get('podIP') or ''}" if uid else ""
    return PodInfo(200, uid, str(pod_status.get("phase") or ""), identity=identity)
